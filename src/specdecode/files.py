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
import os
import shutil
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
