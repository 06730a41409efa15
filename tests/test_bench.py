"""The benchmark harness still runs: every script imports, every experiment's CPU check passes, and the results
tables in the README and the docs are what the result JSONs give (bench/README.md).

The benchmarks mostly run on a GPU, which is scarce: a change to the library that breaks one should fail here,
before a GPU's time is spent on it. Each check runs as a user runs it (``python bench/run.py --check NAME``),
in its own process, writing into a temporary directory.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py"))
sys.path.insert(0, str(BENCH))

from experiments import EXPERIMENTS  # noqa: E402  (bench/ is not a package)

CHECKED = sorted(name for name, experiment in EXPERIMENTS.items() if experiment.check is not None)
SLOW = {name for name in CHECKED if EXPERIMENTS[name].slow_check}
# Keys every result has, whatever its runner (bench/README.md, "The result schema").
SCHEMA_KEYS = {
    "schema",
    "experiment",
    "kind",
    "shape",
    "machine",
    "commit",
    "date",
    "written_utc",
    "command",
    "config",
    "steps",
    "summary",
    "memory",
    "mismatch",
    "served_equals_trained",
    "metrics",
    "failed",
}


def run_bench(args: list[str], cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRL_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_at_most_eight_scripts():
    assert len(SCRIPTS) <= 8, SCRIPTS


def test_every_script_imports(tmp_path):
    imports = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]); [importlib.import_module(m) for m in sys.argv[2:]]"
    )
    done = run_bench(["-c", imports, str(BENCH), *SCRIPTS], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_list_names_every_experiment(tmp_path):
    done = run_bench([str(BENCH / "run.py"), "--list"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(name in done.stdout for name in EXPERIMENTS)


def test_the_rendered_tables_are_up_to_date(tmp_path):
    done = run_bench([str(BENCH / "render.py"), "--check"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in CHECKED]
)
def test_experiment_passes_its_cpu_check(name, tmp_path):
    out = tmp_path / "results"
    done = run_bench([str(BENCH / "run.py"), "--check", name, "--out-dir", str(out)], tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = [json.loads(path.read_text()) for path in out.glob("*.json")]
    if EXPERIMENTS[name].runner == "frontier":  # its check prints the memory plan's table and runs nothing
        assert "the hardest setting each run's plan fits" in done.stdout
        return
    assert results, done.stdout[-3000:]
    for result in results:
        assert result.keys() >= SCHEMA_KEYS
        assert result["failed"] is None and result["config"]["check"]
        if result["kind"] is not None:
            assert result["steps"] and result["summary"]["step_s"] > 0
            assert result["served_equals_trained"] is not False


def test_an_unsloth_kind_without_unsloth_fails_in_one_line(tmp_path):
    """Unsloth runs only on an accelerator; where ``import unsloth`` fails the run's ``failed`` says so in one line,
    with no traceback. The failing package sits in ``UNSLOTH_SITE``, which the kind puts first on the path, so this
    holds where Unsloth is installed too."""
    site = tmp_path / "site" / "unsloth"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("raise ImportError('no accelerator here')\n")
    out = tmp_path / "results"
    args = ["step-vs-unsloth", "--kinds", "unsloth", "--shapes", "tiny", "--steps", "1", "--out-dir", str(out)]
    done = run_bench([str(BENCH / "run.py"), *args], tmp_path, {"UNSLOTH_SITE": str(site.parent)})
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    [result] = [json.loads(path.read_text()) for path in out.glob("*.json")]
    assert result.keys() >= SCHEMA_KEYS and result["kind"] == "unsloth"
    assert "Traceback" not in result["failed"]
    assert (
        result["failed"].strip().splitlines()[-1].startswith("bench: unsloth needs Unsloth, and import unsloth failed")
    )
    assert "no accelerator here" in result["failed"]


def test_a_run_never_profiles_its_last_step():
    """In an asynchronous run's last step no next batch generates: its profile would show training alone."""
    from dataclasses import replace

    from run import profiled_step

    experiment = EXPERIMENTS["async"]
    assert profiled_step(experiment) == experiment.profile_step < experiment.steps
    assert profiled_step(replace(experiment, steps=5)) == 4
    assert profiled_step(replace(experiment, steps=1)) == 1
    assert profiled_step(replace(experiment, profile_step=None)) is None


def test_a_shapes_prompts_are_one_token_a_word_as_transformers_loads_its_tokenizer(tmp_path):
    """transformers loads a Qwen2 or Qwen3 model's tokenizer as ``Qwen2Tokenizer``, rebuilt from its vocabulary and
    merges: through it, each benchmark prompt is ``PROMPT_TOKENS`` tokens, and sampled tokens decode to words that
    tokenize back to them (the reward reads the words)."""
    from transformers import AutoTokenizer, Qwen2Config
    from workload import FIRST_WORD_ID, PROMPT_TOKENS, benchmark_prompts, words_tokenizer

    Qwen2Config(vocab_size=4096, hidden_size=64, num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    words_tokenizer(4096).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 4096
    assert {len(tokenizer(prompt)["input_ids"]) for prompt in benchmark_prompts(str(tmp_path), count=16)} == {
        PROMPT_TOKENS
    }
    sampled = list(range(FIRST_WORD_ID, 4096, 37))
    text = tokenizer.decode(sampled)
    assert len(text.split()) == len(sampled)
    assert tokenizer(text)["input_ids"] == sampled


@pytest.mark.parametrize(("seconds_left", "stops"), [(-1.0, True), (3600.0, False), (None, False)])
def test_a_run_stops_after_the_step_that_ends_past_the_time_limit(seconds_left, stops):
    """``--time-limit``: a run stops training after the step that ends past its ``stop_at``, so that it writes its
    result (with the steps it ran) before the call's time is up."""
    from kinds import StepRecorder
    from transformers import TrainerControl, TrainerState, TrainingArguments

    stop_at = None if seconds_left is None else time.time() + seconds_left
    callback = StepRecorder(cuda=False, stop_at=stop_at).callback()
    control = TrainerControl()
    args, state = TrainingArguments(output_dir="unused", report_to=[]), TrainerState()
    callback.on_step_begin(args, state, control)
    callback.on_step_end(args, state, control)
    assert control.should_training_stop is stops


def test_a_failed_run_keeps_the_steps_its_metrics_file_holds(tmp_path):
    """A run that ends before writing its record (killed, out of memory) keeps, in its result, the steps
    colocate_grpo logged: step, seconds, reward and the logprob agreement, as a step record names them."""
    from kinds import RUN_DIR, logged_steps

    assert logged_steps(tmp_path) == []  # the other kinds write no metrics file
    logs = [
        {"step": 1, "reward": 0.25, "time/step": 2.5, "sampling/logp_equal_fraction": 1.0, "entropy": 11.5},
        {"step": 2, "reward": 0.5, "time/step": 2.0, "sampling/sampling_logp_difference/mean": 0.0},
        {"train_runtime": 9.0},  # the trainer's closing summary, no step's
    ]
    metrics = tmp_path / RUN_DIR / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps(line) + "\n" for line in logs) + '{"step": 3, "rew')
    steps = logged_steps(tmp_path)
    assert [(s["step"], s["step_s"], s["reward"]) for s in steps] == [(1, 2.5, 0.25), (2, 2.0, 0.5)]
    assert steps[0]["logp_equal_fraction"] == 1.0 and steps[1]["logp_diff"] == 0.0
    assert steps[0]["logged"] == {"time/step": 2.5}


def test_a_run_not_started_by_the_time_limit_is_recorded_as_not_run(tmp_path):
    from run import Session, machine, run_training

    session = Session(tmp_path / "out", tmp_path / "models", "test", machine(), "test", True, stop_at=time.time() - 1)
    session.out_dir.mkdir()
    [result] = run_training(EXPERIMENTS["step-vs-trl"].checked(), session)
    assert result["failed"] == "not run: the call's --time-limit had passed" and result["steps"] == []


def test_a_curve_run_alone_is_drawn_beside_the_newest_default_curves_of_its_shape():
    from render import baseline_curves

    def curve(folder: str, kind: str, shape: str = "1.5B-stops") -> dict:
        return {"folder": folder, "kind": kind, "shape": shape}

    curves = [
        curve("a", "user"),
        curve("a", "user-seed1"),
        curve("b", "user"),
        curve("b", "user-seed1"),
        curve("b", "user-async"),
        curve("b", "user", "7B"),
        curve("c", "user-bitwise"),
    ]
    assert baseline_curves(curves, "c") == curves[2:4]
    assert baseline_curves(curves, "b") == []  # it has the default's own
    assert baseline_curves([*curves, curve("d", "user-bitwise", "tiny")], "d") == []  # no default at "tiny"


def test_results_folders_of_one_day_sort_by_when_their_results_were_written():
    from render import folder_order

    def result(folder: str, written: str | None) -> dict:
        return {"folder": folder, "written_utc": written}

    results = [
        result("2026-12-07-h100-2fca379", "2026-12-07T10:46:01+00:00"),
        result("2026-12-07-h100-2fca379", "2026-12-07T10:58:30+00:00"),  # a folder is as new as its newest result
        result("2026-12-07-h100-6c1e778", "2026-12-07T10:57:00+00:00"),
        result("2026-12-07-h100-be8fa45", None),  # written before results recorded the time: first of its day
        result("2026-12-08-cpu-2core-0000000", "2026-12-08T00:00:01+00:00"),
        result("2026-12-06-h200-fffffff", "2026-12-06T23:59:59+00:00"),
    ]
    order = folder_order(results)
    assert sorted(order, key=order.get) == [
        "2026-12-06-h200-fffffff",
        "2026-12-07-h100-be8fa45",
        "2026-12-07-h100-6c1e778",
        "2026-12-07-h100-2fca379",
        "2026-12-08-cpu-2core-0000000",
    ]
