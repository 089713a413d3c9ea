"""The YAML config: parsed once into immutable typed objects (`model`, with an upstream pool's in `pool_model`). `loader` is the
entry point over the path-aware `reader`, and `settings`, `limits`, `routes`,
`upstreams` and `store_url` each read one part of the file; `units`, `http_names`,
`redaction`, `regex` and `tls` are the small value languages and names they share.
The bottom layer: it imports nothing else of the gateway, and trusts nothing in the
file it reads."""

from gateway.config.loader import ConfigError, load_config, parse_config
from gateway.config.model import GatewayConfig

__all__ = ["ConfigError", "GatewayConfig", "load_config", "parse_config"]
