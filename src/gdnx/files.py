"""Atomic file writes: a file is either its old self or complete, never half
written, whatever kills the process (a temporary file in the same directory,
then os.replace). And a directory lock that a killed process leaves free."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """write(tmp_path) fills a temporary file that then replaces path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a file written in place would not be
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def read_json_object(path: Path, advice: str = "") -> dict:
    """The JSON object in `path`; ValueError naming the file (and `advice`,
    appended after "; ") when it is not one."""
    tail = f"; {advice}" if advice else ""
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path}: not valid JSON{tail}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object{tail}")
    return data


class DirectoryBusy(ValueError):
    """Another live process holds the directory's lock."""


LOCK_FILE = ".lock"


@contextlib.contextmanager
def directory_lock(directory: Path, what: str) -> Iterator[int | None]:
    """Hold `directory`'s lock (an flock on directory/.lock holding the
    holder's pid) for the with block; yields the pid of a holder that ended
    without releasing it (killed: the kernel freed its flock, its pid stayed
    in the file), else None. DirectoryBusy, naming `what` (the config field
    the directory comes from), when a live process holds it."""
    path = Path(directory) / LOCK_FILE
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise DirectoryBusy(f"{what} {directory}: in use by another run (pid {holder}); wait for it to end "
                                f"or choose another {what}") from None
        f.seek(0)
        left = f.read().strip()
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield int(left) if left.isdigit() else None
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


# bytes read from each end of a file for its fingerprint
_SAMPLE = 1 << 20


def fingerprint(paths: list[Path]) -> str:
    """A short digest that changes when any of these files (or the files of
    these directories) changes: each file's name, size and first and last
    MiB. Cheap for checkpoints of many GB; a copy elsewhere keeps it."""
    digest = hashlib.sha256()
    for p in paths:
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            size = f.stat().st_size
            name = f.name if f == p else str(f.relative_to(p))
            digest.update(f"{name}\0{size}\0".encode())
            with f.open("rb") as fh:
                digest.update(fh.read(_SAMPLE))
                if size > _SAMPLE:
                    fh.seek(max(_SAMPLE, size - _SAMPLE))
                    digest.update(fh.read(_SAMPLE))
    return digest.hexdigest()[:32]
