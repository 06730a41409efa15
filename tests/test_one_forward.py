"""One forward per micro-batch (colocate_grpo.on_policy): where generation is on the policy that trains, TRL's
importance-sampling ratio and sampling metrics come from each micro-batch's training forward, and TRL's scoring
pass does not run. Against TRL's own path on the real trainer and engine: the same loss and LoRA gradients, the
same metrics; and the scoring pass still runs where generation is not aligned with the optimizer step."""

import dataclasses

import pytest
import torch
from lora_training import ACCUMULATION, optimizer_step_gradients, randomize_lora, relative_error, tiny_config

from colocate_grpo.on_policy import SamplingStats, importance_sampling_ratio, scores_in_training_forward
from colocate_grpo.train import build_trainer, check_inputs

SAMPLING_KEYS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize(
    ("trl", "group_by_length"),
    [
        ({}, "auto"),  # TRL's defaults: dapo, sequence_mask up to 3; micro-batches regrouped by length
        ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.998,
          "vllm_importance_sampling_clip_max": 1.0}, "auto"),
        ({"loss_type": "grpo", "vllm_importance_sampling_mode": "sequence_truncate",
          "vllm_importance_sampling_clip_max": 1.0}, "auto"),
        ({"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.99,
          "vllm_importance_sampling_clip_max": 1.01}, False),  # TRL's padding
    ],
    ids=["default", "token-truncate-clipped", "grpo-sequence-truncate-clipped", "token-mask-padded"],
)  # fmt: skip
def test_the_training_forwards_ratio_gives_trls_loss_gradients_and_metrics(tmp_path, trl, group_by_length):
    """One optimizer step's micro-batches, as the trainer cuts them (TRL's _prepare_inputs), trained with TRL's
    scoring pass (its old logprobs and ratio) and without it (the ratio from each training forward): the same loss
    and LoRA gradients within bf16's rounding, the same ratios, and TRL's sampling metrics under the same names
    with the same values. Every sequence gets an advantage, so that every ratio weighs in the loss."""
    trainer = build_trainer(tiny_config(tmp_path, trl=trl, group_by_length=group_by_length))
    assert trainer.plan.training.one_forward
    model = trainer.model
    randomize_lora(model)
    model.train()
    trainer.on_policy.enabled = False  # TRL's path: the scoring pass
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trl_micro_batches = trainer._buffered_inputs
    trl_metrics = {key: list(trainer._metrics["train"][key]) for key in SAMPLING_KEYS}
    trainer._metrics["train"].clear()
    assert len(trl_micro_batches) == ACCUMULATION
    assert {"old_per_token_logps", "importance_sampling_ratio", "sampling_per_token_logps"} <= set(trl_micro_batches[0])
    generator = torch.Generator().manual_seed(2)
    for micro_batch in trl_micro_batches:
        micro_batch["advantages"] = torch.randn(micro_batch["advantages"].shape, generator=generator)
    skipped = [
        {k: v for k, v in micro_batch.items() if k not in ("old_per_token_logps", "importance_sampling_ratio")}
        for micro_batch in trl_micro_batches
    ]
    trainer.current_gradient_accumulation_steps = ACCUMULATION

    trl_loss, trl_gradients = optimizer_step_gradients(trainer, trl_micro_batches)
    trainer.on_policy.enabled = True
    trainer.on_policy.stats = SamplingStats(expected=ACCUMULATION)  # as generating() begins a generation batch
    one_loss, one_gradients = optimizer_step_gradients(trainer, skipped)
    metrics = {key: list(trainer._metrics["train"][key]) for key in SAMPLING_KEYS}
    trainer.close()

    trl_ratio = torch.cat([m["importance_sampling_ratio"] for m in trl_micro_batches])
    one_ratio = torch.cat([m["importance_sampling_ratio"] for m in skipped])
    mask = torch.cat([m["completion_mask"] for m in trl_micro_batches]).bool()
    ratio_error = (one_ratio - trl_ratio).abs().max().item()
    gradient_error = relative_error(one_gradients, trl_gradients)
    token_ratio = trl_ratio[mask] if trl_ratio.shape == mask.shape else trl_ratio
    limits = (trl.get("vllm_importance_sampling_clip_min"), trl.get("vllm_importance_sampling_clip_max", 3.0))
    clipped = ((token_ratio == limits[0]) | (token_ratio == limits[1]) | (token_ratio == 0)).float().mean().item()
    print(
        f"{trl}: loss {trl_loss:.6f} TRL, {one_loss:.6f} one forward; gradients {gradient_error:.2e}; ratio "
        f"{ratio_error:.2e}, {clipped:.0%} clipped or masked; {mask.sum().item()} tokens"
    )
    for key in SAMPLING_KEYS:
        print(f"  {key}: {trl_metrics[key]} TRL, {metrics[key]} one forward")
    assert abs(one_loss - trl_loss) <= 2**-8 * abs(trl_loss) + 1e-6, (trl_loss, one_loss)
    assert gradient_error < 2**-6, gradient_error
    assert ratio_error < 2**-8, ratio_error
    if "clip_min" in str(trl):
        assert clipped > 0.02  # the clipping (or masking) is exercised
    # One value per generation batch, as TRL appends one at generation.
    assert all(len(metrics[key]) == len(trl_metrics[key]) == 1 for key in SAMPLING_KEYS), metrics
    for key in SAMPLING_KEYS:
        assert metrics[key][0] == pytest.approx(trl_metrics[key][0], rel=1e-4, abs=1e-6), key


def test_the_ratio_is_trls_in_every_mode_with_nan_and_masks():
    """The ratio's function against TRL's code by its cases: NaN sampling logprobs give 1, the masked tokens 1,
    truncation clamps, masking zeroes, a sequence mode one ratio per sequence from the masked tokens' sum."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    sampling = torch.tensor([[-1.5, float("nan"), -0.5], [-0.1, -0.2, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    token = importance_sampling_ratio(logps, sampling, mask, "token_truncate", None, 1.5)
    assert torch.allclose(token, torch.tensor([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    masked = importance_sampling_ratio(logps, sampling, mask, "token_mask", 0.9, 1.5)
    assert torch.allclose(masked, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    sequence = importance_sampling_ratio(logps, sampling, mask, "sequence_truncate", 0.5, 3.0)
    assert sequence.shape == (2, 1) and torch.allclose(sequence, torch.tensor([[0.5**-1 * 0.5 * 1.6487], [1.0]]), 1e-3)
    assert importance_sampling_ratio(logps, sampling, mask, "sequence_mask", None, 1.5).flatten().tolist() == [0, 1]
    with pytest.raises(ValueError, match="Unknown vLLM importance sampling level"):
        importance_sampling_ratio(logps, sampling, mask, "tokens", None, None)


@pytest.mark.parametrize(
    ("trl", "scoring_pass"),
    [
        ({}, False),  # aligned: steps_per_generation == gradient_accumulation_steps, num_iterations 1
        ({"steps_per_generation": 2}, False),  # two generation batches in one optimizer step, both on-policy
        ({"steps_per_generation": 8}, True),  # a generation batch over two optimizer steps
        ({"num_iterations": 2}, True),  # each micro-batch trained twice
        ({"vllm_importance_sampling_correction": False}, False),  # TRL's own aligned path: no scoring pass either
    ],
    ids=["aligned", "two-generations-a-step", "generation-over-two-steps", "num-iterations-2", "no-correction"],
)
def test_the_scoring_pass_runs_only_where_generation_is_off_the_training_policy(tmp_path, trl, scoring_pass):
    """Forwards of the trainer's model in one generation (TRL's _prepare_inputs: generate, score, cut): TRL's
    scoring pass (one forward per micro-batch of the generation batch) where the plan says the batch is off the
    training policy, none where it is on it, and the plan's line says which."""
    trainer = build_trainer(tiny_config(tmp_path, trl=trl))
    training = trainer.plan.training
    aligned = trl.get("vllm_importance_sampling_correction", True) and not scoring_pass
    assert training.one_forward is aligned
    line = "each training forward" if aligned else "a scoring pass" if scoring_pass else "no old log-probabilities"
    assert line in training.describe() and training.old_logprobs_needed is (aligned or scoring_pass)
    calls, handle = count_forwards(trainer.model)
    trainer.model.train()
    micro_batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    handle.remove()
    trainer.close()
    assert len(calls) == (training.steps_per_generation if scoring_pass else 0), calls
    assert ("importance_sampling_ratio" in micro_batch) is scoring_pass
    assert "sampling_per_token_logps" in micro_batch


def test_a_training_step_drops_the_scoring_pass_and_logs_trls_sampling_metrics(tmp_path):
    """A whole optimizer step through trainer.train(), with the plan's one forward and with TRL's scoring pass:
    the model's forwards drop from 2 to 1 a micro-batch, and the step's log has TRL's sampling metrics, once."""
    results = {}
    for one_forward in (True, False):
        config = tiny_config(tmp_path / str(one_forward))
        trainer = build_trainer(config)
        if not one_forward:
            trainer.on_policy.enabled = False
        calls, _ = count_forwards(trainer.model)
        trainer.train()
        logs = next(entry for entry in trainer.state.log_history if "loss" in entry)
        trainer.close()
        results[one_forward] = (len(calls), logs)
    (ours, our_logs), (trls, trl_logs) = results[True], results[False]
    assert (ours, trls) == (ACCUMULATION, 2 * ACCUMULATION)
    for key in SAMPLING_KEYS:
        assert key in our_logs and key in trl_logs, key
    assert 0 < our_logs["sampling/sampling_logp_difference/mean"] < 0.05
    assert our_logs["sampling/importance_sampling_ratio/min"] <= 1 <= our_logs["sampling/importance_sampling_ratio/max"]


def test_a_plan_that_scores_in_the_training_forward_is_refused_where_generation_is_off_the_policy(tmp_path):
    from colocate_grpo.trainer import ColocateGRPOTrainer

    aligned = check_inputs(tiny_config(tmp_path))
    assert aligned.plan.training.one_forward and scores_in_training_forward(aligned.args)
    off = check_inputs(tiny_config(tmp_path, trl={"num_iterations": 2}))
    assert not off.plan.training.one_forward and not scores_in_training_forward(off.args)
    plan = dataclasses.replace(off.plan, training=dataclasses.replace(off.plan.training, one_forward=True))
    with pytest.raises(ValueError, match="one_forward"):
        ColocateGRPOTrainer(None, None, off.args, plan=plan)
