"""colocate_grpo: GRPO on one GPU with a colocated, sleeping vLLM engine and merge-aware BF16 LoRA."""

from colocate_grpo.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
