"""An HTTP API gateway that enforces rate limits across a fleet of processes."""

__version__ = "0.1.0"
