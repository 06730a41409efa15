"""What the tests of the training path share: the tiny job at a fixed batch, and LoRA gradients to compare."""

import torch

from colocate_grpo.config import Config, load_config
from colocate_grpo.train import default_config_path

MICRO_BATCH, ACCUMULATION = 8, 4


def tiny_config(tmp_path, trl=None, **overrides) -> Config:
    """The tiny default job, one optimizer step of ``ACCUMULATION`` micro-batches of ``MICRO_BATCH``."""
    raw = load_config(default_config_path()).to_dict()
    raw.update(
        {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 1,
            "micro_batch_size": MICRO_BATCH,
            "gradient_accumulation_steps": ACCUMULATION,
            **overrides,
        }
    )
    raw["trl"].update(trl or {})
    return load_config(raw)


def lora_gradients(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def optimizer_step_gradients(trainer, micro_batches):
    """The loss (summed over ``micro_batches``) and the LoRA gradients of one optimizer step of TRL's loss."""
    model = trainer.model
    model.zero_grad()
    loss = 0.0
    for micro_batch in micro_batches:
        micro_loss = trainer.compute_loss(model, micro_batch)
        micro_loss.backward()
        loss += micro_loss.item()
    return loss, lora_gradients(model)


def randomize_lora(model):
    """B = 0 (a fresh adapter) gives A no gradient; small random factors give both one."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def relative_error(ours, reference):
    return max(((ours[n].float() - g.float()).norm() / g.float().norm()).item() for n, g in reference.items())


def overall_relative_error(ours, reference):
    """|ours - reference| / |reference| over every gradient at once, where :func:`relative_error` takes the worst
    parameter's."""
    difference = sum(((ours[n].float() - g.float()) ** 2).sum() for n, g in reference.items()) ** 0.5
    return (difference / sum((g.float() ** 2).sum() for g in reference.values()) ** 0.5).item()
