"""An HTTP API gateway that enforces rate limits across a fleet of processes.

Packages, from the bottom: `config` (the YAML, parsed once), `limiter` (the decision
and the in-process store), `metrics`, `identity` (who a client is), then `proxy` (the
HTTP side) and `redis` (the shared store) beside each other, `admin`, and the process
around them (`app`, `listeners`, `server`, `cli`). The README's Layout section lists
the modules; pyproject.toml holds the import contracts that keep this order."""

__version__ = "0.1.0"
