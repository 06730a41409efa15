"""TRL's GRPOTrainer with the colocated engine plugged in.

TRL owns the GRPO loop (losses, rewards, importance sampling, logging). Two things
change: its ``VLLMGeneration`` is replaced by :class:`ColocatedGeneration`, which
drives our :class:`~colocate_grpo.engine.Engine` and owns the sleep/wake policy,
and weights reach the engine through :mod:`colocate_grpo.sync` instead of PEFT
merge/unmerge and per-tensor loads. A LoRA model's base weights are the engine's
(one copy, :mod:`colocate_grpo.shared_base`): merged serving merges into them in
place for each generation and restores them bitwise before the trainer computes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import trl.trainer.grpo_trainer as grpo_module
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from colocate_grpo.adapters import push_adapter, served_adapter_mismatches
from colocate_grpo.batching import group_by_length, is_text_batch, length_order, regrouping_changes_loss, trimmed
from colocate_grpo.checkpoints import save_checkpoint
from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Engine, Weights, shared_engine
from colocate_grpo.head import add_fp32_head
from colocate_grpo.lora import RetainedUpdate
from colocate_grpo.memory_plan import device_memory_errors
from colocate_grpo.metrics import LogpAgreement, PhaseClock, PhaseMetrics
from colocate_grpo.on_policy import OnPolicyScoring, scores_in_training_forward
from colocate_grpo.plan import RunPlan, plan_for_model
from colocate_grpo.quantized import served_code_mismatches
from colocate_grpo.rewards import calculate_rewards
from colocate_grpo.serving import Serving
from colocate_grpo.shared_base import share_base_weights
from colocate_grpo.sync import (
    MergedInPlace,
    frozen_base,
    merge_into_shared_base,
    push_weights,
    served_weight_mismatches,
)

logger = logging.getLogger(__name__)


@dataclass
class MergeCheck:
    """Measures, during a sync, how much of the LoRA update the served weights keep.

    Runs at the first sync and then every ``interval`` optimizer steps (0 disables it). With
    merge-aware LoRA, and with full fine-tuning, it checks that the engine holds exactly the trainer's
    forward weights; with adapter serving, its LoRA factors.

    Args:
        interval: optimizer steps between checks.
        merge_aware: whether the model's LoRA layers are merge-aware.
        step: returns the current optimizer step.
        log: receives the metrics of each check, e.g. ``{"lora_merge/retained": 0.24}``.
    """

    interval: int
    merge_aware: bool
    step: Callable[[], int]
    log: Callable[[dict[str, float]], None]
    checks: int = field(default=0, init=False)

    def due(self) -> bool:
        return self.interval > 0 and (self.checks == 0 or self.step() % self.interval == 0)

    def report(
        self, stats: RetainedUpdate, mismatches: list[str] | None, in_place: MergedInPlace | None = None
    ) -> None:
        metrics = {"lora_merge/changed_fraction": stats.changed_fraction}
        if in_place:  # the share of merged values whose undo needed more than a byte: the record's growth
            metrics["lora_merge/in_place_outliers"] = in_place.outlier_fraction
        # Merge-aware LoRA trains the cast weights themselves: all of its update is served, which the
        # bitwise check below shows; the cast-of-the-fp32-delta share would only mislead there.
        if stats.delta_sq > 0 and not self.merge_aware:  # a fresh adapter (B = 0) has no update yet
            metrics["lora_merge/retained"] = stats.retained
        if self.merge_aware and mismatches is None:
            self._warn_not_comparable("lora_merge/served_equals_trained")
        elif self.merge_aware:
            metrics["lora_merge/served_equals_trained"] = float(not mismatches)
            if mismatches:
                logger.error("vLLM does not serve the trained weights for: %s", ", ".join(mismatches[:5]))
        if self.checks > 0 and not self.merge_aware and stats.delta_sq > 0 and stats.retained < 0.5:
            logger.warning(
                "Only %.0f%% of the LoRA update survives the merge into the served weights; vLLM samples from a "
                "policy that lacks most of the trained update. Set 'lora_merge_aware: bf16' to serve all of it.",
                100 * stats.retained,
            )
        self.checks += 1
        self.log(metrics)

    def report_codes(self, mismatches: list[str]) -> None:
        """Log whether the engine's 4-bit base holds the trainer's codes and block scales bitwise."""
        if mismatches:
            logger.error("vLLM's 4-bit base differs from the trainer's for: %s", ", ".join(mismatches[:5]))
        self.log({"qlora/served_codes_equal_trained": float(not mismatches)})

    def report_weights(self, mismatches: list[str] | None) -> None:
        """Log whether the engine holds the trainer's weights bitwise (full fine-tuning)."""
        if mismatches is None:
            self._warn_not_comparable("sync/served_equals_trained")
        else:
            if mismatches:
                logger.error("vLLM does not serve the trained weights for: %s", ", ".join(mismatches[:5]))
            self.log({"sync/served_equals_trained": float(not mismatches)})
        self.checks += 1

    def _warn_not_comparable(self, key: str) -> None:
        if self.checks == 0:
            logger.warning(
                "%s is not logged: the engine's parameters do not map onto the trainer's tensors (vLLM packed or "
                "quantized them), so they cannot be compared bitwise.",
                key,
            )

    def report_adapter(self, mismatches: list[str]) -> None:
        """Log whether the engine's LoRA buffers hold the trainer's factors bitwise (adapter serving)."""
        if mismatches:
            logger.error("vLLM does not serve the trained adapter for: %s", ", ".join(mismatches[:5]))
        self.checks += 1
        self.log({"lora_sync/served_equals_trained": float(not mismatches)})


class ColocatedGeneration(VLLMGeneration):
    """TRL's colocated generation on our engine.

    TRL's own sleep handling is switched off (``enable_sleep_mode=False`` towards
    TRL); this class wakes the engine before each generation and puts it back to
    sleep afterwards, also when generation raises. A sync wakes the weights, writes
    them, and wakes the KV cache while the device is still writing. Completions are
    not detokenized by vLLM unless stop strings need it (TRL decodes them itself).

    With merged serving on a shared base, the merge into the base weights lasts from the sync to
    the end of the generation (or of a failed sync): then the base is restored, bitwise, and a
    generation without a new sync merges the same weights again.
    """

    def __init__(
        self,
        *args: Any,
        engine_factory: Callable[[VLLMGeneration], Engine],
        serving: Serving,
        shared_base_bytes: int = 0,
        merge_record_in_host_memory: bool = False,
        **kwargs: Any,
    ) -> None:
        self._engine_factory = engine_factory
        self.serving = serving
        self.shared_base_bytes = shared_base_bytes  # the trainer's base weights given up for the engine's
        # Base weights merged for the engine, until restored.
        self.merged_in_place = MergedInPlace(in_host_memory=merge_record_in_host_memory)
        self.merge_check: MergeCheck | None = None
        self.clock = PhaseClock()
        kwargs["enable_sleep_mode"] = False
        super().__init__(*args, **kwargs)
        # TRL reads token ids and logprobs, never the text. vLLM would detokenize every sampled token (and its
        # logprob's token) on the CPU between decode steps; stop strings need the text, so they keep it.
        if not self.generation_kwargs.get("stop"):
            self.generation_kwargs = {"detokenize": False, **self.generation_kwargs}

    def _init_vllm(self) -> None:
        self.llm: Engine = self._engine_factory(self)
        self.clock.pools = self.llm.pool_bytes
        self.llm.sleep()

    @property
    def shares_base(self) -> bool:
        """Whether the trainer's base weights are the engine's (one copy): a sync sends the adapter, or merges it
        into them in place."""
        return self.shared_base_bytes > 0

    @property
    def merges_in_place(self) -> bool:
        """Whether a sync merges the LoRA layers into the shared base weights (restored after generating)."""
        return self.shares_base and self.serving.merges

    @property
    def engine(self) -> Engine:
        return self.llm

    def sync_weights(self) -> None:
        try:
            self._sync_weights()
        except BaseException:
            self.merged_in_place.restore()  # the layers merged before the failure: the trainer's base again
            raise

    def _sync_weights(self) -> None:
        check = self.merge_check if self.merge_check is not None and self.merge_check.due() else None
        stats = RetainedUpdate() if check is not None else None
        with self.clock.phase("wake"):
            self.llm.wake_up(["weights"])
        with self.clock.phase("sync"):
            if self.merges_in_place:
                self.merged_in_place.restore()  # a sync without a generation since the last one
                merge_into_shared_base(self.model, self.llm, self.merged_in_place, stats, settle=False)
            elif self.serving.serves_adapter:
                # The base weights go only where the engine lost them (a level-2 sleep), with its LoRA buffers.
                # Pinned ones (shared with the trainer, or 4-bit) are never lost, and written by nobody, ever.
                base_lost = self.llm.state.weights is not Weights.RESIDENT and not self.llm.weights_pinned
                if base_lost:
                    push_weights(self.model, self.llm, merge=False)
                push_adapter(self.model, self.llm, clear=base_lost)
            else:
                push_weights(self.model, self.llm, stats)
            # Generation comes next and needs the KV cache. Waking it is the driver's work on the CPU: done
            # while the device still writes the weights, it takes no time of its own (bench/FINDINGS.md).
            self.llm.wake_up(["kv_cache"])
            self.merged_in_place.settle()  # the merges in place wait for the device here, once, after the wake
        if check is None:
            return
        if self.serving.serves_adapter:
            check.report_adapter(served_adapter_mismatches(self.model, self.llm))
            if self.serving is Serving.QUANTIZED_BASE:
                check.report_codes(served_code_mismatches(self.model, self.llm))
        elif self.serving is Serving.FULL_WEIGHTS:  # the trained weights are served as they are
            check.report_weights(served_weight_mismatches(self.model, self.llm))
        else:
            merged = self.merged_in_place
            mismatches = served_weight_mismatches(self.model, self.llm, merged) if check.merge_aware else None
            check.report(stats, mismatches, merged)

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        # The weights are lost after a level-2 sleep; a shared base is merged only from a sync to a generation's end.
        lost = self.llm.state.weights in (Weights.DISCARDED, Weights.GARBAGE)
        if lost or (self.merges_in_place and not self.merged_in_place):
            self.sync_weights()
        if not self.llm.state.ready:  # a sync wakes everything
            with self.clock.phase("wake"):
                self.llm.wake_up()
        try:
            with self.clock.phase("generate"):
                return super().generate(*args, **kwargs)
        finally:
            with self.clock.phase("sleep"):
                self.llm.sleep()  # the KV cache alone where the weights are shared (pinned)
                self.merged_in_place.restore()


@contextlib.contextmanager
def _generation_class(factory: Callable[..., VLLMGeneration]) -> Iterator[None]:
    """GRPOTrainer builds ``VLLMGeneration`` by module-global name; point it at ours while it does."""
    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


class ColocateGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose vLLM engine lives in this process and sleeps while training.

    Takes GRPOTrainer's arguments, plus:

    Args:
        plan: the run plan (:mod:`colocate_grpo.plan`), made before the model loaded (``build_trainer`` does).
            None: planned here from the model and ``args`` (:func:`~colocate_grpo.plan.plan_for_model`), with
            ``vllm_options``, ``serve_adapter`` and ``sequence_tokens``, which a given plan already holds.
        vllm_options: the ``vllm:`` block (engine dtype, memory fraction, sleep level, ...). An unset
            ``max_model_len`` becomes TRL's ``vllm_max_model_length`` (at most the model's context), so
            that the KV cache is sized to the batch rather than to the model's whole context.
        serve_adapter: serve the LoRA adapter with vLLM's LoRA kernels (:mod:`colocate_grpo.adapters`)
            instead of merged weights. Needs a PEFT LoRA model without merge-aware layers.
        sequence_tokens: the tokens a generated sequence takes at most (the dataset's longest prompt plus
            ``max_completion_length``), which sizes the KV cache; None sizes it for ``max_model_len``.
        engine: an engine to use. When None, the process's live engine is reused if it was built for the
            plan's engine, else a new one is created.
        merge_check_interval: optimizer steps between retained-update checks (0: never); see
            :class:`MergeCheck`. With adapter serving, between checks that the engine holds the
            trainer's LoRA factors bitwise.
        group_by_length: compute no padding (:mod:`colocate_grpo.batching`): each forward trimmed to its rows'
            longest prompt and completion, the scoring pass in chunks of similar length, and each optimizer
            step's micro-batches regrouped by completion length. ``"auto"``: all three where regrouping keeps
            the loss (every loss type but ``bnpo``, without the entropy bonus, the high-entropy mask or a
            router loss), else the first two, which keep every loss. True: all three, refused where regrouping
            would change the loss. False: TRL's padding.

    A PEFT model's frozen base weights become the engine's (:mod:`colocate_grpo.shared_base`) where
    their layouts line up: the device holds one copy, and the engine's KV cache sleeps alone.

    ``args.cast_lm_head_to_fp32`` computes the logits in fp32 on both sides: the engine with vLLM's
    fp32 head, the trainer with TRL's fused head in fp32 (its GEMMs on TF32 cores, exact for bf16
    inputs: :mod:`colocate_grpo.head`). Both read the head's weights in the model's dtype: the
    trainer's head is not cast to an fp32 copy, so tied heads work too, and the sync sends what the
    engine already computes with.
    """

    # What drives the engine for TRL (a subclass generates asynchronously: colocate_grpo.async_generation).
    generation_class: type[ColocatedGeneration] = ColocatedGeneration

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: GRPOConfig,
        *,
        plan: RunPlan | None = None,
        vllm_options: VLLMConfig | None = None,
        serve_adapter: bool = False,
        sequence_tokens: int | None = None,
        engine: Engine | None = None,
        merge_check_interval: int = 50,
        group_by_length: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        if group_by_length not in (True, False, "auto"):
            raise ValueError(f"'group_by_length' must be 'auto', true or false, got {group_by_length!r}.")
        if plan is None:
            plan = plan_for_model(
                model, args, vllm_options=vllm_options, serve_adapter=serve_adapter, sequence_tokens=sequence_tokens
            )
        elif vllm_options is not None or serve_adapter or sequence_tokens is not None:
            raise ValueError(
                "Pass either a plan or vllm_options, serve_adapter and sequence_tokens: the plan has them."
            )
        self.plan = plan
        if plan.training.one_forward and not scores_in_training_forward(args):
            raise ValueError(
                "The plan's one_forward needs generation on the training policy (num_iterations 1, "
                "steps_per_generation a divisor of gradient_accumulation_steps, TRL's vLLM importance-sampling "
                "correction on): plan again from these arguments."
            )
        # TRL's scoring pass, or the importance-sampling ratio from each training forward (colocate_grpo.on_policy).
        self.on_policy = OnPolicyScoring(plan.training.one_forward)
        # TRL's cast makes the head an fp32 copy (with PEFT it fails on tied heads); its fused head alone, added
        # below, computes in fp32 from the weights as they are.
        fp32_head, args.cast_lm_head_to_fp32 = args.cast_lm_head_to_fp32, False
        if plan.bitwise is not None:  # vLLM's batch-invariant mode, before the engine starts (colocate_grpo.bitwise)
            from colocate_grpo import bitwise

            bitwise.prepare_process()

        def build_engine() -> Engine:
            return engine if engine is not None and not engine.closed else shared_engine(plan.engine)

        shared_base_bytes = 0
        if plan.shared_base:
            # Before TRL moves the model to the device: a base still in host memory (load_model leaves a LoRA
            # model's there) becomes the engine's copy, and the device never holds two.
            engine = build_engine()
            # A merged sync writes into the shared weights: only where the engine computes with them.
            if plan.serving.serves_adapter or engine.writes_in_place:
                shared_base_bytes = share_base_weights(model, engine, write_all=plan.nf4_values)
            if not shared_base_bytes:
                logger.warning(
                    "The plan shares the base weights with the engine, but their layouts do not line up: the device "
                    "holds two copies of the base (%s).",
                    plan.serving.describe(shared_base=False),
                )
                if plan.nf4_values:  # the engine loaded the checkpoint's weights: it must serve their NF4 values
                    engine.load_weights(frozen_base(model).items())
        generation = functools.partial(
            self.generation_class,
            engine_factory=lambda _: build_engine(),
            serving=plan.serving,
            shared_base_bytes=shared_base_bytes,
            merge_record_in_host_memory=plan.merge_record_in_host_memory,
        )
        try:
            with _generation_class(generation):
                super().__init__(model, reward_funcs, args, **kwargs)
        finally:
            args.cast_lm_head_to_fp32 = fp32_head
        if fp32_head:
            # TRL's fused head, again, in fp32: it wraps the one TRL added, which other calls still reach.
            add_fp32_head(
                self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model,
                temperature=self.temperature,
                outputs=("log_probs", "entropy"),
            )
            if self.ref_model is not None:
                add_fp32_head(self.ref_model, temperature=self.temperature)
        if plan.bitwise is not None:  # TRL's scoring forward, computed with the engine's kernels
            bitwise.install(
                self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model,
                self.engine.bitwise_kernels,
                self.temperature,
            )
        self.logp_agreement = LogpAgreement(
            self._record_metrics,
            bitwise=plan.bitwise is not None,
            log_differences=not self.vllm_importance_sampling_correction,
        )
        self._loss_inputs: dict[str, Any] | None = None  # the micro-batch whose loss is being computed
        if not shared_base_bytes:  # a reused engine may have been pinned for a trainer that shared its weights
            self.engine.unpin_weights()
        self.vllm_generation.merge_check = MergeCheck(
            merge_check_interval,
            plan.serving is Serving.MERGE_AWARE,
            step=lambda: self.state.global_step,
            log=self._record_metrics,
        )
        self.add_callback(PhaseMetrics(self.vllm_generation.clock, record=self._record_metrics))
        changes_loss = regrouping_changes_loss(
            self.loss_type, self.top_entropy_quantile, self._entropy_bonus_enabled, self.aux_loss_enabled
        )
        if group_by_length is True and changes_loss:
            raise ValueError(
                f"'group_by_length: true' would change the loss: {changes_loss}, and regrouping the micro-batches "
                "changes which tokens share one. Use 'group_by_length: auto' (padding trimmed, the micro-batches "
                "kept as TRL cuts them)."
            )
        # Exact for every loss: each forward trimmed to its rows, the scoring pass in chunks of similar length.
        self.trims_padding = group_by_length is not False
        # Exact where the loss is a sum over sequences whose weights do not depend on their micro-batch.
        self.regroups_micro_batches = self.trims_padding and changes_loss is None

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._buffered_inputs is not buffered  # TRL generated and cut a new generation batch
        if fresh and self.regroups_micro_batches and self.model.training and is_text_batch(inputs):
            # Micro-batches that exchange sequences must train in one optimizer step: a window divides both the
            # generation batch's micro-batches (steps_per_generation) and an optimizer step's.
            window = math.gcd(self.args.steps_per_generation, self.args.gradient_accumulation_steps)
            self._buffered_inputs = group_by_length(self._buffered_inputs, window)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        with self.on_policy.generating(self):
            return super()._generate_and_score_completions(inputs)

    def _logps_without_padding(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's log-probabilities (and entropies, and router loss) of the completion tokens, with no padding
        computed: the rows in chunks of ``batch_size`` by length, each chunk trimmed to its own longest prompt
        and completion, the outputs padded back (with the zeros TRL gives padding) and put in the rows' order."""
        if not self.trims_padding or any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        rows = input_ids.size(0)
        batch_size = batch_size or rows
        if batch_size < rows:  # the scoring pass: chunks of similar length
            prompt_width = input_ids.size(1) - logits_to_keep
            mask = attention_mask.bool()
            order = length_order(mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1))
        else:
            order = torch.arange(rows, device=input_ids.device)
        logps, entropies, aux_losses = [], [], []
        for start in range(0, rows, batch_size):
            chunk = order[start : start + batch_size]
            columns, kept = trimmed(input_ids[chunk], attention_mask[chunk], logits_to_keep, self.pad_to_multiple_of)
            chunk_logps, chunk_entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model,
                input_ids[chunk][:, columns],
                attention_mask[chunk][:, columns],
                kept,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
            )
            logps.append(F.pad(chunk_logps, (0, logits_to_keep - kept)))
            if compute_entropy:
                entropies.append(F.pad(chunk_entropies, (0, logits_to_keep - kept)))
            if compute_aux_loss:
                aux_losses.append(aux_loss)
        restore = torch.argsort(order)
        return (
            torch.cat(logps)[restore],
            torch.cat(entropies)[restore] if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    @property
    def served_as(self) -> str:
        """How the engine serves the trained policy, in words (the plan's serving, with the base shared or not)."""
        return self.plan.serving.describe(self.vllm_generation.shares_base, self.plan.engine.fp32_head)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.accelerator.num_processes > 1:
            self._reduce_over_ranks(self._metrics["train"])
        super().log(logs, start_time)

    def _reduce_over_ranks(self, metrics: dict[str, list[float]]) -> None:
        """Make the logged memory the largest of any rank's, and the served-equals-trained checks (weights, adapter,
        4-bit codes) the worst.

        TRL logs its other metrics gathered over the ranks already; these are each rank's own.
        """
        reductions = {
            "memory/": max,
            "served_equals_trained": min,
            "served_codes_equal_trained": min,
            "logp_equal_fraction": min,
        }
        local = {
            key: sum(values) / len(values)
            for key, values in metrics.items()
            if values and any(part in key for part in reductions)
        }
        ranks = gather_object([local])
        for key in {key for rank in ranks for key in rank}:
            reduce = next(r for part, r in reductions.items() if part in key)
            metrics[key] = [reduce(rank[key] for rank in ranks if key in rank)]

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # TRL's loss takes one forward of the micro-batch (_get_per_token_logps_and_entropies): its log-probabilities
        # give the importance-sampling ratio where the scoring pass was skipped, and are checked against the engine's.
        self._loss_inputs = inputs
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = self._logps_without_padding(*args, **kwargs)
        inputs, self._loss_inputs = self._loss_inputs, None  # the loss's forward; once
        if inputs is not None:
            self.on_policy.score(self, inputs, out[0].detach())
            self._check_agreement(inputs, out[0])
        return out

    def _check_agreement(self, inputs: dict[str, Any], logps: torch.Tensor) -> None:
        """The loss forward's log-probabilities against the engine's (LogpAgreement), where the micro-batch is scored
        with the weights that sampled it: before the first optimizer step since its generation."""
        sampled = inputs.get("sampling_per_token_logps")
        since_generation = self._step % (self.args.steps_per_generation * self.num_iterations)
        if (
            sampled is None
            or self.plan.asynchronous is not None
            or since_generation >= self.args.gradient_accumulation_steps
        ):
            return
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        self.logp_agreement.check(logps, sampled, mask, step=self.state.global_step)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        # A failing reward named with its sample; None/NaN scores counted (colocate_grpo.rewards).
        return calculate_rewards(self, super()._calculate_rewards, inputs, prompts, completions, completion_ids_list)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # transformers' checkpoint, then its manifest: complete, or plainly not (colocate_grpo.checkpoints).
        save_checkpoint(self, trial, functools.partial(super()._save_checkpoint, model, trial))

    def _record_metrics(self, metrics: dict[str, float]) -> None:
        """Add values to TRL's metrics: averaged into the next log, then written to every logger."""
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)

    @property
    def engine(self) -> Engine:
        return self.vllm_generation.engine

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``. In a run built from a config (``build_trainer``: the CLI, ``train()``, notebooks):

        - the output folder (``run_folder``) is held for the run: its lock taken unless held already, an earlier
          run cleared (``overwrite_output_dir``) or a fresh run into one refused, a resumed run's metrics cut to
          its checkpoint (:class:`~colocate_grpo.output_dir.OutputDir`);
        - the run resumes from the config's ``resume_from_checkpoint`` unless the call names a checkpoint;
        - running out of device memory raises a :class:`~colocate_grpo.memory_plan.DeviceMemoryError` naming the
          phase it happened in (generate, sync, train, ...), the plan's numbers and the fixes, not torch's
          traceback.
        """
        config = getattr(self, "run_config", None)
        if config is None:  # direct use: the caller's own config names no keys to suggest
            return super().train(*args, **kwargs)
        folder = self.run_folder
        claimed = folder.claim()
        try:
            if self.accelerator.is_main_process:
                folder.begin(self.metrics.path)  # fresh metrics start empty; a resumed run's end at its checkpoint
            if not args:
                kwargs.setdefault("resume_from_checkpoint", folder.checkpoint)
            clock = self.vllm_generation.clock
            memory, training = self.plan.memory, self.plan.training
            with device_memory_errors(lambda: clock.failed_phase or "train", memory, config, training):
                return super().train(*args, **kwargs)
        finally:
            if claimed:
                folder.release()

    def close(self) -> None:
        """Shut the engine down and return its memory. Safe to call twice.

        On GPUs, vLLM then allows no new engine in this process; to train again in the same
        process (a notebook), let the engine sleep instead: the next trainer reuses it.
        """
        self.engine.close()

    def __enter__(self) -> ColocateGRPOTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
