"""The YAML config: parsed once (`loader`) into immutable typed objects (`model`)."""

from gateway.config.loader import ConfigError, load_config, parse_config
from gateway.config.model import GatewayConfig

__all__ = ["ConfigError", "GatewayConfig", "load_config", "parse_config"]
