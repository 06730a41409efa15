"""The run figure and summary, fed a synthetic metric stream (Agg canvas, no display)."""

import math
import time
from types import SimpleNamespace

from colocate_grpo.dashboard import PHASES, LiveDashboard, PngWriter, RedrawClock, draw, save_png, summary


def synthetic_history(steps: int = 20, gpu: bool = False, merge_aware: bool = False) -> list[dict]:
    memory = "device_used_gib" if gpu else "rss_gib"
    history = []
    for step in range(1, steps + 1):
        event = {
            "step": step,
            "reward": 0.1 + 0.01 * step,
            "reward_std": 0.3,
            "completions/mean_length": 3.0,
            "sampling/sampling_logp_difference/mean": 0.005,
            "sampling/sampling_logp_difference/max": 0.05,
            "time/step": 1.0,
        }
        for i, phase in enumerate(PHASES):
            event[f"time/{phase}"] = 0.1 * (i + 1)
            event[f"memory/{phase}/{memory}"] = 2.0 + 0.1 * i
        if step % 5 == 1:
            event["lora_merge/changed_fraction"] = 0.01 * step
            if merge_aware:
                event["lora_merge/served_equals_trained"] = 1.0
            else:
                event["lora_merge/retained"] = 0.02 * step
        history.append(event)
    return history


def lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_figure_shows_each_series():
    history = synthetic_history()
    reward_ax, length_ax, merge_ax, memory_ax, time_ax, mismatch_ax = draw(history).axes
    assert list(lines_by_label(reward_ax)["mean"].get_ydata()) == [e["reward"] for e in history]
    smoothed = lines_by_label(reward_ax)["rolling mean, 2 steps"].get_ydata()
    assert smoothed[0] == history[0]["reward"] and abs(smoothed[5] - (0.15 + 0.16) / 2) < 1e-12
    assert "update served (ordinary LoRA)" in lines_by_label(merge_ax)
    assert len(lines_by_label(merge_ax)["update served (ordinary LoRA)"].get_xdata()) == 4
    assert {f"after {p}" for p in PHASES} <= set(lines_by_label(memory_ax))
    assert "Process memory" in memory_ax.get_title()
    assert [c.get_label() for c in time_ax.collections] == list(PHASES)
    train_area = time_ax.collections[-1].get_paths()[0].vertices
    assert abs(train_area[:, 1].max() - sum(0.1 * (i + 1) for i in range(len(PHASES)))) < 1e-9  # stacked
    assert set(lines_by_label(mismatch_ax)) == {"mean", "mean, running over 2", "max"}


def test_a_slow_first_step_does_not_flatten_the_others():
    history = synthetic_history()
    for phase in PHASES:
        history[0][f"time/{phase}"] *= 20  # the first step compiles and warms up
    time_ax = draw(history).axes[4]
    assert 2.0 < time_ax.get_ylim()[1] < 10.0  # later steps take 1.5 s in all; the first 30 s
    assert any("(warm-up)" in text.get_text() for text in time_ax.texts)
    assert not draw(synthetic_history()).axes[4].texts


def test_gpu_and_merge_aware_runs_are_labelled_as_such():
    _, _, merge_ax, memory_ax, _, _ = draw(synthetic_history(gpu=True, merge_aware=True)).axes
    assert "served = trained, bitwise (merge-aware)" in lines_by_label(merge_ax)
    assert "update served (ordinary LoRA)" not in lines_by_label(merge_ax)
    assert "Device memory" in memory_ax.get_title()


def test_png_is_written_whole(tmp_path):
    path = save_png(synthetic_history(), tmp_path / "out" / "dashboard.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["dashboard.png"]


def test_summary_fits_one_screen_and_says_what_matters():
    text = summary(synthetic_history())
    assert len(text.splitlines()) <= 10
    assert "Steps: 20" in text and "first tenth 0.115 -> last tenth 0.295" in text
    assert "train 33%" in text and "Mean |logprob vLLM - trainer|: 0.0050" in text
    assert "update vLLM serves (last check): 0.32" in text
    assert "equal the trained ones at 4 of 4 checks" in summary(synthetic_history(merge_aware=True))
    assert summary([]) == "No steps logged."


def test_summary_and_figure_say_whether_the_mismatch_grew_and_how_the_run_is_served():
    flat = synthetic_history()
    assert "(did not grow by more than 10%)" in summary(flat)
    growing = synthetic_history()
    for event in growing:
        event["sampling/sampling_logp_difference/mean"] = 0.005 * (1 + 0.05 * event["step"])
        event["served_as"] = "adapter (vLLM's LoRA kernels on the base weights)"
        if "lora_merge/retained" in event:
            del event["lora_merge/retained"]
            event["lora_sync/served_equals_trained"] = 1.0
    text = summary(growing)
    assert "(grew by more than 10%)" in text and "Served as: adapter" in text
    assert "Served adapter: equal to the trained factors at 4 of 4 checks" in text
    noisy = synthetic_history()
    for event, value in zip(noisy, [0.003, 0.007] + [0.005] * 16 + [0.0036, 0.008], strict=True):
        event["sampling/sampling_logp_difference/mean"] = value
    # The last tenth is 1.16x the first, but two steps a tenth spread that far by chance.
    assert "(grew by more than 10%, within what chance gives over 20 steps: ±0.0059)" in summary(noisy)
    mismatch_ax = draw(growing).axes[5]
    assert "mean, running over 2" in lines_by_label(mismatch_ax)
    assert draw(growing).axes[2].get_title() == "Served adapter"
    full = synthetic_history()
    for event in full:
        event["served_as"] = "weights (full fine-tuning)"
        if "lora_merge/retained" in event:
            del event["lora_merge/retained"]
            event["sync/served_equals_trained"] = 1.0
    assert "Served weights: equal to the trained ones at 4 of 4 checks" in summary(full)
    merge_ax = draw(full).axes[2]
    assert merge_ax.get_title() == "Served weights"
    assert "served = trained, bitwise (full fine-tuning)" in lines_by_label(merge_ax)


def test_png_writer_throttles_and_always_writes_at_the_end(tmp_path):
    history = synthetic_history(3)
    writer = PngWriter(history, tmp_path / "dashboard.png", interval=math.inf)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    writer.on_log(None, state, None)
    assert not (tmp_path / "dashboard.png").exists()
    writer.on_train_end(None, state, None)
    assert (tmp_path / "dashboard.png").exists() and writer.clock.drawing_seconds > 0
    writer.clock.interval = 0.0
    writer.on_log(None, state, None)  # due by its interval, but sooner than 100x the last draw
    assert writer.clock.drawing_seconds == writer.clock.last_draw_seconds


def test_redraw_clock_keeps_drawing_within_its_share_of_the_run():
    clock = RedrawClock(interval=0.0, share=0.01)
    assert not clock.due()  # just started: even one draw would exceed 1% of the time so far
    clock.start -= 100  # as if training had run 100 s: 1 s may go to drawing
    assert clock.due()
    clock.timed(lambda: time.sleep(0.05))
    assert clock.drawing_seconds >= 0.05
    clock.start = time.monotonic() - 5  # 5 s: 0.05 s budget, already spent
    assert not clock.due()
    clock.start -= 1000
    assert clock.due()
    clock.interval = 3600.0
    assert not clock.due()


def test_live_dashboard_shows_status_at_once_and_the_figure_as_its_budget_allows():
    history = synthetic_history(5)
    live = LiveDashboard(interval=0.0)
    live.history = history
    state = SimpleNamespace(global_step=5, max_steps=100)
    live.on_train_begin(None, state, None)
    live.on_log(None, state, None)
    assert "step 5 of 100" in live.status.value and "reward, last 1 steps: 0.150" in live.status.value
    assert not live.image.value  # no figure yet: drawing would exceed the budget
    live.clock.start -= 1000
    live.on_log(None, state, None)
    assert live.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = live.clock.drawing_seconds
    live.on_train_end(None, SimpleNamespace(global_step=10, max_steps=10), None)  # the final draw, always
    assert "(done)" in live.status.value and live.clock.drawing_seconds > drawn


def test_asynchronous_generation_shows_overlap_idle_time_and_staleness():
    history = synthetic_history(steps=4)
    for event in history:
        event.update(
            {
                "async/overlap_s": 0.5,
                "async/trainer_idle_s": 0.1,
                "async/engine_idle_s": 0.2,
                "async/staleness": float(event["step"] > 1),
                "async/dropped": 0.0,
            }
        )
    time_ax = draw(history).axes[4]
    lines = lines_by_label(time_ax)
    assert list(lines["generating while training"].get_ydata()) == [0.5] * 4
    assert {"trainer idle", "engine idle"} <= set(lines)
    assert not any("idle" in label for label in lines_by_label(draw(synthetic_history()).axes[4]))
    text = summary(history)
    assert "Asynchronous generation: staleness mean 0.75, max 1; 0 batches dropped" in text
    assert "generating while training 2.0 s, trainer idle 0.4 s, engine idle 0.8 s" in text
    assert "Asynchronous" not in summary(synthetic_history())
