"""Saving that never loses a checkpoint or a user's file. The checkpoint is written whole into a temporary
sibling (listed in a manifest), then put in place: a new path by one ``rename``; an existing folder by
hard-linking the entries the save does not replace into the sibling and swapping the two with one
``renameat2(RENAME_EXCHANGE)``, so the path always holds the complete old or new checkpoint with the user's
files (the swapped-out folder is then taken apart). Where no swap is possible (the working directory, a mount
point, no exchange call, no hard links), the files are renamed in under a journal that the next load or save
finishes. Only the save's files and stale weight files are replaced; saves to one path hold a file lock.
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
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..errors import DeqzooError

logger = logging.getLogger("deqzoo")
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
JOURNAL = ".deqzoo-save-journal.json"
PRODUCED = ".deqzoo-save-produced.json"


class SaveInProgressError(DeqzooError, RuntimeError):
    """Another save to the same path holds its lock for longer than the caller agreed to wait."""


def _stage(name: str) -> None:
    """Called between the steps of a save. Tests replace it to kill the process at a chosen step."""


def _prefix(target: Path) -> str:
    return f".{target.name}.deqzoo-tmp-"


@contextmanager
def save_lock(target: Path, timeout: float = 600.0) -> Iterator[None]:
    """Hold the lock for saves to `target` (threads and processes); SaveInProgressError after `timeout` s.
    The lock file lives in the temp directory, not beside the user's folder."""
    folder = Path(tempfile.gettempdir()) / f"deqzoo-save-locks-{getattr(os, 'getuid', lambda: 0)()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    lock = FileLock(folder / (hashlib.sha1(str(target).encode()).hexdigest() + ".lock"), timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise SaveInProgressError(f"{target}: another save to this path (another process or thread, lock "
                                  f"{lock.lock_file}) is still running after {timeout:g} s; try again when "
                                  "it has finished") from None
    try:
        yield
    finally:
        lock.release()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _replaced(rel: str, produced: set[str]) -> bool:
    """An old file this save replaces: one it wrote again, or a stale weight file of the checkpoint."""
    return rel in produced or ("/" not in rel and WEIGHT_FILE.fullmatch(rel) is not None)


def _real_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _link_tree(target: Path, tmp: Path, produced: set[str]) -> bool:
    """Carry every entry of `target` the save does not replace into `tmp` as a hard link (folders rebuilt,
    links copied as links, the folder's mode kept); False when one cannot be (then it is updated in place).
    Where the save produced an entry of the same name, the old one stays in the swapped-out copy."""

    def not_carried(folder: str, names: list[str]) -> set[str]:
        rel = Path(folder).relative_to(target)
        return {name for name in names if _replaced((rel / name).as_posix(), produced) or (
            os.path.lexists(tmp / rel / name) and not (_real_dir(tmp / rel / name)
                                                       and _real_dir(os.path.join(folder, name))))}

    try:
        shutil.copytree(target, tmp, symlinks=True, ignore=not_carried, copy_function=os.link,
                        dirs_exist_ok=True)
    except shutil.Error as err:
        logger.info("%s: updating in place (cannot hard-link: %s)", target, err.args[0][0])
        return False
    return True


def _retire(old: Path, new: Path, produced: set[str], rel: str = "") -> list[str]:
    """Take apart a swapped-out folder: what the new one holds (same file) or what the save replaced goes,
    anything else is moved back, or kept and returned when the new folder has another file of that name."""
    kept: list[str] = []
    for entry in list(os.scandir(old)):
        name, counterpart = f"{rel}{entry.name}", new / entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        if is_dir and _real_dir(counterpart):
            kept += _retire(Path(entry.path), counterpart, produced, f"{name}/")
        elif not is_dir and _replaced(name, produced):
            os.unlink(entry.path)
        elif not counterpart.exists() and not counterpart.is_symlink():
            os.rename(entry.path, counterpart)  # appeared in the old folder during the save: it stays
        elif entry.is_symlink() and counterpart.is_symlink() or (
                not is_dir and os.path.samefile(entry.path, counterpart)):
            os.unlink(entry.path)
        else:
            kept.append(name)
        _stage("retiring")
    if not kept:
        os.rmdir(old)
    return kept


def write_whole(path: Path, content: str | bytes) -> None:
    """Write one file whole or not at all (a kill leaves the previous content and a `<name>.part`); text is
    written as UTF-8, bytes as they are."""
    part = path.with_name(path.name + ".part")
    if isinstance(content, bytes):
        part.write_bytes(content)
    else:
        part.write_text(content, encoding="utf-8")
    os.replace(part, path)


def _manifest(folder: Path) -> set[str] | None:
    try:
        return set(json.loads((folder / PRODUCED).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return set()


def _roll_forward(target: Path) -> None:
    """Finish an in-place save from its journal: rename in every produced file still waiting in the sibling
    the journal names, drop stale weights, remove the journal and the sibling."""
    journal = target / JOURNAL
    try:
        tmp_name = json.loads(journal.read_text())["tmp"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise OSError(f"{journal}: unreadable save journal ({err}); check the folder, remove it") from err
    if not isinstance(tmp_name, str) or "/" in tmp_name or not tmp_name.startswith(_prefix(target)):
        raise OSError(f"{journal}: names a temporary folder {tmp_name!r} that this save does not use")
    tmp = target.parent / tmp_name
    files = _manifest(tmp)
    if files is None:
        raise OSError(f"{journal}: the folder {tmp} it names is gone; check the checkpoint, remove the "
                      "journal")
    for rel in sorted(files):
        if (tmp / rel).is_file() or (tmp / rel).is_symlink():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / rel, target / rel)
            _stage("in-place-file")
    for entry in target.iterdir() if any(WEIGHT_FILE.fullmatch(f) for f in files) else ():
        if entry.is_file() and WEIGHT_FILE.fullmatch(entry.name) and entry.name not in files:
            entry.unlink()  # the new weights are in: the old checkpoint's other shards go
    journal.unlink()
    shutil.rmtree(tmp, ignore_errors=True)


def recover(target: str | os.PathLike, *, lock_timeout: float = 600.0) -> None:
    """Finish an in-place save that was interrupted (loading a local path calls this).

    Example:
        >>> from deqzoo.hub.saving import recover
        >>> recover("no/such/checkpoint")  # nothing to do
    """
    target = Path(os.path.abspath(target))
    if (target / JOURNAL).is_file():
        with save_lock(target, lock_timeout):
            _recover_locked(target)


def _recover_locked(target: Path) -> None:
    if (target / JOURNAL).is_file():
        _roll_forward(target)
        logger.warning("%s: an interrupted save was completed from its journal", target)
    pattern = os.path.join(glob.escape(str(target.parent)), glob.escape(_prefix(target)) + "*")
    for sibling in map(Path, glob.glob(pattern)):
        if not sibling.is_dir() or sibling.is_symlink():
            continue  # not ours
        # never swapped in: new files and links only (a kill inside the first manifest write leaves only its
        # .part, before `write` ran)
        if _manifest(sibling) is not None or {e.name for e in os.scandir(sibling)} == {PRODUCED + ".part"}:
            shutil.rmtree(sibling, ignore_errors=True)
        elif not target.exists() and not target.is_symlink():
            os.rename(sibling, target)
        elif target.is_dir() and _retire(sibling, target, _manifest(target) or set()):  # swapped out
            logger.warning("%s: kept %s beside the checkpoint (files that changed during the save)", target,
                           sibling)
    # killed after the last step, or before the journal or a manifest was in
    for stale in (PRODUCED, PRODUCED + ".part", JOURNAL + ".part") if target.is_dir() else ():
        (target / stale).unlink(missing_ok=True)


def _in_place(target: Path) -> bool:
    """Folders that must keep their identity: the working directory and its parents, mount points."""
    cwd = Path.cwd().resolve()
    return target == cwd or target in cwd.parents or os.path.ismount(target) or bool(
        os.environ.get("DEQZOO_SAVE_NO_EXCHANGE"))  # the in-place path, for tests and odd filesystems


def atomic_save(directory: str | os.PathLike, write: Callable[[Path], Any], *, lock_timeout: float = 600.0
                ) -> Path:
    """Run `write(tmp_dir)` in a temporary sibling directory, then put the result in place (module doc).

    A failure while writing leaves the previous checkpoint untouched and nothing behind. Files of an existing
    directory that `write` does not produce stay; stale weight files of the checkpoint go.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
        >>> _ = atomic_save(d, lambda tmp: (tmp / "config.json").write_text("{}"))
        >>> sorted(p.name for p in d.iterdir())
        ['config.json']
    """
    target = Path(os.path.abspath(directory))
    if target.is_symlink() and target.resolve().is_dir():
        target = target.resolve()  # save into the folder the link points to; the link stays
    target.parent.mkdir(parents=True, exist_ok=True)
    with save_lock(target, lock_timeout):
        _recover_locked(target)
        if target.exists() and not target.is_dir():
            raise FileExistsError(f"{target}: exists and is not a directory; a checkpoint is a directory")
        tmp = Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))
        try:
            write_whole(tmp / PRODUCED, "[]")  # from now on the sibling reads as "never swapped in"
            write(tmp)
            produced = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*")
                        if (p.is_file() or p.is_symlink()) and p.name != PRODUCED}
            write_whole(tmp / PRODUCED, json.dumps(sorted(produced)))
            _refuse_folders_in_the_way(target, produced)
            umask = os.umask(0)
            os.umask(umask)  # mkdtemp (and transformers' writer) make owner-only entries: the usual modes
            for path in [*tmp.rglob("*"), tmp]:  # before any user file is linked in (the folder then takes
                if not path.is_symlink():  # the mode of the one it replaces, `_link_tree`)
                    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
            _stage("written")
            _swap_in(tmp, target, produced)
        except BaseException:
            if _manifest(tmp) is not None and not (target / JOURNAL).is_file():  # not swapped in
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _refuse_folders_in_the_way(target: Path, produced: set[str]) -> None:
    """A folder of the user's where this save writes or replaces a file (a directory named model.safetensors):
    refused before anything of the user's moves; a save replaces files only."""
    if not target.is_dir():
        return
    stale = [e.name for e in os.scandir(target) if WEIGHT_FILE.fullmatch(e.name)]
    for rel in sorted({*produced, *stale}):
        path = target / rel
        if _real_dir(path) or any(p.exists() and not p.is_dir() for p in path.parents if target in p.parents):
            what = "directory" if _real_dir(path) else "file on its path"
            raise FileExistsError(
                f"{path}: this save writes the file {rel} but the folder holds a {what} of that name; a save "
                "never replaces anything but files of the checkpoint: move or rename it, or save elsewhere")


def _swap_in(tmp: Path, target: Path, produced: set[str]) -> None:
    if not target.exists():
        try:
            os.rename(tmp, target)
            (target / PRODUCED).unlink()
            return
        except OSError as err:  # created meanwhile by someone who does not take our lock
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    if not _in_place(target) and _link_tree(target, tmp, produced):
        _stage("linked")
        if _exchange(tmp, target):  # `tmp` now holds the old checkpoint
            _stage("exchanged")
            kept = _retire(tmp, target, produced)
            if kept:
                logger.warning("%s: kept %s beside the checkpoint (files that changed during the save: %s)",
                               target, tmp, ", ".join(kept[:5]))
            (target / PRODUCED).unlink()
            return
    write_whole(target / JOURNAL, json.dumps({"tmp": tmp.name}))
    _stage("journal")
    _roll_forward(target)
