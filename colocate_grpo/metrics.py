"""Run metrics: every log event kept in memory and appended to ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

REWARD_KEY = "reward"


class MetricsLog(TrainerCallback):
    """Keeps every training log event (a dict with ``step``) and appends it to a JSONL file.

    Args:
        path: the JSONL file; created on the first event, parents included.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.history: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not logs or not state.is_world_process_zero:
            return
        event = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, int | float | str)}}
        self.history.append(event)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, in order, skipping missing and NaN values."""
        return [
            (e["step"], float(e[key]))
            for e in self.history
            if isinstance(e.get(key), int | float) and not math.isnan(e[key])
        ]


def first_and_last_tenth(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last tenth (at least one value each) of a series."""
    if not values:
        return math.nan, math.nan
    n = max(1, len(values) // 10)
    return sum(values[:n]) / n, sum(values[-n:]) / n
