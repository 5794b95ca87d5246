"""Run configuration: schema, YAML files, overrides."""

from gdnx.config.reading import ConfigError, apply_overrides, build_config, bundled_names, load_config
from gdnx.config.schema import Config, DataConfig, ModelConfig, TrainConfig

__all__ = ["Config", "ConfigError", "DataConfig", "ModelConfig", "TrainConfig", "apply_overrides",
           "build_config", "bundled_names", "load_config"]
