"""The trainer's fp32 head: TRL's fused head in fp32, its GEMMs (and only its) on TF32 tensor cores."""

import pytest
import torch
import trl.trainer.utils as trl_utils
from transformers import AutoModelForCausalLM
from trl.kernels import ChunkedLogProbFunction

from colocate_grpo.head import TF32ChunkedLogProb, add_fp32_head
from colocate_grpo.tiny import tiny_model_path


def test_the_head_alone_computes_under_tf32_forward_and_backward_and_the_setting_comes_back(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.bfloat16)
    add_fp32_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    seen = {"forward": [], "backward": [], "rotary": []}

    def spy(name, original):
        def record(*args):
            seen[name].append(torch.backends.cuda.matmul.fp32_precision)
            return original(*args)

        return staticmethod(record)

    monkeypatch.setattr(ChunkedLogProbFunction, "forward", spy("forward", ChunkedLogProbFunction.forward))
    monkeypatch.setattr(ChunkedLogProbFunction, "backward", spy("backward", ChunkedLogProbFunction.backward))
    # The rotary angles are an fp32 matmul of the backbone's: TF32 would round them.
    model.model.rotary_emb.register_forward_hook(
        lambda *_: seen["rotary"].append(torch.backends.cuda.matmul.fp32_precision)
    )
    before = torch.backends.cuda.matmul.fp32_precision
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])

    output = model(input_ids=ids, labels=ids, fused_lm_head=True)
    output.log_probs.sum().backward()

    assert seen == {"forward": ["tf32"], "backward": ["tf32"], "rotary": [before]}
    assert before != "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    assert output.log_probs.dtype == torch.float32
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16  # no fp32 copy of the head
    assert model.get_output_embeddings().weight.grad is not None  # the tiny model's head is tied and trained here
    # Without the fused head, the model computes as before.
    assert model(input_ids=ids).logits.shape == (1, 6, model.config.vocab_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a CUDA tensor-core format")
def test_tf32_gives_the_ieee_fp32_logprobs_of_bf16_inputs_on_the_gpu():
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 512, 3584, 152064
    # Hidden states and weights of a 7B-sized head, bf16 values as the trainer's head sees them.
    hidden = (torch.randn(tokens, hidden_size, device="cuda") * 4).bfloat16().float()
    weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device="cuda")

    def log_probs(function, hidden, weight):
        hidden = hidden.clone().requires_grad_()
        out = function.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("entropy",))
        out[0].sum().backward()
        return out[0], hidden.grad

    with torch.autocast("cuda", enabled=False):
        ieee, ieee_grad = log_probs(ChunkedLogProbFunction, hidden, weight)
        tf32, tf32_grad = log_probs(TF32ChunkedLogProb, hidden, weight)
        bf16, _ = log_probs(ChunkedLogProbFunction, hidden.bfloat16(), weight)

    assert torch.backends.cuda.matmul.fp32_precision != "tf32"
    tf32_error = (tf32 - ieee).abs().max().item()
    bf16_error = (bf16.float() - ieee).abs().max().item()
    # Exact products, fp32 sums: the two differ in how the tensor cores accumulate (H200: 2.6e-4 against
    # the bf16 head's 0.066, logits of about 5).
    assert tf32_error < bf16_error / 100, (tf32_error, bf16_error)
    # The gradient's TF32 rounding is well below the bf16 rounding of the hidden states' gradient.
    relative = ((tf32_grad - ieee_grad).norm() / ieee_grad.norm()).item()
    assert relative < 2**-9, relative
