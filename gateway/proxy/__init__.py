"""The HTTP side: routing, client identity, forwarding, and the responses clients see."""
