"""The HTTP side: the public listener's protocol and per-connection bounds, routing, the
per-route plans compiled from the config, forwarding through our upstream client, the
access log, and the answers clients see. It asks the limiter for decisions and
`gateway.identity` who a client is, and knows nothing of Redis; it trusts the config,
and nothing a client sends until it has been checked here."""
