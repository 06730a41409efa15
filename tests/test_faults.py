"""Faults as a user meets them, through the CLI on the tiny CPU job: the output folder loses nothing, and each
fault gets an exit code and a message that names it, without a traceback (before the model loads wherever it
can be known then).

One run is the base of most tests: a second run into its folder while it trains, then a kill while it writes
its last checkpoint. Each test works on a copy of what the kill left.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from colocate_grpo.checkpoints import MANIFEST, checkpoint_damage
from colocate_grpo.config import load_config
from colocate_grpo.output_dir import LOCK
from colocate_grpo.train import default_config_path

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    "TRL_TELEMETRY": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}
COMMAND = [sys.executable, "-m", "colocate_grpo.train"]
LOADED = "Served as:"  # printed once the model and the engine are up


def tiny(output_dir: Path, **overrides) -> dict:
    """The tiny job, six steps with a checkpoint every two."""
    raw = load_config(default_config_path()).to_dict()
    raw.update(output_dir=str(output_dir), max_steps=6, save_steps=2, micro_batch_size=16, num_prompts=64)
    raw.update(overrides)
    return raw


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(config: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COMMAND, *options, str(config)], cwd=config.parent, env=ENV, capture_output=True, text=True, timeout=300
    )


def records(folder: Path) -> list[dict]:
    """Every line of the metrics file, parsed (a torn line fails the test)."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def reward_steps(folder: Path) -> list[int]:
    return [r["step"] for r in records(folder) if "reward" in r]


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (code {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run into a fresh folder: a second run started into it while it trains, then a kill while it writes
    checkpoint-6 (its optimizer file is a pipe nobody reads: the writer waits there, mid-checkpoint)."""
    root = tmp_path_factory.mktemp("killed")
    folder = root / "run"
    config = write_config(root / "cfg.yaml", tiny(folder))
    with (root / "stdout").open("w") as out, (root / "stderr").open("w") as err:
        run = subprocess.Popen([*COMMAND, str(config)], cwd=root, env=ENV, stdout=out, stderr=err)
    try:
        wait_for(lambda: (folder / LOCK).is_file() and str(run.pid) in (folder / LOCK).read_text(), run, "its lock")
        run.send_signal(signal.SIGSTOP)  # it holds the folder while the second run starts
        second = cli(config)
        run.send_signal(signal.SIGCONT)
        wait_for(lambda: (folder / "checkpoint-4" / MANIFEST).is_file(), run, "checkpoint-4")
        (folder / "checkpoint-6").mkdir()
        os.mkfifo(folder / "checkpoint-6" / "optimizer.pt")
        wait_for(lambda: '"step": 6, ' in (folder / "metrics.jsonl").read_text(), run, "step 6's metrics")
        time.sleep(1.0)  # step 6 logged, then its checkpoint: the writer now waits on the pipe
        assert run.poll() is None, (root / "stderr").read_text()[-3000:]
        run.kill()
        run.wait()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    (folder / "checkpoint-6" / "optimizer.pt").unlink()  # what a kill leaves: a checkpoint cut short
    return SimpleNamespace(folder=folder, pid=run.pid, second=second)


def copy_of(killed_run, tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(killed_run.folder, folder)
    return folder


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_holder(killed_run):
    second = killed_run.second
    assert second.returncode == 2, second.stderr
    assert f"'output_dir: {killed_run.folder}' is in use by another run: pid {killed_run.pid}" in second.stderr
    assert "started 20" in second.stderr and "another output_dir" in second.stderr
    assert "Traceback" not in second.stderr and LOADED not in second.stdout


def test_a_killed_run_resumes_from_its_newest_complete_checkpoint_with_each_step_logged_once(killed_run, tmp_path):
    folder = copy_of(killed_run, tmp_path)
    assert not (folder / "checkpoint-6" / MANIFEST).exists() and (folder / "checkpoint-2" / MANIFEST).is_file()
    assert reward_steps(folder) == [1, 2, 3, 4, 5, 6]
    metrics = folder / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-40])  # step 6's record torn, as by a full disk

    resumed = cli(write_config(tmp_path / "cfg.yaml", tiny(folder, resume_from_checkpoint="latest")))
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming from {folder / 'checkpoint-4'} (step 4). Skipped checkpoint-6: it is incomplete" in resumed.stdout
    assert f"Took over the lock of {folder} from pid {killed_run.pid}" in resumed.stderr
    assert "cut 1 torn line(s)" in resumed.stderr and "dropped 1 record(s) of steps after 4" in resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert reward_steps(folder) == [1, 2, 3, 4, 5, 6]
    assert checkpoint_damage(folder / "checkpoint-6") is None and not (folder / LOCK).exists()


def test_a_fresh_run_into_an_earlier_runs_folder_is_refused_with_the_choices(run_cli, killed_run, tmp_path):
    folder = copy_of(killed_run, tmp_path)
    before = (folder / "metrics.jsonl").read_bytes()
    fresh = run_cli(write_config(tmp_path / "cfg.yaml", tiny(folder)), cwd=tmp_path)
    assert fresh.returncode == 2, fresh.stderr
    assert f"'output_dir: {folder}' holds an earlier run (checkpoint-2, checkpoint-4, checkpoint-6, metrics.jsonl)" in (
        fresh.stderr
    )
    for choice in (
        "'resume_from_checkpoint: latest' (its newest complete checkpoint is checkpoint-4)",
        "another output_dir",
        "'overwrite_output_dir: true'",
    ):
        assert choice in fresh.stderr
    assert "Traceback" not in fresh.stderr and LOADED not in fresh.stdout
    assert (folder / "metrics.jsonl").read_bytes() == before and (folder / "checkpoint-6").is_dir()


def test_a_damaged_checkpoint_is_refused_by_name_and_latest_passes_over_it(killed_run, tmp_path):
    folder = copy_of(killed_run, tmp_path)
    adapter = folder / "checkpoint-4" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:1000])

    named = cli(
        write_config(tmp_path / "named.yaml", tiny(folder, resume_from_checkpoint=str(folder / "checkpoint-4")))
    )
    assert named.returncode == 2, named.stderr
    assert "adapter_model.safetensors is damaged: it has 1000 bytes" in named.stderr and "(truncated)" in named.stderr
    assert f"Resume from {folder / 'checkpoint-2'} instead" in named.stderr
    assert "Traceback" not in named.stderr and LOADED not in named.stdout

    latest = cli(write_config(tmp_path / "latest.yaml", tiny(folder, resume_from_checkpoint="latest")), "--check")
    assert latest.returncode == 0, latest.stderr
    assert f"Resuming from {folder / 'checkpoint-2'} (step 2)." in latest.stdout
    assert "Skipped checkpoint-6: it is incomplete" in latest.stdout
    assert "Skipped checkpoint-4: adapter_model.safetensors is damaged" in latest.stdout


def test_resuming_with_another_lora_rank_or_other_targets_is_refused_before_the_model_loads(
    run_cli, killed_run, tmp_path
):
    folder = copy_of(killed_run, tmp_path)
    raw = tiny(folder, resume_from_checkpoint="latest", lora_r=8, lora_target_linear=False)
    raw["lora_target_modules"] = ["q_proj", "v_proj"]
    refused = run_cli(write_config(tmp_path / "cfg.yaml", raw), cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "lora_r: 8 in this config, 16 in the checkpoint" in refused.stderr
    assert "lora_target_modules: ['q_proj', 'v_proj'] in this config, None in the checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr and LOADED not in refused.stdout


def test_an_output_dir_that_is_a_file_or_cannot_be_written_is_refused_before_the_model_loads(run_cli, tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    refused = run_cli(write_config(tmp_path / "file.yaml", tiny(a_file)), cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert f"'output_dir: {a_file}' is a file, not a folder" in refused.stderr and "Traceback" not in refused.stderr

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    # root writes anywhere a mode forbids: there, a folder of /proc (no new entries) stands in
    parent = read_only if not os.access(read_only, os.W_OK) else Path("/proc")
    refused = run_cli(write_config(tmp_path / "unwritable.yaml", tiny(parent / "run")), cwd=tmp_path)
    read_only.chmod(0o755)
    assert refused.returncode == 2, refused.stderr
    assert f"'output_dir: {parent / 'run'}' cannot be written: creating a file in {parent} failed" in refused.stderr
    assert "Traceback" not in refused.stderr and LOADED not in refused.stdout


SUMS = [f"{a}+{a}=" for a in range(1, 11)]
FAULTY_REWARDS = '''
import math


def _first(prompt):
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return int(text.split("+")[0])


def partial(prompts, completions, **kwargs):
    """Applies to sums of 1 to 3 only: None for the others, NaN for 4."""
    return [1.0 if _first(p) <= 3 else (math.nan if _first(p) == 4 else None) for p in prompts]


def flaky(prompts, completions, trainer_state=None, **kwargs):
    """From step 3 on, fails on the sums of odd numbers."""
    if trainer_state is not None and trainer_state.global_step >= 2:
        for p, c in zip(prompts, completions):
            if _first(p) % 2:
                raise ValueError(f"cannot read {c!r}")
    return [0.0 for _ in prompts]


def never(prompts, completions, **kwargs):
    return [None for _ in prompts]
'''


def sums_dataset(tmp_path: Path) -> Path:
    """Ten sums, with an empty prompt at row 3 and a blank one at row 7."""
    prompts = [*SUMS[:3], "", *SUMS[3:6], "   ", *SUMS[6:]]
    path = tmp_path / "sums.jsonl"
    path.write_text("\n".join(json.dumps({"question": q, "answer": "0"}) for q in prompts))
    (tmp_path / "faulty_rewards.py").write_text(FAULTY_REWARDS)
    return path


def dataset_job(tmp_path: Path, folder: Path, rewards: list[str], **dataset) -> dict:
    data = {"path": str(sums_dataset(tmp_path)), "prompt_column": "question", "answer_column": "answer", **dataset}
    raw = tiny(folder, task=None, dataset=data)
    raw["trl"] = {**raw["trl"], "reward_funcs": [f"faulty_rewards.{name}" for name in rewards]}
    return raw


def test_empty_prompts_are_refused_with_their_rows_before_the_model_loads(run_cli, tmp_path):
    config = write_config(tmp_path / "cfg.yaml", dataset_job(tmp_path, tmp_path / "run", ["partial"]))
    refused = run_cli(config, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "2 of 12 prompts of 'dataset.path:" in refused.stderr and "at rows 3, 7 (numbered from 0)" in refused.stderr
    assert "dataset.skip_empty_prompts: true" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "run").exists()


def test_rewards_that_fail_mid_run_are_named_and_unscored_samples_counted(killed_run, tmp_path):
    """Into the killed run's folder, overwriting it: empty prompts skipped; a reward that leaves some samples
    unscored, counted; one that raises from step 3, named with its sample, stopping the run with its last
    checkpoint complete."""
    folder = copy_of(killed_run, tmp_path)
    raw = dataset_job(tmp_path, folder, ["partial", "flaky"], skip_empty_prompts=True)
    stopped = cli(write_config(tmp_path / "cfg.yaml", {**raw, "overwrite_output_dir": True}))
    assert stopped.returncode == 1, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "Left out 2 empty or blank prompts" in stopped.stderr and "at rows 3, 7" in stopped.stderr
    failure = re.search(
        r"reward error: Reward 'faulty_rewards.flaky' raised ValueError: cannot read .* at step (\d+), on sample "
        r"(\d+) of 16 \(prompt '(\d+)\+",
        stopped.stderr,
    )
    assert failure, stopped.stderr[-3000:]
    step, sample, first = (int(g) for g in failure.groups())
    assert step >= 3 and 0 <= sample < 16 and first % 2 == 1
    # The earlier run's checkpoints went first; this run's, before the failure, are complete.
    checkpoints = sorted(int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*"))
    assert checkpoints == list(range(2, step, 2))
    assert all(checkpoint_damage(folder / f"checkpoint-{n}") is None for n in checkpoints)
    assert f"{folder / f'checkpoint-{checkpoints[-1]}'} is its last complete checkpoint" in stopped.stderr
    assert not (folder / LOCK).exists()
    # Only this run's steps, once each, with the unscored samples counted; one warning says so.
    assert reward_steps(folder) == list(range(1, step))
    unscored = [r["rewards/partial/unscored"] for r in records(folder) if "reward" in r]
    assert any(count > 0 for count in unscored) and all(count % 8 == 0 for count in unscored)
    assert stopped.stderr.count("Reward 'partial' left") == 1 and "returned None or NaN" in stopped.stderr


@pytest.mark.slow
def test_a_batch_no_reward_scores_stops_the_run_with_a_message(tmp_path):
    folder = tmp_path / "run"
    stopped = cli(
        write_config(tmp_path / "cfg.yaml", dataset_job(tmp_path, folder, ["never"], skip_empty_prompts=True))
    )
    assert stopped.returncode == 1, stopped.stderr
    assert "No reward function scored any of the 16 samples at step 1 ('never' returned None" in stopped.stderr
    assert "has no checkpoint yet" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (folder / LOCK).exists()
