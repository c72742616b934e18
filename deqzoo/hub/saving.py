"""Saving that never loses a checkpoint or a user's file.

A save writes the new checkpoint into a temporary sibling folder, then swaps it in:

* The swap is one atomic ``renameat2(RENAME_EXCHANGE)`` of the two folders (Linux): at every instant the path
  holds the complete old or the complete new checkpoint. Where that call is missing, two renames are used,
  and a save or load of the path that finds the old folder parked beside a missing path puts it back.
* Only what the save writes is replaced: ``config.json``, the weights (``model.safetensors`` or the index and
  its shards) and any other file the writer produces. Every other file and folder of the old directory
  (optimizer state, logs, a card, another run's subfolders) is carried over as a hard link, so nothing is
  copied, and the old folder is taken apart file by file afterwards: links and replaced files are removed,
  anything that appeared in it during the save is moved back.
* A directory that cannot be swapped (the working directory or one of its parents, a mount point, a folder
  whose files cannot be hard-linked) is updated in place under a journal: each produced file is renamed in,
  and a save or load that finds the journal finishes the job first.
* Saves to one path are serialised by a lock (``flock`` on a file in the temp directory, keyed by the path);
  a save that cannot get it within ``lock_timeout`` seconds raises :class:`SaveInProgressError`.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import DeqzooError

try:
    import fcntl
except ImportError:  # Windows: threads of this process are still serialised
    fcntl = None

logger = logging.getLogger("deqzoo")

# The checkpoint's own weight files: a save writing new weights removes these when it did not produce them.
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
JOURNAL = ".deqzoo-save-journal.json"
PRODUCED = ".deqzoo-save-produced.json"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


class SaveInProgressError(DeqzooError, RuntimeError):
    """Another save to the same path holds its lock for longer than the caller agreed to wait."""


class _CannotLink(OSError):
    """An entry of the old directory cannot be carried over by a hard link (the swap is not used)."""


def _stage(name: str) -> None:
    """Called between the steps of a save. Tests replace it to kill the process at a chosen step."""


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.deqzoo-tmp-"


def _old_prefix(target: Path) -> str:
    return f".{target.name}.deqzoo-old-"


def _new_prefix(target: Path) -> str:
    return f".{target.name}.deqzoo-new-"


def _siblings(target: Path, prefix: str) -> list[Path]:
    pattern = os.path.join(glob.escape(str(target.parent)), glob.escape(prefix) + "*")
    found = [Path(p) for p in glob.glob(pattern)]
    return sorted((p for p in found if p.is_dir() and not p.is_symlink()), key=lambda p: p.stat().st_mtime_ns)


@contextmanager
def save_lock(target: Path, timeout: float = 600.0) -> Iterator[None]:
    """Hold the lock for saves to `target` (a resolved path); raise SaveInProgressError after `timeout` s."""
    key = str(target)
    with _THREAD_LOCKS_GUARD:
        thread_lock = _THREAD_LOCKS.setdefault(key, threading.Lock())
    if not thread_lock.acquire(timeout=timeout):
        raise SaveInProgressError(f"{target}: another save to this path (in this process) is still running "
                                  f"after {timeout:g} s; try again when it has finished")
    handle = None
    try:
        if fcntl is not None:
            lock_dir = Path(tempfile.gettempdir()) / f"deqzoo-save-locks-{getattr(os, 'getuid', lambda: 0)()}"
            lock_dir.mkdir(mode=0o700, exist_ok=True)
            handle = open(lock_dir / (hashlib.sha1(key.encode()).hexdigest() + ".lock"), "a+b")  # noqa: SIM115
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise SaveInProgressError(
                            f"{target}: another process is saving to this path (lock {handle.name} held for "
                            f"more than {timeout:g} s); try again when it has finished") from None
                    time.sleep(0.01)
        yield
    finally:
        if handle is not None:
            handle.close()  # closing releases the flock
        thread_lock.release()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    if os.environ.get("DEQZOO_SAVE_NO_EXCHANGE"):  # the two-rename path, for tests and odd filesystems
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _normal_permissions(root: Path) -> None:
    """mkdtemp (and some writers) create owner-only modes; a saved checkpoint gets the umask's usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _produced(tmp: Path) -> set[str]:
    return {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() or p.is_symlink()}


def _replaced_by_save(rel: str, produced: set[str]) -> bool:
    """An old file this save replaces: one it wrote again, or a stale weight file of the checkpoint."""
    return rel in produced or ("/" not in rel and WEIGHT_FILE.fullmatch(rel) is not None)


def _link_tree(src: Path, dst: Path, produced: set[str], rel: str = "") -> None:
    """Carry every entry of `src` the save does not replace into `dst` as a hard link (folders rebuilt)."""
    for entry in os.scandir(src):
        name = f"{rel}{entry.name}"
        out = dst / entry.name
        if _replaced_by_save(name, produced):
            continue
        if entry.is_symlink():
            if not out.exists() and not out.is_symlink():
                os.symlink(os.readlink(entry.path), out)
        elif entry.is_dir():
            if out.exists() and not out.is_dir():
                continue  # the save produced a file where the old folder was: that folder stays in the backup
            out.mkdir(exist_ok=True)
            shutil.copystat(entry.path, out, follow_symlinks=False)
            _link_tree(Path(entry.path), out, produced, f"{name}/")
        elif entry.is_file():
            if out.exists():
                continue
            try:
                os.link(entry.path, out)
            except OSError as err:
                raise _CannotLink(err.errno, f"cannot hard-link {entry.path}: {err.strerror}") from err
        else:
            raise _CannotLink(errno.EINVAL, f"{entry.path}: not a regular file, folder or link")


def _retire(old: Path, target: Path) -> None:
    """Take apart a swapped-out old directory: remove what the new one holds (links, replaced files) and
    move anything else back into the new one. Nothing the save did not replace is deleted."""
    manifest = target / PRODUCED
    produced: set[str] = set()
    if manifest.is_file():
        try:
            produced = set(json.loads(manifest.read_text()))
        except (OSError, ValueError, TypeError):
            produced = set()
    _stage("retire")
    leftovers = _retire_tree(old, target, produced, "")
    if leftovers:
        logger.warning("%s: kept %s beside the checkpoint (files that changed during the save: %s)",
                       target, old, ", ".join(leftovers[:5]))
    else:
        old.rmdir()
    manifest.unlink(missing_ok=True)


def _retire_tree(old: Path, new: Path, produced: set[str], rel: str) -> list[str]:
    leftovers: list[str] = []
    for entry in list(os.scandir(old)):
        name = f"{rel}{entry.name}"
        counterpart = new / entry.name
        if entry.is_dir(follow_symlinks=False):
            if counterpart.is_dir() and not counterpart.is_symlink():
                leftovers += _retire_tree(Path(entry.path), counterpart, produced, f"{name}/")
                if not any(os.scandir(entry.path)):
                    os.rmdir(entry.path)
                continue
            if not counterpart.exists() and not counterpart.is_symlink():
                os.rename(entry.path, counterpart)
            else:
                leftovers.append(name)
            continue
        same = counterpart.exists() and not entry.is_symlink() and os.path.samefile(entry.path, counterpart)
        if same or _replaced_by_save(name, produced) or (entry.is_symlink() and counterpart.is_symlink()):
            os.unlink(entry.path)
        elif not counterpart.exists() and not counterpart.is_symlink():
            os.rename(entry.path, counterpart)  # appeared in the old folder during the save: it stays
        else:
            leftovers.append(name)
    return leftovers


def _write_journal(target: Path, tmp: Path, produced: set[str]) -> None:
    data = json.dumps({"tmp": tmp.name, "files": sorted(produced)})
    fd, part = tempfile.mkstemp(prefix=".deqzoo-journal-", dir=target)
    with os.fdopen(fd, "w") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(part, target / JOURNAL)


def _roll_forward(target: Path) -> None:
    """Finish an in-place save from its journal: rename in every produced file still waiting, drop stale
    weights, remove the journal and the temporary folder."""
    journal = target / JOURNAL
    try:
        data = json.loads(journal.read_text())
        tmp_name, files = data["tmp"], [str(f) for f in data["files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise OSError(f"{journal}: unreadable save journal ({err}); check the folder, remove it") from err
    if "/" in tmp_name or not tmp_name.startswith(_tmp_prefix(target)):
        raise OSError(f"{journal}: names a temporary folder {tmp_name!r} that this save does not use")
    tmp = target.parent / tmp_name
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise OSError(f"{journal}: file name {rel!r} leaves the folder")
        src = tmp / rel
        if src.is_file() or src.is_symlink():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, target / rel)
            _stage("in-place-file")
    for entry in target.iterdir():
        if entry.is_file() and WEIGHT_FILE.fullmatch(entry.name) and entry.name not in files:
            entry.unlink()
    journal.unlink()
    shutil.rmtree(tmp, ignore_errors=True)


def _needs_recovery(target: Path) -> bool:
    """An in-place save's journal, or a missing path with a parked checkpoint beside it."""
    if target.is_dir():
        return (target / JOURNAL).is_file()
    return (not target.exists() and target.parent.is_dir()
            and bool(_siblings(target, _old_prefix(target)) or _siblings(target, _new_prefix(target))))


def recover(target: str | os.PathLike, *, lock_timeout: float = 600.0) -> None:
    """Finish or undo an interrupted save that left `target` without a complete checkpoint (loading a
    local path calls this; every save does a full clean-up of its path first).

    Example:
        >>> from deqzoo.hub.saving import recover
        >>> recover("no/such/checkpoint")  # nothing to do
    """
    target = Path(os.path.abspath(target))
    if not _needs_recovery(target):
        return
    with save_lock(target, lock_timeout):
        _recover_locked(target)


def _recover_locked(target: Path) -> None:
    olds = _siblings(target, _old_prefix(target))
    if olds and not target.exists() and not target.is_symlink():
        os.rename(olds.pop(), target)  # killed between the two renames: the old checkpoint comes back
        logger.warning("%s: an interrupted save was undone; the previous checkpoint is back", target)
    if target.is_dir() and (target / JOURNAL).is_file():
        _roll_forward(target)
        logger.warning("%s: an interrupted save was completed from its journal", target)
    for staged in _siblings(target, _new_prefix(target)):
        if (staged / PRODUCED).is_file():
            shutil.rmtree(staged, ignore_errors=True)  # never swapped in: new files and links only
        elif not target.exists():
            os.rename(staged, target)
        else:
            olds.append(staged)  # killed right after the exchange: it holds the old checkpoint
    for old in olds:
        _retire(old, target)
    for tmp in _siblings(target, _tmp_prefix(target)):  # a save killed while writing (we hold the lock)
        shutil.rmtree(tmp, ignore_errors=True)


def _in_place(target: Path) -> bool:
    """Directories that must keep their identity: the working directory and its parents, mount points."""
    cwd = Path.cwd().resolve()
    return target == cwd or target in cwd.parents or os.path.ismount(target)


def atomic_save(directory: str | os.PathLike, write: Callable[[Path], Any], *, keep_existing: bool = True,
                lock_timeout: float = 600.0) -> Path:
    """Run `write(tmp_dir)` in a temporary sibling directory, then put the result in place (module doc).

    A failure while writing leaves the previous checkpoint untouched and nothing behind. Files of an existing
    directory that `write` does not produce stay (a model card, a processor, optimizer state, subfolders);
    stale weight files of the checkpoint (``model*.safetensors``, its index) go. `keep_existing=False` is
    accepted for compatibility and means the same: a save never deletes files it does not replace.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
        >>> _ = atomic_save(d, lambda tmp: (tmp / "config.json").write_text("{}"))
        >>> sorted(p.name for p in d.iterdir())
        ['config.json']
    """
    del keep_existing
    target = Path(os.path.abspath(directory))
    if target.is_symlink() and target.resolve().is_dir():
        target = target.resolve()  # save into the folder the link points to; the link stays
    target.parent.mkdir(parents=True, exist_ok=True)
    with save_lock(target, lock_timeout):
        _recover_locked(target)
        if target.exists() and not target.is_dir():
            raise FileExistsError(f"{target}: exists and is not a directory; a checkpoint is a directory")
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(target), dir=target.parent))
        try:
            write(tmp)
            _normal_permissions(tmp)
            _stage("written")
            _swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists():
        try:
            os.rename(tmp, target)
            return
        except OSError as err:  # created meanwhile by someone who does not take our lock
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    produced = _produced(tmp)
    if not _in_place(target):
        try:
            _link_tree(target, tmp, produced)
        except _CannotLink as err:
            logger.info("%s: updating in place (%s)", target, err)
        else:
            tmp.chmod(stat.S_IMODE(target.stat().st_mode))
            (tmp / PRODUCED).write_text(json.dumps(sorted(produced)))
            staged = tmp.with_name(_new_prefix(target) + tmp.name[len(_tmp_prefix(target)):])
            os.rename(tmp, staged)  # complete and linked: recovery may delete it only while it has PRODUCED
            renamed = tmp.with_name(_old_prefix(target) + tmp.name[len(_tmp_prefix(target)):])
            _stage("linked")
            try:
                if _exchange(staged, target):
                    _stage("exchanged")  # `staged` now holds the old checkpoint
                    os.rename(staged, renamed)
                else:
                    os.rename(target, renamed)
                    _stage("between-renames")
                    try:
                        os.rename(staged, target)
                    except BaseException:
                        os.rename(renamed, target)
                        raise
            except BaseException:
                if (staged / PRODUCED).is_file():
                    shutil.rmtree(staged, ignore_errors=True)
                raise
            _stage("swapped")
            _retire(renamed, target)
            return
    _write_journal(target, tmp, produced)
    _stage("journal")
    _roll_forward(target)
