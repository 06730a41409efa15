"""build_trainer's trainer holds its output folder as train() does: checked when built, locked while it trains,
an earlier run refused unless overwritten, so that one folder's metrics are one run's."""

import json

import pytest
from transformers import TrainerCallback

from colocate_grpo.config import ConfigError, load_config
from colocate_grpo.output_dir import LOCK, METRICS
from colocate_grpo.train import build_trainer, default_config_path


def tiny(tmp_path, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 2, "micro_batch_size": 16, **overrides})
    return load_config(raw)


def reward_steps(folder) -> list[int]:
    return [r["step"] for r in map(json.loads, (folder / METRICS).read_text().splitlines()) if "reward" in r]


class LockSeen(TrainerCallback):
    def __init__(self, folder):
        self.folder, self.seen = folder, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((self.folder / LOCK).is_file())


def test_a_trainer_trains_into_its_folder_once_unless_told_to_overwrite(tmp_path):
    config = tiny(tmp_path)
    folder = tmp_path / "run"
    lock = LockSeen(folder)
    first = build_trainer(config, callbacks=[lock])
    try:
        first.train()
        assert lock.seen == [True, True] and not (folder / LOCK).exists()
        assert reward_steps(folder) == [1, 2]
        with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl\)"):
            first.train()  # a second train() would append a second run to the first one's metrics
        assert reward_steps(folder) == [1, 2] and not (folder / LOCK).exists()
    finally:
        first.engine.sleep()
    with pytest.raises(ConfigError, match="'overwrite_output_dir: true'"):
        build_trainer(config)
    second = build_trainer(load_config({**config.to_dict(), "overwrite_output_dir": True}))
    try:
        second.train()
        assert reward_steps(folder) == [1, 2]  # this run's steps alone
    finally:
        second.engine.sleep()
