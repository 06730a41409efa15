"""Per-phase time and memory accounting (PhaseClock), without an engine."""

import pytest

from colocate_grpo.metrics import ENGINE_PHASES, PhaseClock


def test_every_phase_is_reported_once_per_step_with_vllms_pool_by_tag():
    clock = PhaseClock()
    clock.pools = lambda: {"weights": 2**30, "kv_cache": 0}
    clock.start_step()
    for phase in ("wake", "sync", "generate", "sleep"):
        with clock.phase(phase):
            pass
    metrics = clock.end_step()
    assert {f"time/{p}" for p in (*ENGINE_PHASES, "train")} <= set(metrics)
    assert sum(metrics[f"time/{p}"] for p in (*ENGINE_PHASES, "train")) == pytest.approx(metrics["time/step"])
    for phase in ("wake", "sync", "generate", "sleep", "train"):
        assert metrics[f"memory/{phase}/vllm_weights_gib"] == 1.0
        assert metrics[f"memory/{phase}/vllm_kv_cache_gib"] == 0.0
