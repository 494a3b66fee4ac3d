"""Writing files and folders whole or not at all, hashing them, and where the cache folder is
(:func:`cache_dir`).

Every file or folder specdecode writes (the model cache and its stamps, cost curves, heads
files, corpora, converted models) is written beside its destination under a temporary name
and renamed into place (``os.replace``, atomic on one file system): a failure or an
interruption leaves the old content or nothing, never half of it. What is renamed into
place gets the permissions an ordinary file or folder written in place would (the umask's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator


CACHE_ENV = "SPECDECODE_CACHE"


def cache_dir() -> Path:
    """The folder of specdecode's cache (models, measured cost curves, probes):
    $SPECDECODE_CACHE, else the user's cache directory (``<user cache>/specdecode/models``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdecode")) / "models"


def read_cache_json(path: str | Path) -> dict | None:
    """A cache file's JSON object (a measured curve, a probe's result), or None where it holds
    none: missing, unreadable, a folder, not UTF-8 JSON, nested beyond the parser's depth, or
    JSON but not an object. The caller measures again and replaces it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def write_cache_json(path: str | Path, data: dict) -> None:
    """Keep ``data`` in a cache file, whole or not at all (:func:`write_text_atomic`). Where it
    cannot be written (a read-only or full disk, a file where the folder should be), says so
    on stderr, naming the file and the cause, and goes on: what a cache saves is time, and the
    work it would have kept is done again on the next start."""
    try:
        write_text_atomic(path, json.dumps(data))
    except OSError as e:
        print(f"specdecode: warning: cannot keep {path} in the cache ({e.strerror or e}; ${CACHE_ENV} moves the "
              "cache): it is measured again on the next start", file=sys.stderr, flush=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the file to; renamed to ``path`` when the
    block ends without an exception, removed otherwise. Creates the parent folder.
    Raises OSError when the folder cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's file is private; writers may also recreate it
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text (UTF-8) to path whole or not at all. Raises OSError."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_folder(dest: str | Path, replace_empty: bool = False) -> Iterator[Path]:
    """A temporary folder beside ``dest`` to fill; renamed to ``dest`` when the block ends
    without an exception, removed with its contents otherwise. replace_empty: an existing
    empty folder at dest is replaced (anything else there makes the rename fail: OSError)."""
    dest = Path(dest)
    parent = dest.parent if str(dest.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; this is an ordinary folder
        if replace_empty and dest.is_dir() and not any(dest.iterdir()):
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """The SHA-256 of a file's bytes (hex); progress(n) is called after each chunk of n bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()
