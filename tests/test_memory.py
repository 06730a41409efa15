"""Re-running in one process (a notebook) returns memory: create, train and close five times."""

import ctypes
import gc

import psutil
import pytest
import torch

from colocate_grpo.config import load_config
from colocate_grpo.engine import live_engine
from colocate_grpo.train import build_trainer, default_config_path


def tiny(output_dir):
    raw = load_config(default_config_path()).to_dict()
    raw.update(output_dir=str(output_dir), max_steps=2, micro_batch_size=16)
    return load_config(raw)


def memory_in_use() -> int:
    """Bytes: the device's used memory on a GPU, this process's resident memory on CPU.

    On CPU, glibc's malloc keeps freed memory for reuse; trimming first counts only what is held.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return total - free
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.mark.slow  # five runs, about 50 s on 2 cores
def test_five_create_train_close_cycles_return_memory_to_within_one_percent(tmp_path):
    """The first cycle warms what a process keeps (imports, compiled kernels, allocator pools); none after it grows.

    On CPU each cycle closes its engine and the next starts a new one. On a GPU vLLM allows one
    sleep-mode engine per process, so each cycle leaves it asleep and the next trainer reuses it
    (what re-running a notebook cell does); the last cycle closes it.
    """
    cuda = torch.cuda.is_available()
    before, in_use = memory_in_use(), []
    for cycle in range(5):
        trainer = build_trainer(tiny(tmp_path / str(cycle)))
        trainer.train()
        if not cuda or cycle == 4:
            trainer.close()
        del trainer
        in_use.append(memory_in_use())
    gib = [f"{b / 2**30:.3f}" for b in in_use]
    assert all(b <= in_use[0] * 1.01 for b in in_use[1:4]), f"GiB in use after each cycle: {gib}"
    if not cuda:
        assert in_use[4] <= in_use[0] * 1.01, f"GiB in use after each cycle: {gib}"
    assert live_engine() is None
    print(f"GiB in use before the first cycle: {before / 2**30:.3f}; after each cycle: {gib}")
