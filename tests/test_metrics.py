"""Per-phase time and memory accounting (PhaseClock), without an engine; a series' trend and its noise."""

import math

import pytest

from colocate_grpo.metrics import ENGINE_PHASES, PhaseClock, tenths_difference_noise


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


def test_the_noise_of_a_trend_comes_from_the_spread_within_the_first_and_last_tenth():
    assert math.isnan(tenths_difference_noise([1.0] * 19))  # one value a tenth: no spread to read
    steady_rise = [0.01 * step for step in range(20)]  # spread within each tenth of two: 0.01 apart
    assert tenths_difference_noise(steady_rise) == pytest.approx(math.sqrt((0.00005 + 0.00005) / 2))
    assert tenths_difference_noise([0.0, 1.0] * 10) == pytest.approx(math.sqrt((0.5 + 0.5) / 2))
