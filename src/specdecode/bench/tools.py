"""Small things the bench and the probe scripts of ``benchmarks/`` share: the machine's CPU
as a results file names it, a free loopback port, and ``specdecode serve`` started as a
process of its own (for a client measured as it calls, such as an editor)."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from ..errors import SpecDecodeError

SERVE_START_TIMEOUT_S = 900.0  # a first start may pull and verify the models


def cpu_name() -> str:
    """The CPU's model name and its widest vector unit, e.g. "AMD EPYC 9R14 (AVX-512)", from
    /proc/cpuinfo (``platform.processor()`` where there is none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return f"{name} ({vector})" if vector else name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(options: Sequence[str], port: int, log: Path,
                  timeout_s: float = SERVE_START_TIMEOUT_S) -> subprocess.Popen:
    """Start ``specdecode serve --port PORT OPTIONS`` in a process of its own (its output into
    the file ``log``) and return it once ``/health`` answers 200. Raises SpecDecodeError with
    the log's text when the server exits first or does not answer within ``timeout_s`` seconds
    (it is killed then)."""
    import httpx

    cmd = [sys.executable, "-m", "specdecode", "serve", "--port", str(port), *options]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SpecDecodeError("the server exited:\n" + log.read_text(errors="replace"))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SpecDecodeError("the server did not start:\n" + log.read_text(errors="replace"))
        time.sleep(0.5)
