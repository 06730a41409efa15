"""Views of a run: one figure of its metrics, live in a notebook or as a PNG, and a one-screen summary.

Everything here reads the metric history (the events of ``metrics.jsonl``) and draws with
matplotlib's object API on the Agg canvas: no pyplot state, no GUI, safe in any process.
ipywidgets is imported only by :class:`LiveDashboard`, when a notebook asks for it.
"""

from __future__ import annotations

import io
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from transformers import TrainerCallback

from colocate_grpo.metrics import ENGINE_PHASES, EQUAL_KEY, first_and_last_tenth, series, tenths_difference_noise

PHASES = (*ENGINE_PHASES, "train")
FIGSIZE = (15, 8)  # inches, at 100 dpi
GRID = {"left": 0.045, "right": 0.99, "top": 0.96, "bottom": 0.065, "wspace": 0.17, "hspace": 0.17}
PHASE_COLORS = {"wake": "#9ecae1", "sync": "#fd8d3c", "generate": "#6baed6", "sleep": "#c6dbef", "train": "#74c476"}
# Asynchronous generation's seconds per step (colocate_grpo.async_generation), drawn over the phases.
OVERLAP_LINES = {
    "async/overlap_s": ("generating while training", "#08519c", "-"),
    "async/trainer_idle_s": ("trainer idle", "#a50f15", "--"),
    "async/engine_idle_s": ("engine idle", "#525252", ":"),
}


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric, as two lists for plotting."""
    points = series(history, key)
    return [s for s, _ in points], [v for _, v in points]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _memory_key(history: list[dict[str, Any]]) -> str:
    """``device_used_gib`` on a GPU run, ``rss_gib`` (process memory) on CPU."""
    return "device_used_gib" if any("memory/train/device_used_gib" in e for e in history) else "rss_gib"


def draw(history: list[dict[str, Any]], figure: Figure | None = None) -> Figure:
    """Draw the run's six panels (reward, completion length, merge, memory by phase, step time, logprob
    mismatch) on a figure."""
    figure = figure or Figure(figsize=FIGSIZE)
    figure.clear()
    # Fixed margins: constrained layout cost more than all the plotting together.
    axes = figure.subplots(2, 3, sharex=True, gridspec_kw=GRID)
    reward_ax, length_ax, merge_ax, memory_ax, time_ax, mismatch_ax = axes.flat

    steps, reward = _series(history, "reward")
    _, spread = _series(history, "reward_std")
    if len(spread) == len(reward):
        low = [r - s for r, s in zip(reward, spread, strict=True)]
        high = [r + s for r, s in zip(reward, spread, strict=True)]
        reward_ax.fill_between(steps, low, high, color="#2171b5", alpha=0.08, label="± std")
    reward_ax.plot(steps, reward, color="#2171b5", alpha=0.35, linewidth=1, label="mean")
    window = max(1, len(reward) // 10)
    reward_ax.plot(
        steps,
        _rolling_mean(reward, window),
        color="#08306b",
        linewidth=2.5,
        label=f"rolling mean, {window} step{'s' * (window > 1)}",
    )
    reward_ax.set(title="Reward", xlabel="step")
    reward_ax.legend(loc="lower right")

    length_ax.plot(*_series(history, "completions/mean_length"), color="#6a51a3")
    length_ax.set(title="Completion length (tokens)", xlabel="step")

    retained = _series(history, "lora_merge/retained")
    exact = _series(history, "lora_merge/served_equals_trained")
    adapter = _series(history, "lora_sync/served_equals_trained")
    weights = _series(history, "sync/served_equals_trained")
    changed = _series(history, "lora_merge/changed_fraction")
    if retained[0]:
        merge_ax.plot(*retained, "o-", color="#d94801", label="update served (ordinary LoRA)")
    if exact[0]:
        merge_ax.plot(*exact, "s--", color="#238b45", label="served = trained, bitwise (merge-aware)")
    if adapter[0]:
        merge_ax.plot(*adapter, "s--", color="#238b45", label="served adapter = trained, bitwise")
    if weights[0]:
        merge_ax.plot(*weights, "s--", color="#238b45", label="served = trained, bitwise (full fine-tuning)")
    if changed[0]:
        merge_ax.plot(*changed, "^:", color="#737373", label="entries changed by the merge")
    title = "Served adapter" if adapter[0] else "Served weights" if weights[0] else "LoRA merge into the served weights"
    merge_ax.set(title=title, xlabel="step", ylim=(-0.05, 1.05))
    if retained[0] or exact[0] or adapter[0] or weights[0]:
        merge_ax.axhline(0.5, color="#d94801", alpha=0.3, linewidth=1)
        merge_ax.legend(loc="center right", fontsize="small")
    else:
        merge_ax.text(
            0.5,
            0.5,
            "no update measured yet\n(checks every trl.vllm_merge_check_interval steps)",
            ha="center",
            va="center",
            transform=merge_ax.transAxes,
        )

    memory = _memory_key(history)
    for phase in PHASES:
        memory_ax.plot(*_series(history, f"memory/{phase}/{memory}"), color=PHASE_COLORS[phase], label=f"after {phase}")
    memory_ax.set(
        title="Device memory used (GiB)" if memory == "device_used_gib" else "Process memory (GiB, CPU run)",
        xlabel="step",
    )
    memory_ax.set_ylim(0, 1.15 * memory_ax.get_ylim()[1])  # from zero: flat memory must look flat
    memory_ax.legend(loc="lower right", fontsize="small")

    # Stacked areas, not bars: one artist per phase whatever the number of steps (bars took seconds to draw).
    bottom: list[float] | None = None
    steps_with_time: list[int] = []
    for phase in PHASES:
        phase_steps, seconds = _series(history, f"time/{phase}")
        if not seconds:
            continue
        steps_with_time = phase_steps
        below = bottom or [0.0] * len(seconds)
        top = [b + s for b, s in zip(below, seconds, strict=True)]
        time_ax.fill_between(phase_steps, below, top, step="mid", color=PHASE_COLORS[phase], label=phase, linewidth=0)
        bottom = top
    for key, (label, color, style) in OVERLAP_LINES.items():
        overlap_steps, seconds = _series(history, key)
        if seconds:
            time_ax.plot(overlap_steps, seconds, style, color=color, linewidth=1.5, label=label)
    time_ax.set(title="Step time by phase (s)", xlabel="step")
    # The first step also compiles and warms up; scaled to it, every later step would be a sliver.
    if bottom is not None and len(bottom) > 2 and bottom[0] > 3 * statistics.median(bottom[1:]):
        time_ax.set_ylim(0, 2.5 * max(bottom[1:]))
        time_ax.annotate(
            f"step {steps_with_time[0]}: {bottom[0]:.1f} s (warm-up)",
            (steps_with_time[0], 2.5 * max(bottom[1:])),
            xytext=(4, -12),
            textcoords="offset points",
            fontsize="small",
        )
    time_ax.legend(loc="upper right", fontsize="small")

    mismatch_steps, mismatch = _series(history, "sampling/sampling_logp_difference/mean")
    mismatch_ax.plot(mismatch_steps, mismatch, color="#cb181d", alpha=0.5, label="mean")
    if mismatch:
        window = max(1, len(mismatch) // 10)
        mismatch_ax.plot(
            mismatch_steps, _rolling_mean(mismatch, window), color="#67000d", label=f"mean, running over {window}"
        )
    mismatch_ax.plot(
        *_series(history, "sampling/sampling_logp_difference/max"), color="#cb181d", alpha=0.25, label="max"
    )
    mismatch_ax.set(title="|logprob vLLM - logprob trainer|", xlabel="step", yscale="log")
    mismatch_ax.legend(loc="upper right", fontsize="small")
    equal_steps, equal = _series(history, EQUAL_KEY)
    if equal:  # the share of sampled tokens whose two log-probabilities are equal bit for bit, on its own axis
        equal_ax = mismatch_ax.twinx()
        equal_ax.plot(equal_steps, equal, color="#238b45", label="equal bit for bit (right)")
        equal_ax.set(ylim=(-0.02, 1.02), ylabel="share equal")
        equal_ax.legend(loc="lower right", fontsize="small")
    for ax in axes[0]:  # the shared step axis is labelled on the bottom row
        ax.set_xlabel("")
    return figure


def png_bytes(history: list[dict[str, Any]], figure: Figure | None = None) -> bytes:
    """The run's figure as PNG bytes."""
    buffer = io.BytesIO()
    FigureCanvasAgg(draw(history, figure)).print_png(buffer)
    return buffer.getvalue()


def save_png(history: list[dict[str, Any]], path: str | Path, figure: Figure | None = None) -> Path:
    """Draw the run's figure (on ``figure`` when given) and write it as a PNG (written beside, then renamed:
    never half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = draw(history, figure)
    partial = path.with_suffix(".partial.png")
    FigureCanvasAgg(figure).print_png(str(partial))
    partial.replace(path)
    return path


def summary(history: list[dict[str, Any]]) -> str:
    """A one-screen text summary of a run: reward, where the time went, memory, sync quality."""
    steps = [e for e in history if "time/step" in e or "reward" in e]
    if not steps:
        return "No steps logged."
    lines = [f"Steps: {steps[-1]['step']}"]
    served_as = next((e["served_as"] for e in reversed(history) if "served_as" in e), None)
    if served_as:
        lines.append(f"Served as: {served_as}")
    reward = _series(history, "reward")[1]
    if reward:
        start, end = first_and_last_tenth(reward)
        lines.append(f"Mean reward: first tenth {start:.3f} -> last tenth {end:.3f}")
    totals = {phase: sum(_series(history, f"time/{phase}")[1]) for phase in PHASES}
    total = sum(totals.values())
    if total > 0:
        split = ", ".join(f"{phase} {100 * seconds / total:.0f}%" for phase, seconds in totals.items())
        lines.append(f"Time: {total:.0f} s in steps; {split}")
    staleness = _series(history, "async/staleness")[1]
    if staleness:
        seconds = {key: sum(_series(history, key)[1]) for key in OVERLAP_LINES}
        dropped = sum(_series(history, "async/dropped")[1])
        lines.append(
            f"Asynchronous generation: staleness mean {sum(staleness) / len(staleness):.2f}, max "
            f"{max(staleness):.0f}; {dropped:.0f} batches dropped; generating while training "
            f"{seconds['async/overlap_s']:.1f} s, trainer idle {seconds['async/trainer_idle_s']:.1f} s, engine idle "
            f"{seconds['async/engine_idle_s']:.1f} s"
        )
    memory = _memory_key(history)
    peaks = {phase: max(_series(history, f"memory/{phase}/{memory}")[1], default=math.nan) for phase in PHASES}
    if any(not math.isnan(v) for v in peaks.values()):
        label = "Device memory used" if memory == "device_used_gib" else "Process memory"
        lines.append(
            f"{label}, max after each phase (GiB): "
            + ", ".join(f"{phase} {value:.2f}" for phase, value in peaks.items() if not math.isnan(value))
        )
    mismatch = _series(history, "sampling/sampling_logp_difference/mean")[1]
    if mismatch:
        first, last = first_and_last_tenth(mismatch)
        grew = last > 1.1 * first
        trend = "grew by more than 10%" if grew else "did not grow by more than 10%"
        chance = 2 * tenths_difference_noise(mismatch)
        if grew and last - first < chance:
            trend += f", within what chance gives over {len(mismatch)} steps: ±{chance:.4f}"
        lines.append(
            f"Mean |logprob vLLM - trainer|: {sum(mismatch) / len(mismatch):.4f}; first tenth {first:.4f}, last "
            f"tenth {last:.4f} ({trend})"
        )
    equal = _series(history, EQUAL_KEY)[1]
    if equal:
        below = sum(value < 1 for value in equal)
        lines.append(
            f"Log-probabilities equal bit for bit (vLLM and trainer): {100 * sum(equal) / len(equal):.1f}% of sampled "
            f"tokens; below 100% at {below} of {len(equal)} steps"
        )
    retained = _series(history, "lora_merge/retained")[1]
    exact = _series(history, "lora_merge/served_equals_trained")[1]
    adapter = _series(history, "lora_sync/served_equals_trained")[1]
    weights = _series(history, "sync/served_equals_trained")[1]
    if weights:
        lines.append(f"Served weights: equal to the trained ones at {sum(weights):.0f} of {len(weights)} checks")
    elif adapter:
        lines.append(f"Served adapter: equal to the trained factors at {sum(adapter):.0f} of {len(adapter)} checks")
    elif exact:
        lines.append(
            f"Merge-aware LoRA: served weights equal the trained ones at {sum(exact):.0f} of {len(exact)} checks"
        )
    elif retained:
        lines.append(f"Share of the LoRA update vLLM serves (last check): {retained[-1]:.2f}")
    return "\n".join(lines)


class RedrawClock:
    """When a view may redraw, so that drawing costs a known, small share of a run.

    A redraw is due at most every ``interval`` seconds, and only while all drawing so far plus the
    next draw (estimated at the last one's cost) stays within ``share`` of the time since
    :meth:`restart`. The view's final draw, at the end of training, comes on top: one draw (about
    half a second on a CPU) per run.

    Attributes:
        drawing_seconds: total time spent drawing, in seconds.
    """

    FIRST_DRAW_SECONDS = 0.5  # the estimate before anything was drawn

    def __init__(self, interval: float, share: float = 0.005) -> None:
        self.interval = interval
        self.share = share
        self.drawing_seconds = 0.0
        self.last_draw_seconds = 0.0
        self.restart()

    def restart(self) -> None:
        """Count the budget from now (the start of training)."""
        self.start = self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        next_draw = self.last_draw_seconds or self.FIRST_DRAW_SECONDS
        within_budget = self.drawing_seconds + next_draw <= self.share * (now - self.start)
        return now - self.last >= self.interval and within_budget

    def timed(self, draw: Callable[[], None]) -> None:
        """Run ``draw`` and count its time."""
        started = time.perf_counter()
        draw()
        self.last_draw_seconds = time.perf_counter() - started
        self.drawing_seconds += self.last_draw_seconds
        self.last = time.monotonic()


class PngWriter(TrainerCallback):
    """Writes the run's figure to ``path`` as a :class:`RedrawClock` allows, and at the end of training.

    Args:
        history: the live list of log events (``MetricsLog.history``).
        path: the PNG file.
        interval: shortest time between redraws, in seconds.
    """

    def __init__(self, history: list[dict[str, Any]], path: str | Path, interval: float = 30.0) -> None:
        self.history = history
        self.path = Path(path)
        self.clock = RedrawClock(interval)
        self.figure = Figure(figsize=FIGSIZE)

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.clock.restart()

    def on_log(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.is_world_process_zero and self.history and self.clock.due():
            self.clock.timed(lambda: save_png(self.history, self.path, self.figure))

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.is_world_process_zero and self.history:
            self.clock.timed(lambda: save_png(self.history, self.path, self.figure))


class LiveDashboard(TrainerCallback):
    """The run's figure and a status line, live in the notebook cell that trains.

    The status line (step, recent reward) follows every log event; the figure redraws as a
    :class:`RedrawClock` allows (0.5% of the training time, plus one final draw at the end).

    Args:
        history: the live list of log events (``MetricsLog.history``); it can be set later, so that
            the widget shows while the model and the engine load.
        interval: shortest time between redraws, in seconds.
    """

    def __init__(self, history: list[dict[str, Any]] | None = None, interval: float = 5.0) -> None:
        import ipywidgets
        from IPython.display import display

        self.history = history if history is not None else []
        self.clock = RedrawClock(interval)
        self.figure = Figure(figsize=FIGSIZE)
        self.status = ipywidgets.HTML("<b>colocate_grpo</b>: starting (loading the model and the vLLM engine)")
        self.image = ipywidgets.Image(format="png", layout=ipywidgets.Layout(width="100%"))
        self.widget = ipywidgets.VBox([self.status, self.image])
        display(self.widget)

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.clock.restart()

    def on_log(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.show_status(state.global_step, state.max_steps)
        if self.history and self.clock.due():
            self.clock.timed(lambda: self.redraw(state.global_step, state.max_steps))

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.history:
            self.clock.timed(lambda: self.redraw(state.global_step, state.max_steps, done=True))

    def redraw(self, step: int, max_steps: int, done: bool = False) -> None:
        self.image.value = png_bytes(self.history, self.figure)
        self.show_status(step, max_steps, done)

    def show_status(self, step: int, max_steps: int, done: bool = False) -> None:
        recent = [e["reward"] for e in self.history[-max(1, len(self.history) // 10) :] if "reward" in e]
        text = f"step {step} of {max_steps}" + (" (done)" if done else "")
        if recent:
            text += f" | reward, last {len(recent)} steps: {sum(recent) / len(recent):.3f}"
        self.status.value = f"<b>colocate_grpo</b>: {text}"
