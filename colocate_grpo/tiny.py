"""The tiny default model: a 0.4M-parameter Qwen2 that has half-learned addition.

Built locally (no model hub) and cached, so that the default job, the tests and
the notebooks run on a 2-core CPU in minutes. A short supervised warm-up teaches
the answer format and some sums; GRPO then has something to reinforce.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from colocate_grpo.tasks import arithmetic_problems, arithmetic_prompt

TINY_MODEL_NAME = "tiny"

# Changing any of these rebuilds the cached model (they are part of the cache key).
_RECIPE = {
    "version": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "warmup_steps": 400,
    "warmup_batch": 64,
    "warmup_lr": 3e-3,
    "seed": 0,
    "threads": 1,
}
_EOS = "<|endoftext|>"
_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def cache_dir() -> Path:
    """Where built models are kept: ``$COLOCATE_GRPO_CACHE`` or ``~/.cache/colocate_grpo``."""
    return Path(os.environ.get("COLOCATE_GRPO_CACHE", Path.home() / ".cache" / "colocate_grpo"))


def tiny_model_path() -> Path:
    """Build the tiny model once and return its directory (a normal HF model folder)."""
    key = hashlib.sha256(json.dumps(_RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / f"tiny-qwen2-{key}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=target.parent))
    try:
        _build(staging)
        try:
            staging.rename(target)
        except OSError:  # built concurrently by another process: theirs is as good as ours
            shutil.rmtree(staging)
    finally:
        if staging.exists() and staging != target:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # A vocabulary of single bytes: every digit is its own token, which makes sums learnable.
    bpe.train_from_iterator(
        ["0123456789+="],
        trainers.BpeTrainer(vocab_size=len(alphabet) + 1, special_tokens=[_EOS], initial_alphabet=alphabet),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=_EOS, pad_token=_EOS)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _build(path: Path) -> None:
    # One thread: the same floating-point summation order on every machine, so the same model.
    threads = torch.get_num_threads()
    torch.set_num_threads(_RECIPE["threads"])
    try:
        _build_with_current_threads(path)
    finally:
        torch.set_num_threads(threads)


def _build_with_current_threads(path: Path) -> None:
    torch.manual_seed(_RECIPE["seed"])
    rng = random.Random(_RECIPE["seed"])
    tokenizer = _build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=_RECIPE["hidden_size"],
        intermediate_size=_RECIPE["intermediate_size"],
        num_hidden_layers=_RECIPE["num_hidden_layers"],
        num_attention_heads=_RECIPE["num_attention_heads"],
        num_key_value_heads=_RECIPE["num_key_value_heads"],
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    _warm_up(model, tokenizer, rng)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _warm_up(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, rng: random.Random) -> None:
    """Supervised steps on ``a+b=<sum><eos>``, loss on the answer only, stopped well short of mastery."""
    problems = arithmetic_problems()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_RECIPE["warmup_lr"])
    model.train()
    for _ in range(_RECIPE["warmup_steps"]):
        batch = [rng.choice(problems) for _ in range(_RECIPE["warmup_batch"])]
        prompts = [tokenizer(arithmetic_prompt(a, b))["input_ids"] for a, b in batch]
        answers = [tokenizer(str(a + b))["input_ids"] + [tokenizer.eos_token_id] for a, b in batch]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            input_ids[row, : len(p) + len(a)] = torch.tensor(p + a)
            labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
