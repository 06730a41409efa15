"""The output folder: one run at a time, a fresh run never mixed with an earlier one, checked before loading.

:func:`check_output_dir` runs before the model loads. It checks that ``output_dir`` is (or can be made) a
writable folder, takes the folder's lock (``run.lock``, held until the run ends, naming its holder: a second
run is refused; a lock left by a killed run is taken over with a warning), refuses a fresh run into a folder
that holds an earlier run's checkpoints or metrics (``latest`` could otherwise continue from the other run),
and picks and checks the checkpoint a resumed run continues from (:mod:`colocate_grpo.checkpoints`).
:meth:`OutputDir.begin`, as the trainer's ``train()`` starts (the lock taken there if the check did not take
it), clears the earlier run (``overwrite_output_dir``) or repairs the metrics file for the resume
(:mod:`colocate_grpo.metrics_file`); a fresh run finding an earlier one there (a second ``train()`` into the folder)
is refused then too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from colocate_grpo.checkpoints import PREFIX, ResumePoint, checkpoint_folders, newest_sealed, resume_point
from colocate_grpo.config import Config, ConfigError
from colocate_grpo.metrics_file import repair_metrics

logger = logging.getLogger(__name__)

LOCK = "run.lock"
METRICS = "metrics.jsonl"
# Locks this process holds, by folder: a run in this process that ended without releasing its lock (an
# exception while the model loaded, in a notebook) leaves it here, and the next run takes it over.
_held: dict[Path, int] = {}


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _check_writable_folder(path: Path) -> None:
    """Refuse an output_dir that is a file, lies under a file, or cannot be written, before anything loads.

    Writes nothing that stays: a probe file (or folder, when output_dir does not exist yet) is made and removed.
    """
    key = f"'output_dir: {path}'"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} is a file, not a folder. Give a folder's path (it is created if missing).")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key} cannot be created: {existing} is a file. Give a path under a folder.")
    try:
        if existing == path:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".colocate_grpo-probe-", dir=existing))
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise ConfigError(
            f"{key} cannot be written: creating a file in {existing} failed ({reason}). Give a folder you can "
            "write to, or fix its permissions."
        ) from None


def _holder(lock_path: Path) -> dict:
    try:
        holder = json.loads(lock_path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe_holder(holder: dict) -> str:
    if not holder:
        return "a process whose lock file is unreadable"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')} "
        f"({holder.get('command', '?')})"
    )


def _try_lock(lock_path: Path) -> int | None:
    """An open descriptor of ``lock_path`` holding its exclusive lock, or None while another holds it."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        # The holder removes the file as it lets go: a lock on a removed file is no lock. Open it again.
        try:
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _refuse_held(path: Path, lock_path: Path) -> ConfigError:
    return ConfigError(
        f"'output_dir: {path}' is in use by another run: {_describe_holder(_holder(lock_path))}. Two runs in one "
        "folder would mix their metrics and overwrite each other's checkpoints. Wait for it to end (or stop it), "
        "or give this run another output_dir."
    )


class OutputDir:
    """A run's output folder, checked; holds its lock (on the main process) from the check to :meth:`release`.

    Attributes:
        path: the folder. resume: the checkpoint the run continues from, or None for a fresh run.
    """

    def __init__(self, config: Config, resume: ResumePoint | None) -> None:
        self.path = Path(config.output_dir)
        self.resume = resume
        self.overwrite = config.overwrite_output_dir
        self._fd: int | None = None
        self._created: list[Path] = []  # folders made for the lock, removed again if the run leaves them empty

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint folder to hand to ``trainer.train(resume_from_checkpoint=...)``."""
        return None if self.resume is None else str(self.resume.folder)

    def claim(self) -> bool:
        """Take the folder's lock unless this object holds it (main process only): True if this call took it."""
        if self._fd is not None or not _is_main_process():
            return False
        self.lock()
        return True

    def lock(self) -> None:
        """Take the folder's lock, or refuse: held by a live run. A lock left by a dead run is taken over, warned."""
        path = self.path.resolve()
        missing = []
        parent = path
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        path.mkdir(parents=True, exist_ok=True)
        self._created = missing
        lock_path = path / LOCK
        previous = _held.pop(path, None)
        if previous is not None:  # an earlier run of this process that ended without letting go
            os.close(previous)
        fd = _try_lock(lock_path)
        if fd is None:
            self._remove_created()
            raise _refuse_held(self.path, lock_path)
        holder = _holder(lock_path)
        if holder and holder.get("pid") != os.getpid():
            logger.warning(
                "Took over the lock of %s from %s, which no longer runs: that run was stopped without ending. Its "
                "complete checkpoints are kept; incomplete ones are never resumed from.",
                self.path,
                _describe_holder(holder),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python",
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _held[path] = fd

    def begin(self, metrics_path: Path) -> None:
        """Make the folder ready to train into, as training starts (main process only).

        A fresh run with ``overwrite_output_dir`` deletes the earlier run's checkpoints and metrics; a resumed run
        cuts its metrics file's torn lines and the records of the steps after its checkpoint, and says so.

        Raises:
            ConfigError: a fresh run without ``overwrite_output_dir`` finds an earlier run in the folder (one
                trained there since the check: a second ``train()`` of the trainer, say).
        """
        if self.resume is None:
            self.refuse_earlier_run()
            if self.overwrite:
                for folder in checkpoint_folders(self.path):
                    shutil.rmtree(folder)
            metrics_path.unlink(missing_ok=True)
            return
        repair = repair_metrics(metrics_path, self.resume.step)
        message = repair.describe(metrics_path, self.resume.step)
        if message:
            logger.warning("%s", message)

    def refuse_earlier_run(self) -> None:
        """Refuse a fresh run without ``overwrite_output_dir`` into the folder while it holds an earlier run: its
        checkpoint folders or a non-empty metrics file (``latest`` could otherwise continue from the other run).

        Raises:
            ConfigError: with the choices: resume it, another output_dir, or ``overwrite_output_dir: true``.
        """
        earlier = [] if self.overwrite else _earlier_run(self.path)
        if not earlier:
            return
        sealed = newest_sealed(self.path)
        resume = (
            f"resume it with 'resume_from_checkpoint: latest' (its newest complete checkpoint is {sealed.name}), "
            if sealed is not None
            else ""
        )
        raise ConfigError(
            f"'output_dir: {self.path}' holds an earlier run ({', '.join(earlier)}), and this run starts afresh: it "
            "would overwrite that run's metrics and keep its checkpoints beside its own, so that 'latest' could "
            f"later continue the other run. Either {resume}give this run another output_dir, or set "
            f"'overwrite_output_dir: true' to delete the earlier run's {PREFIX}N folders and {METRICS} first."
        )

    def release(self) -> None:
        """Let go of the folder's lock (removing the lock file). Safe to call twice, and where none is held."""
        if self._fd is None:
            return
        path = self.path.resolve()
        with contextlib.suppress(FileNotFoundError):
            (path / LOCK).unlink()
        os.close(self._fd)
        _held.pop(path, None)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Remove the folders made only for the lock, if nothing else was written into them."""
        for folder in self._created:
            with contextlib.suppress(OSError):  # not empty: the run wrote there
                folder.rmdir()
        self._created = []


def _earlier_run(path: Path) -> list[str]:
    """What in ``path`` belongs to an earlier run: its checkpoint folders and a non-empty metrics file."""
    found = [folder.name for folder in reversed(checkpoint_folders(path))]
    metrics = path / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS)
    return found


def check_output_dir(config: Config, claim: bool = True) -> OutputDir:
    """Check ``config``'s output folder before the model loads and, with ``claim``, take its lock.

    Prints the checkpoint a resumed run continues from, and any newer one it skips with why.

    Raises:
        ConfigError: the folder is a file or cannot be written; another run holds it; a fresh run would mix with
            the earlier run it holds (the message lists the choices); the checkpoint to resume from is missing,
            incomplete, damaged or written with other settings.
    """
    path = Path(config.output_dir)
    _check_writable_folder(path)
    if config.overwrite_output_dir and config.resume_from_checkpoint is not None:
        raise ConfigError(
            "Set either 'overwrite_output_dir: true' (start afresh, deleting the earlier run's checkpoints) or "
            "'resume_from_checkpoint' (continue it), not both."
        )
    folder = OutputDir(config, None)
    main = _is_main_process()
    if claim and main:
        folder.lock()
    elif not claim and (path / LOCK).is_file():  # only look: a held lock refuses this run as it would its start
        fd = _try_lock(path / LOCK)
        if fd is None:
            raise _refuse_held(path, path / LOCK)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    try:
        folder.resume = resume_point(config)  # None for a fresh run
        if folder.resume is None:
            folder.refuse_earlier_run()
    except BaseException:
        folder.release()
        raise
    if folder.resume is not None and main:
        print(folder.resume.describe())
    return folder
