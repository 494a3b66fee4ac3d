"""Small things the bench and the probe scripts of ``benchmarks/`` share: the machine's CPU
as a results file names it, a free loopback port, and ``specdecode serve`` started as a
process of its own (for a client measured as it calls, such as an editor)."""

from __future__ import annotations

import json
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

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


def add_agent_options(ap: Any, agent: str, package: str, version: str, ctx_size: int) -> None:
    """The options every agent script takes: the agent's binary (--AGENT, --AGENT-version,
    --AGENT-dir) and the server's --target, --draft and --ctx-size."""
    ap.add_argument(f"--{agent}", default=None, help=f"a {agent} binary (default: npm-install {package} into "
                    f"--{agent}-dir)")
    ap.add_argument(f"--{agent}-version", default=version, help="the npm version to install (default: %(default)s)")
    ap.add_argument(f"--{agent}-dir", default=None, help=f"where to install it (default: <work>/{agent}-npm)")
    ap.add_argument("--target", default=None, help="the server's --target (default: its default)")
    ap.add_argument("--draft", default=None, help="the (speculating) server's --draft (default: its default, auto)")
    ap.add_argument("--ctx-size", type=int, default=ctx_size, help="the server's --ctx-size (default: %(default)s)")


def npm_install(folder: Path, package: str, version: str, binary: str) -> Path:
    """``npm install PACKAGE@VERSION`` into folder (skipped when its binary is there); the
    binary's path. Raises SystemExit naming the failure when npm fails."""
    path = folder / "node_modules" / ".bin" / binary
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["npm", "install", "--prefix", str(folder), f"{package}@{version}"],
                             capture_output=True, text=True)
        if out.returncode != 0 or not path.exists():
            sys.exit(f"npm install {package}@{version} failed:\n{out.stdout}{out.stderr}")
    return path


def agent_setup(args: Any, agent: str, package: str) -> tuple[Path, Path, str]:
    """An agent script's work folder (--keep, else a new temporary one), the agent's binary
    (--AGENT, else installed from npm into --AGENT-dir or the work folder) and its ``--version``."""
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix=f"{agent}-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    given, folder = getattr(args, agent), getattr(args, f"{agent}_dir") or work / f"{agent}-npm"
    path = Path(given) if given else npm_install(Path(folder), package, getattr(args, f"{agent}_version"), agent)
    return work, path, subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout.strip()


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


def agent_outcome(repo: Path, before: str, after: str, log: Path) -> dict:
    """What an agent's run left: whether the repository's tests pass, the server's finished
    requests, prompt, cached prompt, generated, drafted and accepted tokens between two /metrics
    texts, and the
    first 4xx lines of the server's log (its access log and its refusal lines)."""
    tests = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=repo, capture_output=True, text=True)
    names = {"requests": "e2e_request_latency_seconds_count", "prompt_tokens": "prompt_tokens_total",
             "cached_tokens": "prompt_tokens_cached_total", "generated_tokens": "generation_tokens_total",
             "drafted_tokens": "num_draft_tokens_total", "accepted_tokens": "num_accepted_tokens_total"}
    rejected = [line for line in log.read_text(errors="replace").splitlines()
                if re.search(r'" 4\d\d |\b4\d\d /', line)]  # uvicorn's access line, the server's refusal line
    return {"tests_pass": tests.returncode == 0, "rejected": rejected[:5],
            **{key: int(metric_total(after, name) - metric_total(before, name)) for key, name in names.items()}}


def json_lines(text: str) -> list[dict]:
    """The JSON objects of an agent's JSON-lines output (other lines skipped)."""
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


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
