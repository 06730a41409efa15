"""Checkpoints that are complete or plainly not: sealed with a manifest, checked before a run resumes from one.

transformers writes a ``checkpoint-N`` folder file by file (adapter, optimizer, scheduler, RNG state,
trainer state). Once it has finished, :func:`save_checkpoint` fsyncs every file and writes
``manifest.json`` last (to a temporary name, fsynced, renamed into place): the name, size in bytes and
SHA-256 of each file, the step, and the run settings that a resume must match. A folder without the
manifest is incomplete (the run was stopped while writing it) and is never resumed from; a file whose
size or checksum differs from the manifest's is damaged. As Orbax and torch.distributed.checkpoint do,
the marker that says "complete" is the last thing written, in one atomic step.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_grpo.config import Config, ConfigError
from colocate_grpo.metrics_file import fsync_directory, write_atomically

MANIFEST = "manifest.json"
PREFIX = "checkpoint-"
# The settings a resumed run must share with its checkpoint, by config key (the adapter's shapes and meaning).
_LORA_KEYS = ("lora_r", "lora_alpha", "lora_target_linear", "lora_target_modules")
_SERVING_KEYS = "lora_merge_aware, trl.vllm_lora_sync, load_in_4bit, async_generation"


def checkpoint_step(folder: Path) -> int | None:
    """N of a ``checkpoint-N`` folder's name; None for another name."""
    number = folder.name.removeprefix(PREFIX)
    return int(number) if folder.name.startswith(PREFIX) and number.isdigit() else None


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (largest N) first."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step, reverse=True)


def serving_mode(config: Config) -> str:
    """How ``config`` serves the policy (the run plan's :class:`~colocate_grpo.plan.Serving`, in words): a resume
    must serve it as its checkpoint's run did. Read before the plan is made, with the function the plan uses."""
    from colocate_grpo import models  # imports torch and datasets: only once needed
    from colocate_grpo.plan import serving_of

    return serving_of(config, models.training_dtype(models.resolve_device(config))).value


def run_settings(config: Config, serving: str) -> dict[str, Any]:
    """What a checkpoint records of its run's config and how the run served the policy (``serving``), to be matched
    by a run that resumes from it."""
    settings: dict[str, Any] = {"base_model": config.base_model, "adapter": config.adapter}
    if config.adapter == "lora":
        settings.update({key: getattr(config, key) for key in _LORA_KEYS})
    settings["serving"] = serving
    return settings


def _sha256(path: Path, fsync: bool = False) -> str:
    """The file's SHA-256; with ``fsync``, made durable through the same open file (one read of it, not two)."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if fsync:
            os.fsync(f.fileno())
    return digest


def seal_checkpoint(folder: Path, step: int, settings: dict[str, Any] | None = None) -> None:
    """Write ``folder``'s manifest, after making every file in it durable: from then on it is complete."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    recorded = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p, fsync=True)} for p in files
    }
    for directory in {p.parent for p in files}:
        fsync_directory(directory)
    manifest = {"step": step, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "files": recorded, "settings": settings}
    write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_directory(folder.parent)


def save_checkpoint(trainer: Any, trial: Any, save: Callable[[], None]) -> None:
    """The trainer's ``_save_checkpoint``: ``save`` (transformers' own), then the manifest, then old ones rotated.

    A folder being written again (a resumed run passing the step of a checkpoint it did not resume from) loses
    its manifest first, so that it reads as incomplete until the new one is sealed. transformers' rotation
    (``save_total_limit``) waits until the new checkpoint is sealed: a kill in between never leaves fewer
    complete checkpoints than the limit.
    """
    from transformers.trainer_utils import rotate_checkpoints

    args = trainer.args
    run_dir = Path(trainer._get_output_dir(trial=trial))
    folder = run_dir / f"{PREFIX}{trainer.state.global_step}"
    if args.should_save and (folder / MANIFEST).exists():
        (folder / MANIFEST).unlink()
        fsync_directory(folder)
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        save()
    finally:
        args.save_total_limit = limit
    if not args.should_save:
        return
    config = getattr(trainer, "run_config", None)
    # The config's serving, as a resume reads it: a 4-bit base is "4-bit base + adapter" whether the plan kept its
    # codes or its NF4 values in bf16 (the same model either way).
    settings = run_settings(config, serving_mode(config)) if config is not None else None
    seal_checkpoint(folder, trainer.state.global_step, settings)
    if limit:
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )


def checkpoint_damage(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, in words; None when it is complete and every file is as written.

    Reads every file once (its SHA-256 against the manifest's).
    """
    if not folder.is_dir():
        return "it is not a folder"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return (
            f"it is incomplete: it has no {MANIFEST}, which is written last, so its writing never finished (the run "
            "was stopped while saving it, or it was written before colocate_grpo sealed its checkpoints)"
        )
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"its {MANIFEST} is unreadable"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            how = "truncated" if size < expected["bytes"] else "longer than written"
            return f"{name} is damaged: it has {size} bytes, {expected['bytes']} when written ({how})"
        if _sha256(path) != expected["sha256"]:
            return f"{name} is damaged: its contents differ from what was written (SHA-256 mismatch)"
    return None


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from.

    Attributes:
        folder: the ``checkpoint-N`` folder; step: N.
        skipped: newer checkpoint folders passed over, each with why (for ``latest``).
    """

    folder: Path
    step: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def describe(self) -> str:
        """What the run resumes from and why, in a sentence or two."""
        line = f"Resuming from {self.folder} (step {self.step})."
        for folder, why in self.skipped:
            line += f" Skipped {folder.name}: {why}."
        return line


def newest_complete(output_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``output_dir`` (None if none is), and the newer ones passed over, with why."""
    skipped = []
    for folder in checkpoint_folders(output_dir):
        damage = checkpoint_damage(folder)
        if damage is None:
            return folder, skipped
        skipped.append((folder, damage))
    return None, skipped


def newest_sealed(output_dir: Path) -> Path | None:
    """The newest checkpoint folder with a manifest (its files not read): cheap, for messages."""
    return next((f for f in checkpoint_folders(output_dir) if (f / MANIFEST).is_file()), None)


def resume_point(config: Config) -> ResumePoint | None:
    """The checkpoint ``resume_from_checkpoint`` names (``latest``: the newest complete one), checked complete
    and compatible with ``config``; None when the run starts afresh.

    Raises:
        ConfigError: when it names no checkpoint, an incomplete or damaged one (with the one to use instead),
            or one whose adapter or serving differs from ``config``'s.
    """
    wanted = config.resume_from_checkpoint
    if wanted is None:
        return None
    output_dir = Path(config.output_dir)
    if wanted == "latest":
        folder, skipped = newest_complete(output_dir)
        if folder is None and not skipped:
            raise ConfigError(
                f"'resume_from_checkpoint: latest' but {config.output_dir} has no checkpoint-N folder. Set save_steps "
                "to write checkpoints, or remove resume_from_checkpoint to start afresh."
            )
        if folder is None:
            reasons = "; ".join(f"{f.name}: {why}" for f, why in skipped)
            raise ConfigError(
                f"'resume_from_checkpoint: latest' but no checkpoint in {config.output_dir} is complete ({reasons}). "
                "Start afresh: remove resume_from_checkpoint and set 'overwrite_output_dir: true' (or give another "
                "output_dir)."
            )
        point = ResumePoint(folder, checkpoint_step(folder), skipped)
    else:
        folder = Path(wanted)
        if not (folder / "trainer_state.json").is_file() and not (folder / MANIFEST).is_file():
            raise ConfigError(
                f"'resume_from_checkpoint: {wanted}' is not a checkpoint folder (no trainer_state.json there). Give a "
                "checkpoint-N folder from an earlier run's output_dir, or 'latest'."
            )
        damage = checkpoint_damage(folder)
        if damage is not None:
            instead, _ = newest_complete(folder.parent)
            use = (
                f"Resume from {instead} instead (the newest complete checkpoint there), or 'latest'."
                if instead is not None
                else "No complete checkpoint is left beside it: start afresh (remove resume_from_checkpoint and set "
                "'overwrite_output_dir: true')."
            )
            raise ConfigError(f"'resume_from_checkpoint: {wanted}' cannot be resumed from: {damage}. {use}")
        step = checkpoint_step(folder)
        if step is None:
            step = int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
        point = ResumePoint(folder, step)
    check_compatible(point.folder, config)
    return point


def _recorded_settings(folder: Path) -> dict[str, Any]:
    """The run settings a checkpoint was written with: its manifest's, with rank and alpha from its adapter."""
    manifest = json.loads((folder / MANIFEST).read_text())
    settings = dict(manifest.get("settings") or {})
    adapter_config = folder / "adapter_config.json"
    if adapter_config.is_file():
        adapter = json.loads(adapter_config.read_text())
        settings.update(adapter="lora", lora_r=adapter.get("r"), lora_alpha=adapter.get("lora_alpha"))
        if "lora_target_linear" not in settings and isinstance(adapter.get("target_modules"), list):
            # No record of the config (a checkpoint of a trainer built without one): the modules' last names.
            settings["target module names"] = sorted({m.rsplit(".", 1)[-1] for m in adapter["target_modules"]})
    elif "adapter" not in settings and (folder / "trainer_state.json").is_file():
        settings["adapter"] = None
    return settings


def _same_model(ours: str, theirs: str) -> bool:
    if ours == theirs:
        return True
    return Path(ours).expanduser().exists() and Path(ours).expanduser().resolve() == Path(theirs).expanduser().resolve()


def check_compatible(folder: Path, config: Config) -> None:
    """Refuse a resume whose config differs from the checkpoint's run in what its weights and optimizer mean.

    Raises:
        ConfigError: naming every key that differs, with both values.
    """
    recorded = _recorded_settings(folder)
    ours = run_settings(config, serving_mode(config))
    if recorded.get("target module names") and config.lora_target_modules is not None:
        ours["target module names"] = sorted(config.lora_target_modules)
    differences = []
    for key, theirs in recorded.items():
        if key not in ours or ours[key] == theirs:
            continue
        if key == "base_model" and _same_model(ours[key], theirs):
            continue
        name = f"how the policy is served ({_SERVING_KEYS})" if key == "serving" else key
        differences.append(f"{name}: {ours[key]!r} in this config, {theirs!r} in the checkpoint")
    if differences:
        raise ConfigError(
            f"'resume_from_checkpoint: {config.resume_from_checkpoint}' ({folder}) was written by a run with other "
            f"settings, so its adapter and optimizer cannot continue here: {'; '.join(differences)}. Set these back "
            "to the checkpoint's values to resume it, or start afresh in another output_dir."
        )
