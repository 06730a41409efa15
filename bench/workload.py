"""The benchmarks' models, prompts, reward and the plain config a user writes: built locally, no download.

Shapes are Qwen2.5's dimensions (``QWEN25``), Qwen3 1.7B's and 32B's (``QWEN3``: q/k norms, heads of 128) and
Llama 3.1 8B's (``LLAMA31``) with random bf16 weights and a tokenizer of one token a word
(:func:`words_tokenizer`); ``tiny`` is colocate_grpo's 0.3M-parameter model (the CPU checks). A shape
ending in ``-sharp`` has its head scaled so that its next-token distributions are as sharp as a trained
model's; one ending in ``-stops`` ends a completion with about ``STOP_RATE`` a token, so that completions
have varied lengths, as a trained model's do (see :func:`build_model`).
"""

from __future__ import annotations

import itertools
import json
import random
import string
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QWEN25 = {
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "3B": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "14B": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
}
# Qwen3 1.7B's dimensions (its checkpoint ties the head to the embeddings; the benchmark's shapes all have their own).
QWEN3 = {
    "1.7B": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "32B": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
}
# Llama 3.1 8B's dimensions (its own head; no q, k and v biases, where Qwen2.5's shapes have them).
LLAMA31 = {
    "Llama8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}
DIMENSIONS = QWEN25 | QWEN3 | LLAMA31
SHARP = "-sharp"
SHARP_LOGIT_STD = 8.0
STOPS = "-stops"
END_OF_SEQUENCE = "<|endoftext|>"  # token 0 of a shape's tokenizer (words_tokenizer)
WORD_SPACE = "\u0120"  # a byte-level BPE's space: a word's token is it and the word's letters
FIRST_WORD_ID = 28  # after the end of sequence, the space and the 26 letters
BRIEF_TOKENS = 32  # brevity_reward's: a completion this long or shorter earns 1
REWARD = "half_vocabulary_reward"  # the benchmark's reward, unless an experiment names another
STOP_RATE = 0.01  # a -stops model's mean probability of its end-of-sequence token: completions of ~90 tokens of 256
PROMPT_TOKENS = 32  # words a prompt has: that many tokens (one a word, :func:`words_tokenizer`)
PROMPTS = 256
NUM_GENERATIONS = 8
GENERATION_BATCH = 64  # sequences generated a step: 8 prompts x 8 generations
COMPLETION_TOKENS = 256  # the most a completion may have; random weights rarely stop sooner
TINY_COMPLETION_TOKENS = 4
STEPS_PER_PASS = PROMPTS // (GENERATION_BATCH // NUM_GENERATIONS)  # steps that draw every prompt once


def base_shape(shape: str) -> str:
    """The ``DIMENSIONS`` name of a shape (``1.5B`` of ``1.5B-stops``)."""
    return shape.split("-")[0]


def layer_linears(dims: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of one decoder layer of a model with these dimensions (a ``DIMENSIONS`` entry or a
    config's ``to_dict()``), by its name in the layer: q, k, v, o, gate, up, down."""
    hidden, inter = dims["hidden_size"], dims["intermediate_size"]
    head = dims.get("head_dim") or hidden // dims["num_attention_heads"]
    query, kv = head * dims["num_attention_heads"], head * dims["num_key_value_heads"]
    return {
        "self_attn.q_proj": (query, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, query),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def linear_shapes(shape: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of a shape but the head: q, k, v, o, gate, up, down per layer."""
    return list(layer_linears(DIMENSIONS[shape]).values()) * DIMENSIONS[shape]["num_hidden_layers"]


def half_vocabulary_reward(completions: list[str], **_: object) -> list[float]:
    """Share of the completion's words in a fixed half of the vocabulary (those whose CRC-32 is even).

    A reward with spread at every shape, so that every step trains: a group's completions of 256 tokens
    differ by about 0.03, of 4 tokens (the tiny model) by about 0.25, and a policy earns more by moving
    probability into that half. (A share of distinct tokens has none at 1.5B and 7B: 256 tokens drawn
    from 152k rarely repeat, every reward is 1, and every gradient 0.)
    """
    return [sum(zlib.crc32(w.encode()) % 2 == 0 for w in c.split()) / max(1, len(c.split())) for c in completions]


def brevity_reward(completion_ids: list[list[int]], **_: object) -> list[float]:
    """1 for a completion that ended within ``BRIEF_TOKENS`` tokens, else 0: for a ``-stops`` shape, whose
    completions end at about ``STOP_RATE`` a token, a reward a policy learns within a few hundred steps (raising the
    end-of-sequence token's probability: the residual stream's channel that sets it, :func:`make_stops`, is one a
    LoRA layer can write). The share of words in half the vocabulary (:func:`half_vocabulary_reward`) is learned far
    slower: a random head spreads that half over every direction of the hidden state."""
    return [float(len(ids) <= BRIEF_TOKENS) for ids in completion_ids]


def benchmark_prompts(model_path: str, count: int = PROMPTS) -> list[str]:
    """``count`` prompts for the model at ``model_path``: the arithmetic task's on the tiny model, on a
    :func:`build_model` shape ``PROMPT_TOKENS`` words of its vocabulary, one token each (the same every call)."""
    if "tiny" in model_path:
        from colocate_grpo.tasks import arithmetic_dataset

        return list(arithmetic_dataset(size=count)["prompt"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(0)

    def words() -> str:
        ids = [rng.randrange(FIRST_WORD_ID, len(tokenizer)) for _ in range(PROMPT_TOKENS)]
        return "".join(token.replace(WORD_SPACE, " ") for token in tokenizer.convert_ids_to_tokens(ids))

    return [words() for _ in range(count)]


def words_tokenizer(vocab_size: int) -> Any:
    """A transformers tokenizer of ``vocab_size`` tokens in which a space and a word of lowercase letters is one token.

    Token 0 is the end of a sequence, 1 to 27 the space and the letters, the rest " a" to " z", " aa" to " zz" and
    so on (from ``FIRST_WORD_ID``). It is a byte-level BPE built as Qwen2's is (its pre-tokenizer's regex, a byte-level
    alphabet, merges that build each word from its letters), because transformers loads a Qwen2 or Qwen3 model's
    tokenizer as ``Qwen2Tokenizer`` whatever class its files name, rebuilding it from the vocabulary and merges with
    that pre-tokenizer: a word-level tokenizer came back from it as one that drops every unknown piece.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {END_OF_SEQUENCE: 0, WORD_SPACE: 1, **{c: 2 + i for i, c in enumerate(string.ascii_lowercase)}}
    merges, level = [], [WORD_SPACE]
    while len(vocab) < vocab_size:  # breadth first: every word of n letters before any of n + 1
        longer = []
        for prefix, letter in itertools.product(level, string.ascii_lowercase):
            if len(vocab) == vocab_size:
                break
            vocab[prefix + letter] = len(vocab)
            merges.append((prefix, letter))
            longer.append(prefix + letter)
        level = longer
    bpe = tokenizer_models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_SEQUENCE, pad_token=END_OF_SEQUENCE)


def shape_config(shape: str) -> PretrainedConfig:
    """The Hugging Face config of the random-weight Qwen2 (Qwen3 for a ``QWEN3`` shape, Llama for a ``LLAMA31`` one)
    of ``shape`` (an untied head)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    family = base_shape(shape)
    config_class = Qwen3Config if family in QWEN3 else LlamaConfig if family in LLAMA31 else Qwen2Config
    return config_class(
        **DIMENSIONS[family],
        # Qwen2.5's context (the completion frontier goes long), Llama 3.1's.
        max_position_embeddings=131072 if family in LLAMA31 else 32768,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )


def build_model(shape: str, models: Path) -> str:
    """The directory of ``shape``'s model, built in ``models/<shape>`` unless it is there already.

    A random-weight bf16 model of :func:`shape_config` with a tokenizer of one token a word
    (:func:`words_tokenizer`); ``tiny`` is colocate_grpo's tiny model. A shape ending in ``-sharp`` (``1.5B-sharp``)
    has its head scaled so that the logits' standard deviation is ``SHARP_LOGIT_STD``: a random model's next-token
    distributions are near uniform (entropy 11.2 nats of at most 11.9), a trained model's are sharp, and the head's
    rounding weighs with the logits' size.
    A shape ending in ``-stops`` has its end-of-sequence row of the head set (:func:`make_stops`) so that a
    completion ends with probability ``STOP_RATE`` a token: a random model's almost never ends one (1 in 152k a
    token), and every completion would take all 256 tokens.
    """
    if shape == "tiny":
        from colocate_grpo.tiny import tiny_model_path

        return str(tiny_model_path())
    directory = models / shape
    if (directory / "config.json").exists():
        return str(directory)
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = words_tokenizer(DIMENSIONS[base_shape(shape)]["vocab_size"])
    config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if shape.endswith(SHARP):  # the final norm's output has unit RMS: a logit's std is the head row's norm
        with torch.no_grad():
            model.lm_head.weight.mul_(SHARP_LOGIT_STD / (config.initializer_range * config.hidden_size**0.5))
    if shape.endswith(STOPS):
        make_stops(model, config.eos_token_id, STOP_RATE)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # The runs measure the device's used memory, which would count this process's cache (30 GiB at 7B).
    del model
    torch.cuda.empty_cache()
    return str(directory)


def make_stops(model: Any, eos: int, rate: float, sequences: int = 8, tokens: int = 64) -> float:
    """Make ``model`` end a sequence with probability about ``rate`` at every token, whatever came before.

    The residual stream's first channel is made a constant: every token's embedding holds the same value there and
    no layer writes to it (the first row of each ``o_proj`` and ``down_proj`` zero), so the final norm's first
    output is that constant over the stream's RMS, nearly the same at every position. The head's ``eos`` row is
    c * e_0, c chosen so that over the hidden states of random sequences the mean probability of ``eos`` is
    ``rate``: its logit is then nearly the same everywhere. Returns c."""
    import torch

    head = model.lm_head.weight
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, head.size(0), (sequences, tokens), generator=generator).to(head.device)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = embeddings.float().std()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, head.size(1)).float()
        others = torch.cat([head[:eos], head[eos + 1 :]]).float()
        rest = torch.logsumexp(hidden @ others.T, dim=-1)  # the other tokens' log-sum-exp at each position

    def stop_rate(scale: float) -> float:
        return torch.sigmoid(scale * hidden[:, 0] - rest).mean().item()

    low, high = 0.0, 1.0
    while stop_rate(high) < rate:
        high *= 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if stop_rate(middle) < rate else (low, middle)
    with torch.no_grad():
        head[eos] = 0
        head[eos, 0] = high
    return high


def user_config(
    model_path: str,
    directory: Path,
    steps: int,
    micro_batch: int,
    completion_tokens: int,
    extra: Mapping[str, Any] | None = None,
    prompts: list[str] | None = None,
    reward: str = REWARD,
    generation_batch: int = GENERATION_BATCH,
) -> dict[str, Any]:
    """The config a user writes for this benchmark: model, dataset, reward and batch keys, all else default,
    plus ``extra`` (the one key that picks another way of serving the policy, say; its ``trl`` block merges
    into the config's). ``generation_batch`` sequences a step, ``NUM_GENERATIONS`` a prompt. The prompts (by
    default :func:`benchmark_prompts`) are written to ``directory``/prompts.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "prompts.jsonl"
    prompts = benchmark_prompts(model_path) if prompts is None else prompts
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    extra = dict(extra or {})
    return {
        "base_model": model_path,
        "output_dir": str(directory / "run"),
        "task": None,
        "dataset": {"path": str(data), "chat": False},
        "micro_batch_size": micro_batch,
        "gradient_accumulation_steps": generation_batch // micro_batch,
        "max_steps": steps,
        **{key: value for key, value in extra.items() if key != "trl"},
        "trl": {
            "reward_funcs": [f"workload.{reward}"],
            "num_generations": NUM_GENERATIONS,
            "max_completion_length": completion_tokens,
            **extra.get("trl", {}),
        },
    }
