"""The export's directories: the target, the job's own partial directory, the lock, the publish.

docs/design.md#export-target-and-concurrent-jobs. One export job at a time writes a target: rank 0
takes ``.{name}.lock`` beside it (created with ``O_EXCL``; a heartbeat keeps its mtime fresh, so a
lock left by a dead job is recognised as stale and broken with a message). The checkpoint is
written into the job's own ``.{name}.partial-{export_id}`` and published only when complete and
verified: a rename that refuses to land on a path that appeared meanwhile, or with
``overwrite="replace"`` an atomic exchange (``renameat2(RENAME_EXCHANGE)``), so at every instant
either the old or the new checkpoint is at the target; the old one is then removed and reported.
Where the filesystem has no exchange, the old directory is moved aside first and restored by the
next export if a crash left the target empty. Everything here runs on rank 0 only, except
:meth:`ExportTarget.check`, which every rank runs.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.export.config_json import files_dtype, write_config_json
from nemo_moe_export.export.plan import ExportPlan
from nemo_moe_export.safetensors_format import INDEX_FILE, SUFFIX

__all__ = ["ExportTarget", "export_id_of", "fsync_path", "new_export_id", "write_metadata_files"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0  # how often the lock holder refreshes the lock's mtime
STALE_AFTER_S = 60.0  # a lock not refreshed for this long belongs to a dead job


_RANDOM_BITS = 31  # beside the UTC second: an export id is one int64 word, shared by a sum all-reduce


def new_export_id() -> int:
    """One export job's number, unique across hosts and time: the UTC second and 31 random bits.
    Rank 0 draws it, every rank uses it (:func:`export_id_of` names it)."""
    return (int(time.time()) << _RANDOM_BITS) | (uuid.uuid4().int & ((1 << _RANDOM_BITS) - 1))


def export_id_of(number: int) -> str:
    """The export id's name, as directories and headers carry it: ``20261202T071830-1f2e3d4c``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(number >> _RANDOM_BITS))
    return f"{stamp}-{number & ((1 << _RANDOM_BITS) - 1):08x}"


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ExportTarget:
    """The final directory ``path`` and this job's siblings: ``partial`` (being written),
    ``lock`` (held while writing) and ``aside`` (the replaced checkpoint where no exchange exists)."""

    path: str
    export_id: str = ""
    notes: list[str] = field(default_factory=list, compare=False)  # what was cleaned or replaced

    @staticmethod
    def at(output_dir: str | os.PathLike[str]) -> "ExportTarget":
        return ExportTarget(os.path.abspath(os.fspath(output_dir)))

    def for_job(self, export_id: str) -> "ExportTarget":
        return replace(self, export_id=export_id, notes=[])

    @property
    def parent(self) -> str:
        return os.path.dirname(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def partial(self) -> str:
        return os.path.join(self.parent, f".{self.name}.partial" + (f"-{self.export_id}" if self.export_id else ""))

    @property
    def lock(self) -> str:
        return os.path.join(self.parent, f".{self.name}.lock")

    @property
    def aside(self) -> str:
        return os.path.join(self.parent, f".{self.name}.old")

    def check(self, overwrite: str) -> None:
        """Refuse an existing target unless it may be replaced, and a parent that does not exist."""
        if os.path.lexists(self.aside) and not os.path.lexists(self.path) and overwrite == "error":
            raise InputError(
                "the previous checkpoint sits aside, left by an interrupted replace", key=self.path,
                expected="no checkpoint there", actual=f"it is at {self.aside}",
                hint='pass overwrite="replace" (it is restored first, then replaced) or move it back by hand')
        if os.path.lexists(self.path) and overwrite == "error":
            raise InputError("export target already exists", key=self.path, expected="no directory there",
                             actual="an existing path", hint='pass overwrite="replace" to swap it atomically')
        if not os.path.isdir(self.parent):
            raise InputError("parent of the export target does not exist", key=self.parent,
                             expected="an existing directory on a filesystem shared by all ranks",
                             actual="missing")

    # --- rank 0: before writing -----------------------------------------------------------------

    def prepare(self) -> None:
        """Take the lock, clean what dead jobs left, and create this job's empty partial directory."""
        self._take_lock()
        self._restore_aside()
        self._remove_stale_partials()
        os.mkdir(self.partial)  # fails if it exists: no two jobs ever share a partial directory

    def _take_lock(self) -> None:
        holder = {"export_id": self.export_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._break_stale_lock()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(holder, f)
            _Heartbeat.start(self.lock)
            return
        raise InputError("could not take the export lock", key=self.lock, expected="a free lock",
                         actual="taken again by another job")

    def _break_stale_lock(self) -> None:
        """Refuse while a live job holds the lock; remove a dead job's lock, saying so."""
        holder = _read_lock(self.lock)
        age = time.time() - _mtime(self.lock)
        same_host_dead = holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid"))
        if not same_host_dead and age < STALE_AFTER_S:
            raise InputError(
                "another export job is writing this target", key=self.path,
                expected="no other export in progress",
                actual=f"job {holder.get('export_id', '?')} (host {holder.get('host', '?')}, pid "
                       f"{holder.get('pid', '?')}) holds {self.lock}, refreshed {age:.0f} s ago",
                hint="wait for it to finish, or export to another output_dir; a lock not refreshed for "
                     f"{STALE_AFTER_S:.0f} s is taken over",
            )
        self._note(f"removed the stale lock of dead export job {holder.get('export_id', '?')} "
                   f"(host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, {age:.0f} s old)")
        _remove(self.lock)

    def _remove_stale_partials(self) -> None:
        """Partial directories of other jobs can only be dead jobs' leftovers: we hold the lock."""
        prefix = f".{self.name}.partial"
        for entry in sorted(os.listdir(self.parent)):
            path = os.path.join(self.parent, entry)
            if entry.startswith(prefix) and path != self.partial:
                size = _tree_bytes(path)
                shutil.rmtree(path, ignore_errors=True)
                self._note(f"removed {path}, the partial directory of a dead export job ({size / 1e6:.1f} MB)")

    def _restore_aside(self) -> None:
        """A crash between the two renames of a replace (filesystems without an exchange) left the
        old checkpoint aside and no target: put it back before anything else."""
        if os.path.lexists(self.aside) and not os.path.lexists(self.path):
            os.rename(self.aside, self.path)
            fsync_path(self.parent)
            self._note(f"restored {self.path} from {self.aside}, left by a replace that was interrupted")
        elif os.path.lexists(self.aside):
            _remove(self.aside)
            self._note(f"removed {self.aside}, an old checkpoint a finished replace had left behind")

    # --- rank 0: after writing ------------------------------------------------------------------

    def seal(self) -> None:
        """Make the partial directory's entries durable before it is renamed."""
        fsync_path(self.partial)

    def publish(self, overwrite: str) -> None:
        """Move the partial directory into place; with ``replace``, exchange it with the old target."""
        if not os.path.lexists(self.path):
            _rename_no_replace(self.partial, self.path)
        elif overwrite != "replace":
            raise InputError("export target appeared while exporting", key=self.path,
                             expected="no directory there", actual="an existing path (another job's?)",
                             hint='pass overwrite="replace" to replace it')
        elif _exchange(self.partial, self.path):
            fsync_path(self.parent)
            self._note(f"replaced the previous checkpoint at {self.path} ({_tree_bytes(self.partial) / 1e6:.1f} MB)")
            _remove(self.partial)  # now the old checkpoint
        else:
            self._publish_by_moving_aside()
        fsync_path(self.parent)
        self.release()

    def _publish_by_moving_aside(self) -> None:
        _remove(self.aside)
        os.rename(self.path, self.aside)
        fsync_path(self.parent)
        os.rename(self.partial, self.path)
        fsync_path(self.parent)
        self._note(f"replaced the previous checkpoint at {self.path}")
        _remove(self.aside)

    def release(self) -> None:
        """Give the lock back (only this job's own lock)."""
        _Heartbeat.stop(self.lock)
        if _read_lock(self.lock).get("export_id") == self.export_id:
            _remove(self.lock)

    def discard(self) -> None:
        """Remove the partial directory after a failure; the target was never touched."""
        shutil.rmtree(self.partial, ignore_errors=True)
        self.release()

    def _note(self, text: str) -> None:
        logger.warning("export %s: %s", self.export_id, text)
        self.notes.append(text)


class _Heartbeat:
    """Refreshes a held lock's mtime from a daemon thread, so other jobs can tell it is alive."""

    _running: dict[str, threading.Event] = {}

    @classmethod
    def start(cls, path: str) -> None:
        stop = cls._running[path] = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    os.utime(path)
                except OSError:
                    return

        threading.Thread(target=beat, name="nme-export-lock", daemon=True).start()

    @classmethod
    def stop(cls, path: str) -> None:
        event = cls._running.pop(path, None)
        if event is not None:
            event.set()


_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2``; False where the system or filesystem does not support it."""
    fn = getattr(_LIBC, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _rename_no_replace(src: str, dst: str) -> None:
    """A rename that fails if ``dst`` appeared meanwhile (a plain rename would land on an empty
    directory another job just created)."""
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError as exc:
        raise InputError("export target appeared while exporting", key=dst, expected="no directory there",
                         actual="an existing path (another job's?)") from exc
    os.rename(src, dst)


def _exchange(a: str, b: str) -> bool:
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _read_lock(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    """Remove a file, link or tree; gone already is fine (survivors may clean up together)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _tree_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def write_metadata_files(directory: str, plan: ExportPlan, config: Any, dtype: torch.dtype | None,
                         generation_config: Any = None, tokenizer: Any = None,
                         quantization: dict[str, Any] | None = None) -> None:
    """The index, ``config.json`` (``config_json.py``: with the dtype ``plan``'s files hold, and
    ``quantization`` as its ``quantization_config``), the generation config and the tokenizer
    files, each fsynced. ``dtype``, the export's, is what the files hold where ``plan`` holds no
    floating tensor."""
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        f.write(plan.index_json())
        f.flush()
        os.fsync(f.fileno())
    written = files_dtype((t.dtype, math.prod(t.shape)) for t in plan.tensors.values())
    write_config_json(directory, config, written or dtype, quantization)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.endswith(SUFFIX) and os.path.isfile(path):
            fsync_path(path)
