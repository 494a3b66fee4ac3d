"""The worked example beyond text (examples/digits.py), shortened: both models trained for a
few steps, every digit sampled with and without speculation from the same seeds; the grid and
the report are written, and the same seed gives the same image either way."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


@pytest.fixture(scope="module")
def digits():
    spec = importlib.util.spec_from_file_location("digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sequences_are_class_then_pixels(digits):
    seqs, labels = digits.digit_sequences()
    assert seqs.shape == (1797, 65) and seqs.min() == 0 and seqs.max() == digits.V - 1
    assert (seqs[:, 0] == digits.CLASS0 + labels).all() and seqs[:, 1:].max() == digits.LEVELS - 1


def test_the_example_writes_its_grid_and_report(digits, tmp_path, capsys):
    assert digits.main(["--out", str(tmp_path), "--steps", "12", "--samples", "1", "-k", "4"]) == 0
    report = json.loads((tmp_path / "digits.json").read_text())
    png = (tmp_path / "digits.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert report["images_per_side"] == 10 and report["identical_images"] == 10  # the seed promise
    assert 0 < report["acceptance_rate"] <= 1 and report["mean_accepted_length"] > 1
    assert report["speedup"] > 0 and report["target"]["params"] > 10 * report["draft"]["params"]
    printed = capsys.readouterr().out
    assert "speedup" in printed and "acceptance" in printed and str(tmp_path / "digits.png") in printed
    # A second run with the same options reuses the trained models.
    assert digits.main(["--out", str(tmp_path), "--steps", "12", "--samples", "1"]) == 0
    assert "target: loaded" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*.tmp"))  # written whole


def test_sampled_pixels_are_pixel_codes(digits):
    """The models never emit a class code after the class: every image is 64 intensities."""
    import torch

    model = digits.build(digits.DRAFT).eval()
    b = digits.backend(model, "untrained")
    logits = b.forward([digits.CLASS0 + 3] + [0] * 10, logits_for=range(11))
    assert np.isneginf(logits[:, digits.LEVELS:]).all() and np.isfinite(logits[:, :digits.LEVELS]).all()
    with torch.no_grad():
        full = model(torch.tensor([[digits.CLASS0 + 3] + [0] * 10]))
    np.testing.assert_allclose(logits[:, :digits.LEVELS], full[0, :, :digits.LEVELS].numpy(), atol=1e-5)


def test_bad_options_exit_with_a_message(digits, capsys):
    for argv in (["--steps", "0"], ["-k", "x"], ["--temperature", "0"]):
        with pytest.raises(SystemExit) as e:
            digits.main(argv)
        assert e.value.code == 2
    assert "--steps 0" in capsys.readouterr().err
