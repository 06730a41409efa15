"""The run's metrics file (``metrics.jsonl``): whole records only, and one record per step after a resume.

A record is one JSON object on one line. Each is appended with a single ``write`` of the whole line to a
file opened with ``O_APPEND``, so that a killed process leaves either the whole record or none of it; only
a full disk (or a crash of the machine) can leave part of one, which :func:`repair_metrics` cuts at the
next resume, as it drops the records of the steps that the resumed run does again.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (created with its parents) in one write, flushed to the OS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk, a signal): the rest, or the error that stopped it
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


@dataclass(frozen=True)
class MetricsRepair:
    """What :func:`repair_metrics` changed in a metrics file.

    Attributes:
        torn: lines that were not whole JSON records (a torn tail), cut.
        after_checkpoint: records of steps after the checkpoint, dropped (the resumed run logs them again).
        kept: records kept.
    """

    torn: int
    after_checkpoint: int
    kept: int

    def describe(self, path: Path, step: int) -> str | None:
        """One sentence on what was cut, or None when nothing was."""
        parts = []
        if self.torn:
            parts.append(f"cut {self.torn} torn line(s) (a record cut short when a run was stopped)")
        if self.after_checkpoint:
            parts.append(f"dropped {self.after_checkpoint} record(s) of steps after {step}, which this run logs again")
        return f"{path}: {' and '.join(parts)}." if parts else None


def repair_metrics(path: Path, last_step: int) -> MetricsRepair:
    """Keep the whole records of ``path`` up to step ``last_step`` (the checkpoint a run resumes from).

    The file is rewritten atomically (a temporary file, fsynced, renamed over it) only when something is cut.
    A missing file is left missing.
    """
    if not path.is_file():
        return MetricsRepair(0, 0, 0)
    kept, torn, later = [], 0, 0
    raw = path.read_bytes()
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            torn += 1
            continue
        if not isinstance(record, dict):
            torn += 1
        elif isinstance(record.get("step"), int) and record["step"] > last_step:
            later += 1
        else:
            kept.append(line)
    if torn or later or (raw and not raw.endswith(b"\n")):
        write_atomically(path, b"".join(line + b"\n" for line in kept))
    return MetricsRepair(torn, later, len(kept))


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step: a reader (or a kill) sees the old file or the new, never half."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp's file is the owner's alone
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make the directory's entries (a file renamed into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
