import os

# No network here: TRL's start-up ping and hub look-ups must not be attempted.
os.environ.setdefault("TRL_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
