"""Small things the bench and the probe scripts of ``benchmarks/`` share: the machine's CPU
as a results file names it, a free loopback port, and ``specdecode serve`` started as a
process of its own (for a client measured as it calls, such as an editor)."""

from __future__ import annotations

import platform
import shutil
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


# What the agent scripts (benchmarks/codex_exec.py, claude_code.py) run: a two-file repository and a task.
CALC = "def add(a, b):\n    return a + b\n"
TESTS = """import unittest

from calc import add, multiply


class TestCalc(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_multiply(self):
        self.assertEqual(multiply(4, 5), 20)


if __name__ == "__main__":
    unittest.main()
"""
TASK = ("Add a function multiply(a, b) to calc.py that returns a * b, then run `python -m unittest` "
        "to check that the tests pass.")


def make_repo(path: Path) -> None:
    """The task's repository: calc.py, test_calc.py, one commit."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "calc.py").write_text(CALC)
    (path / "test_calc.py").write_text(TESTS)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "calc"]):
        subprocess.run(git + cmd, cwd=path, check=True)


def metric_total(metrics: str, name: str) -> float:
    """The sum of a specdecode metric's samples (every label) in a /metrics text."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(f"specdecode:{name} ") or line.startswith(f"specdecode:{name}{{"))


def run_agent(cmd: list[str], cwd: Path, env: dict, timeout: int) -> tuple[str, str, int | None, float]:
    """The agent's command run to its end (or timeout seconds): stdout, stderr, its exit code
    (None: timed out), wall seconds."""
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        stdout, stderr, rc = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = _text(e.stdout), _text(e.stderr) + f"\ntimed out after {timeout} s", None
    return stdout, stderr, rc, time.perf_counter() - start


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:  # mid-step on a slow machine: stop it outright
        server.kill()
        server.wait()


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""
