"""llama.cpp's own server (``llama-server``) as a peer of ``specdecode bench`` (issue 60).

The peer is built from the llama.cpp that llama-cpp-python vendors, the same kernels as
specdecode's llama.cpp backend (``benchmarks/build_llama_server.sh``), and started here once per
configuration on the same GGUF, context, threads and one slot:

- ``plain``: no speculation;
- ``spec-default``: ``--spec-default`` (llama.cpp's default speculation);
- ``ngram-simple``: ``--spec-type ngram-simple``;
- ``draft``: ``--model-draft`` the draft model with ``--spec-type draft-simple`` (the first
  draft model a configuration names, or ``--llama-server-draft``).

Every prompt is sent to each of them between specdecode's own runs of it, greedy
(``temperature`` 0), ``cache_prompt`` false (each run reads its whole prompt, as each of
specdecode's does), as token ids to ``/completion`` (the very prompt specdecode runs) or, for a
fill-in-the-middle prompt, as llama.vim sends it to ``/infill`` (prefix, suffix and files: the
server lays it out; its ``prompt_n`` is checked against specdecode's prompt). The times are the
server's own ``timings`` (milliseconds reading the prompt and generating), so no HTTP cost
enters them.

Raises nothing into the bench: a peer that cannot start or answer is reported in the note.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

from ..assembly import registry

LLAMA_SERVER_ENV = "SPECDECODE_LLAMA_SERVER"
CONFIGS = ("plain", "spec-default", "ngram-simple", "draft")
START_TIMEOUT_S = 600.0  # a first load reads and repacks the weights
REQUEST_TIMEOUT_S = 3600.0


def default_binary() -> Path | None:
    """$SPECDECODE_LLAMA_SERVER, else where benchmarks/build_llama_server.sh puts it for the
    installed llama-cpp-python (~/.cache/specdecode/llama-server/VERSION/llama-server), else
    ``llama-server`` on the PATH; None where none exists."""
    env = os.environ.get(LLAMA_SERVER_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    try:
        version = importlib.metadata.version("llama_cpp_python")
        built = Path.home() / ".cache" / "specdecode" / "llama-server" / version / "llama-server"
        if built.exists():
            return built
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which("llama-server")
    return Path(found) if found else None


def config_args(config: str, draft_path: Path | None) -> list[str] | None:
    """llama-server's arguments for one peer configuration (None: a draft configuration with no
    draft model)."""
    if config == "plain":
        return []
    if config == "spec-default":
        return ["--spec-default"]
    if config == "ngram-simple":
        return ["--spec-type", "ngram-simple"]
    if config == "draft":
        # (--model-draft alone loads the model but drafts nothing in this llama.cpp: draft_n stays 0)
        return None if draft_path is None else ["--model-draft", str(draft_path), "--spec-type", "draft-simple"]
    raise ValueError(f"unknown llama-server configuration {config!r}: expected one of {', '.join(CONFIGS)}")


@dataclass
class PeerRun:
    """One llama-server answer: tokens generated (ids), the prompt tokens it read, seconds
    reading the prompt and generating (its ``timings``), tokens drafted and accepted."""

    tokens: list[int]
    prompt_n: int
    prompt_s: float
    predicted_s: float
    draft_n: int = 0
    draft_accepted: int = 0

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first token, as :func:`.peers.decode_rate` counts specdecode's
        (llama-server's predicted_ms runs from the end of the prompt to the last token)."""
        n = len(self.tokens)
        return (n - 1) / self.predicted_s if n > 1 and self.predicted_s > 0 else 0.0


class LlamaServer:
    """One llama-server process on a free local port; :meth:`run` sends a prompt. Close it
    (or use it as a context manager) to stop the process.

    binary: the llama-server executable. model: the target's GGUF. n_ctx, n_threads: as the
    bench's target (n_ctx per slot: llama-server divides -c among its slots). extra: the
    configuration's arguments (:func:`config_args`). slots: -np.
    Raises RuntimeError naming the binary and the last lines of its log where it does not
    start within START_TIMEOUT_S seconds."""

    def __init__(self, binary: Path, model: Path, n_ctx: int, n_threads: int, extra: Sequence[str] = (),
                 flash_attn: str | None = None, slots: int = 1) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        cmd = [str(binary), "-m", str(model), "-c", str(n_ctx * slots), "-t", str(n_threads), "-tb", str(n_threads),
               "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *extra]
        if flash_attn:
            cmd += ["-fa", flash_attn]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=REQUEST_TIMEOUT_S)
        try:
            self._wait()
        except BaseException:
            self.close()
            raise

    def _wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}: {self.tail()}")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not start within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self, n: int = 3) -> str:
        """The last n lines of its log, on one line."""
        try:
            lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def run(self, ids: Sequence[int] | None, max_tokens: int, fim: dict | None = None) -> PeerRun:
        """Generate greedily from token ids (``/completion``) or a fill-in-the-middle request
        (``fim``: input_prefix, input_suffix, input_extra; ``/infill``). Raises RuntimeError
        with the server's answer where it is not a 200."""
        body = {"n_predict": max_tokens, "temperature": 0, "cache_prompt": False, "return_tokens": True,
                "stream": False}
        if fim is not None:
            r = self.http.post("/infill", json={**fim, **body})
        else:
            r = self.http.post("/completion", json={"prompt": list(ids or ()), **body})
        if r.status_code != 200:
            raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:200]}")
        data = r.json()
        t = data.get("timings", {})
        return PeerRun([int(x) for x in data.get("tokens", [])], int(t.get("prompt_n", 0)),
                       float(t.get("prompt_ms", 0.0)) / 1000, float(t.get("predicted_ms", 0.0)) / 1000,
                       int(t.get("draft_n", 0) or 0), int(t.get("draft_n_accepted", 0) or 0))

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_llama_servers(binary: Path | None, model: Path | None, draft: str | None, n_ctx: int, n_threads: int,
                        configs: Sequence[str] = CONFIGS,
                        flash_attn: str | None = None) -> tuple[dict[str, LlamaServer], str]:
    """Start one llama-server per configuration that can run: ({config: server}, a note naming
    the binary, its version and what could not start). model: the target's GGUF file (None: a
    target without one, not run); draft: a registry name or GGUF path (None: the draft
    configuration is left out)."""
    if binary is None or not Path(binary).exists():
        return {}, (f"llama-server not run: no binary at {binary}" if binary else
                    "llama-server not run: none built (bash benchmarks/build_llama_server.sh) or named "
                    f"(--llama-server PATH, ${LLAMA_SERVER_ENV})")
    if model is None or Path(model).suffix != ".gguf":
        return {}, f"llama-server not run: the target is not a GGUF file ({model})"
    draft_path = registry.resolve(draft) if draft else None
    servers: dict[str, LlamaServer] = {}
    failed = []
    for config in configs:
        extra = config_args(config, draft_path)
        if extra is None:
            failed.append(f"{config}: no draft model (--llama-server-draft NAME)")
            continue
        try:
            servers[config] = LlamaServer(Path(binary), model, n_ctx, n_threads, extra, flash_attn)
        except (RuntimeError, OSError) as e:
            failed.append(f"{config}: {e}")
    version = ""
    try:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30).stderr
        version = next((ln for ln in version.splitlines() if ln.startswith("version")), "").strip()
    except (OSError, subprocess.SubprocessError):
        pass
    note = f"llama-server {binary} ({version or 'version unknown'}), -c {n_ctx} -t {n_threads} -np 1" + \
        (f", draft {draft}" if draft_path and "draft" in servers else "") + \
        (f"; not started: {'; '.join(failed)}" if failed else "")
    return servers, note
