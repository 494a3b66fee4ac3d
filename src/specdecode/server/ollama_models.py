"""What the Ollama API (:mod:`.ollama`) says of the served model: its entry in ``GET /api/tags``
and ``GET /api/ps``, ``POST /api/show``'s answer, and which model names a request may use.

Ollama describes a model by the GGUF's own metadata (``general.architecture`` as the family,
``general.size_label`` as the parameter size, ``general.file_type`` as the quantization level);
:func:`gguf_metadata` reads those keys from the file's header without loading its tensors or its
vocabulary (tens of milliseconds for a 1.5B model, against seconds for ``gguf.GGUFReader``). A
model loaded otherwise (a transformers folder, a fake in the tests) gets the fields it has and
empty ones for the rest.

Pure but for reading the model file's header: no FastAPI here.
"""

from __future__ import annotations

import datetime
import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The Ollama release whose API these endpoints follow (docs.ollama.com/api when written):
# clients gate features on /api/version (VS Code Copilot's Ollama provider asks for >= 0.6.4).
OLLAMA_API_VERSION = "0.12.6"
# Ollama's default tag: "name" and "name:latest" are one model.
DEFAULT_TAG = ":latest"
# The GGUF keys a model card reads.
_GGUF_KEYS = frozenset({"general.architecture", "general.size_label", "general.file_type", "general.basename",
                        "general.parameter_count"})
# struct formats of the GGUF scalar value types (gguf.GGUFValueType: 8 string, 9 array).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path, keys: frozenset[str] = _GGUF_KEYS) -> dict[str, Any]:
    """The scalar (string and number) values of ``keys`` in a GGUF file's header; {} for a
    file that is no GGUF (or cannot be read). Arrays (the vocabulary) are skipped by their
    lengths, never decoded; reading stops once every key is found."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _read_kv(m, keys)
    except (OSError, ValueError, struct.error):  # not a file, empty, truncated, or another format
        return {}


def _read_kv(m: Any, keys: frozenset[str]) -> dict[str, Any]:
    if m[:4] != b"GGUF":
        return {}
    _, _, n_kv = struct.unpack_from("<IQQ", m, 4)  # version, tensor count, key-value count
    pos, out = 24, {}

    def skip(kind: int, pos: int) -> int:
        if kind in _GGUF_SCALARS:
            return pos + struct.calcsize(_GGUF_SCALARS[kind])
        if kind == _STRING:
            return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if item in _GGUF_SCALARS:
                return pos + n * struct.calcsize(_GGUF_SCALARS[item])
            for _ in range(n):
                pos = skip(item, pos)
            return pos
        raise ValueError(f"GGUF value type {kind}")

    for _ in range(n_kv):
        (size,) = struct.unpack_from("<Q", m, pos)
        key = bytes(m[pos + 8:pos + 8 + size]).decode("utf-8", "replace")
        (kind,) = struct.unpack_from("<I", m, pos + 8 + size)
        pos += 12 + size
        if key in keys and kind == _STRING:
            (n,) = struct.unpack_from("<Q", m, pos)
            out[key] = bytes(m[pos + 8:pos + 8 + n]).decode("utf-8", "replace")
        elif key in keys and kind in _GGUF_SCALARS:
            out[key] = struct.unpack_from("<" + _GGUF_SCALARS[kind], m, pos)[0]
        pos = skip(kind, pos)
        if len(out) == len(keys):
            break
    return out


def _quantization(file_type: Any) -> str:
    """A GGUF general.file_type as Ollama writes it ("Q4_K_M"); "" when unknown."""
    if not isinstance(file_type, int):
        return ""
    from gguf import LlamaFileType  # a dependency (draft heads read GGUFs too); imported once it is needed

    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return ""


def _iso(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class ModelCard:
    """The served model as Ollama's endpoints describe it.

    name: the served model's id (``serve --model-name``, default the target's name), listed as
    it is so that clients send it back to /v1 routes too. format: "gguf" for a GGUF file, else
    "". size: the model file's bytes (0 when not loaded from one file). digest: its SHA-256
    where the loader knows it, else one of its name, size and time (an identifier, as Ollama's
    manifest digest is). modified_at: the file's time (else when the server started). family, parameter_size, quantization,
    basename: from the GGUF's metadata ("" when unknown). n_ctx: the served context, in tokens.
    capabilities: Ollama's words for what the model does here ("completion"; "tools" where
    its chat template teaches a tool-call format; "insert" where it has FIM tokens).
    template: what ``/api/show`` shows as the prompt template (:func:`describe_template`).
    """

    name: str
    format: str
    size: int
    digest: str
    modified_at: str
    family: str
    parameter_size: str
    quantization: str
    basename: str
    n_ctx: int
    capabilities: tuple[str, ...]
    template: str

    def names(self) -> tuple[str, ...]:
        """The names a request may give: the id, and with Ollama's default tag when it has none."""
        return (self.name,) if ":" in self.name else (self.name, self.name + DEFAULT_TAG)

    def details(self) -> dict:
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None, "parameter_size": self.parameter_size,
                "quantization_level": self.quantization}

    def tags_entry(self) -> dict:
        """The model in ``GET /api/tags``."""
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details()}

    def ps_entry(self) -> dict:
        """The model in ``GET /api/ps``: loaded for as long as the server runs (expires_at far
        ahead, as Ollama shows a model kept with keep_alive -1), its context the served one."""
        forever = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(microseconds=2**63 // 1000)
        return {**self.tags_entry(), "expires_at": _iso(forever), "size_vram": 0, "context_length": self.n_ctx}

    def show(self) -> dict:
        """``POST /api/show``'s answer. model_info gives ``<architecture>.context_length`` as the
        served context (what a client may send), not the model's trained one; ``parameters``
        holds num_ctx in the Modelfile's line form, which Continue reads."""
        arch = self.family or "unknown"
        info: dict[str, Any] = {"general.architecture": arch, "general.basename": self.basename or self.name,
                                f"{arch}.context_length": self.n_ctx}
        modelfile = (f"# Modelfile of {self.name}, served by specdecode\nFROM {self.name}\n"
                     f'TEMPLATE """{self.template}"""\nPARAMETER num_ctx {self.n_ctx}\n')
        return {"license": "", "modelfile": modelfile, "parameters": f"num_ctx {self.n_ctx}",
                "template": self.template, "details": self.details(), "model_info": info,
                "capabilities": list(self.capabilities), "modified_at": self.modified_at}


def describe_template(fim_texts: tuple[str, str, str] | None) -> str:
    """The prompt template ``/api/show`` shows, in Ollama's Go template syntax: where the model
    has FIM tokens (their texts: prefix, suffix, middle), a ``{{ .Suffix }}`` branch with its
    fill-in-the-middle layout (Continue's Ollama provider offers completions to a model whose
    template holds ``.Suffix``); chat prompts are the model's own (Jinja) chat template's."""
    chat = "{{/* chat: the model's own chat template renders .Messages */}}{{ .Prompt }}"
    if fim_texts is None:
        return chat
    pre, suf, mid = fim_texts
    return f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}{{{{- else }}}}{chat}{{{{- end }}}}"


def model_card(target: Any, name: str, n_ctx: int, tools: bool, started: float) -> ModelCard:
    """The card of a loaded target backend served as ``name`` with a context of n_ctx tokens.
    tools: whether its chat template teaches a tool-call format. started: when the server
    started (seconds since the epoch), the time shown for a model not loaded from a file."""
    path = target.path
    is_file = path is not None and Path(path).is_file()
    meta = gguf_metadata(Path(path)) if is_file else {}
    size = Path(path).stat().st_size if is_file else 0
    mtime = Path(path).stat().st_mtime if is_file else started
    digest = target.known_sha256 or hashlib.sha256(f"{name}\0{size}\0{mtime}".encode()).hexdigest()
    fim = target.fim_tokens
    fim_texts = None
    if fim is not None:
        fim_texts = tuple(target.token_text(t).decode("utf-8", "replace") for t in (fim.pre, fim.suf, fim.mid))
    capabilities = ("completion",) + (("tools",) if tools else ()) + (("insert",) if fim is not None else ())
    return ModelCard(name=name, format="gguf" if meta else "", size=size, digest=digest,
                     modified_at=_iso(datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)),
                     family=str(meta.get("general.architecture", "")),
                     parameter_size=str(meta.get("general.size_label", "")),
                     quantization=_quantization(meta.get("general.file_type")),
                     basename=str(meta.get("general.basename", "")), n_ctx=n_ctx, capabilities=capabilities,
                     template=describe_template(fim_texts))
