"""Speculative decoding beyond text: class-conditional 8x8 digits.

Each image of scikit-learn's bundled handwritten digits (1,797 of them, no download) is a
sequence of 65 codes: its class code first (17 + digit), then its 64 pixel intensities
(codes 0..16, row by row). A small transformer (the target) and a much smaller one (the
draft model) are trained on them here on the CPU, then wrapped as specdecode backends
(:class:`specdecode.ModuleBackend`, with their own KV caches) and sampled from: every digit
with and without speculation, from the same seeds. The images go to a PNG grid; the run
prints the acceptance, the mean accepted length and the speedup, measured side by side.

    pip install -e '.[examples]'
    python examples/digits.py                # about 3 minutes on a 2-core CPU

Options: ``--out DIR`` (default examples/out), ``--steps N`` training steps per model,
``--samples N`` images per digit and side, ``-k K`` drafted codes per step ("auto": the
cost-aware controller), ``--temperature T``, ``--seed S``. The trained weights are kept in
DIR and reused by a later run with the same options (``--retrain`` trains again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
except ImportError as e:
    sys.exit(f"examples/digits.py needs {e.name}: pip install -e '.[examples]' (scikit-learn and torch)")

import specdecode
from specdecode.files import atomic_path

LEVELS = 17  # pixel intensities 0..16
CLASS0 = LEVELS  # class code of digit d: CLASS0 + d
V = LEVELS + 10  # the codebook: 17 intensities and 10 class codes
PIXELS = 64
N_CTX = PIXELS + 1
# On a CPU at batch 1 a forward of a model this small costs about its number of operations in
# fixed overheads, not its weights: a deep target (about 2.4 ms a forward on a 2-core AMD EPYC,
# 3.0 ms for 5 codes) and a draft of a few operations.
TARGET = ("gpt", dict(d=96, layers=8, heads=4))
DRAFT = ("mlp", dict(d=64))


class Block(torch.nn.Module):
    """Pre-norm transformer block; attention over the cached keys and values plus the new ones."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, past):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=-2), torch.cat([past[1], v], dim=-2)
        start = k.shape[-2] - N
        mask = None if start == 0 else torch.ones(N, start + N, dtype=torch.bool).tril(diagonal=start)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=start == 0 and N > 1,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, D))
        x = x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)
        return x, (k, v)


class DigitGPT(torch.nn.Module):
    """A GPT over the codebook: ``model(ids [B, N], past) -> (logits [B, N, V], past)``, past
    the per-layer (keys, values) [B, heads, L, D/heads] (None at position 0), the form
    ModuleBackend(kv_cache=True) crops on axis -2. Class codes are never predicted (their
    logits are -inf): an image's codes after its class are pixels."""

    def __init__(self, d: int, layers: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(V, d), torch.nn.Embedding(N_CTX, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, V)
        self.register_buffer("pixel_only", torch.tensor([0.0] * LEVELS + [float("-inf")] * 10))

    def forward(self, ids, past=None):
        start = 0 if past is None else past[0][0].shape[-2]
        x = self.tok(ids) + self.pos(torch.arange(start, start + ids.shape[1], device=ids.device))
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            cache.append(kv)
        return self.head(self.norm(x)) + self.pixel_only, tuple(cache)


class PixelMLP(torch.nn.Module):
    """The draft model: a two-layer perceptron over each pixel's neighbourhood (the pixels to
    its left and above, as PixelCNN's context: van den Oord et al. 2016), its position and
    the class. ``model(ids [B, L]) -> logits [B, L, V]`` over the whole sequence, with no
    cache: ModuleBackend's slow path, cheap here (65 positions, one fused layer)."""

    # Offsets back from row t (which predicts code t + 1, pixel t): left, two left, above-right, above, above-left.
    OFFSETS = (0, 1, 6, 7, 8)

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.near = torch.nn.Embedding(len(self.OFFSETS) * (V + 1), d)  # per offset: V codes and "off the image"
        self.pos, self.cls = torch.nn.Embedding(N_CTX, d), torch.nn.Embedding(V, d)
        self.mlp = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, V))
        self.register_buffer("pixel_only", torch.tensor([0.0] * LEVELS + [float("-inf")] * 10))
        # Where each row's neighbours are in the sequence (index 0 of the padded sequence: off the image).
        t = torch.arange(N_CTX)
        row, col = t // 8, t % 8
        inside = [col >= 1, col >= 2, (row >= 1) & (col <= 6), row >= 1, (row >= 1) & (col >= 1)]
        where = torch.stack([torch.where(ok, t - off + 1, 0) for ok, off in zip(inside, self.OFFSETS)], dim=1)
        self.register_buffer("where", where)  # [N_CTX, 5] into [off-image] + ids
        self.register_buffer("shift", torch.arange(len(self.OFFSETS)) * (V + 1))

    def forward(self, ids):
        L = ids.shape[1]
        padded = F.pad(ids, (1, 0), value=V)  # [B, 1 + L]: V = off the image
        x = self.near(padded[:, self.where[:L]] + self.shift).sum(dim=2)  # [B, L, d]
        x = x + self.pos.weight[:L] + self.cls(ids[:, :1])
        return self.mlp(x) + self.pixel_only


def digit_sequences() -> tuple[np.ndarray, np.ndarray]:
    """[1797, 65] code sequences (class code, 64 pixels) and the digits [1797]."""
    data = load_digits()
    pixels = data.images.reshape(len(data.images), PIXELS).astype(np.int64)  # 0..16
    return np.concatenate([CLASS0 + data.target[:, None], pixels], axis=1), data.target


def build(spec: tuple[str, dict]) -> torch.nn.Module:
    kind, size = spec
    return DigitGPT(**size) if kind == "gpt" else PixelMLP(**size)


def train(spec: tuple[str, dict], seqs: np.ndarray, steps: int, seed: int, label: str, batch: int = 32,
          teacher: DigitGPT | None = None) -> tuple[torch.nn.Module, dict]:
    """AdamW on next-code cross-entropy over the pixels (a tenth of the images held out);
    with a teacher (the target, for the draft model), on the teacher's own next-code
    distributions instead (distillation, as DistillSpec: Zhou et al. 2024, a draft aligned
    with its target is accepted more often). The held-out loss is against the data."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(seqs))
    held, fit = torch.tensor(seqs[order[: len(seqs) // 10]]), torch.tensor(seqs[order[len(seqs) // 10:]])
    model = build(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)

    soft = None
    if teacher is not None:  # the teacher's next-code distributions over the training images, once
        with torch.no_grad():
            soft = torch.cat([F.softmax(teacher(fit[i:i + 256, :-1])[0][..., :LEVELS], dim=-1)
                              for i in range(0, len(fit), 256)])

    def loss_of(x, teach=None):
        logits = model(x[:, :-1])
        logits = logits[0] if isinstance(logits, tuple) else logits
        if teach is None:
            return F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))
        return F.cross_entropy(logits[..., :LEVELS].reshape(-1, LEVELS), teach.reshape(-1, LEVELS))

    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        idx = torch.as_tensor(rng.integers(0, len(fit), batch))
        loss = loss_of(fit[idx], None if soft is None else soft[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % max(1, steps // 5) == 0 or step + 1 == steps:
            print(f"  {label}: step {step + 1}/{steps}, training loss {loss.item():.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        held_loss = loss_of(held).item()
    params = sum(p.numel() for p in model.parameters())
    return model, {"params": params, "steps": steps, "held_out_loss": round(held_loss, 4),
                   "seconds": round(time.perf_counter() - t0, 1)}


def trained(spec: tuple[str, dict], seqs, steps: int, seed: int, out: Path, name: str, retrain: bool,
            teacher: DigitGPT | None = None) -> tuple[torch.nn.Module, dict]:
    """The model trained with these options, from out/name.pt when a run saved it."""
    path = out / f"{name}.pt"
    key = {"model": list(spec), "steps": steps, "seed": seed, "distilled": teacher is not None}
    if path.exists() and not retrain:
        saved = torch.load(path, weights_only=False)
        if saved.get("key") == key:
            model = build(spec)
            model.load_state_dict(saved["state"])
            print(f"  {name}: loaded {path}")
            return model.eval(), saved["report"]
    model, report = train(spec, seqs, steps, seed, name, teacher=teacher)
    with atomic_path(path) as tmp:
        torch.save({"key": key, "state": model.state_dict(), "report": report}, tmp)
    return model, report


def backend(model: torch.nn.Module, name: str) -> specdecode.ModuleBackend:
    """The transformer keeps its KV cache; the perceptron recomputes (ModuleBackend's slow path)."""
    return specdecode.ModuleBackend(model, n_vocab=V, n_ctx=N_CTX, kv_cache=isinstance(model, DigitGPT),
                                    codebook="digits-8x8", name=name)


def sample_all(dec: specdecode.Decoder, samples: int, temperature: float, seed: int) -> tuple[dict, dict]:
    """Every digit's images, speculative and plain in turn from the same seeds (alternated, so
    that the machine's load weighs on both sides alike). Returns ({side: [10, samples, 64]},
    {side: [GenerationResult]})."""
    images = {side: np.zeros((10, samples, PIXELS), dtype=np.int64) for side in ("speculative", "plain")}
    results: dict = {"speculative": [], "plain": []}
    for j in range(samples):
        for digit in range(10):
            s = seed + 100 * digit + j
            sides = ("speculative", "plain") if (j + digit) % 2 == 0 else ("plain", "speculative")
            for side in sides:
                r = dec.generate_ids([CLASS0 + digit], max_tokens=PIXELS, temperature=temperature, seed=s,
                                     plain=side == "plain")
                images[side][digit, j] = r.token_ids
                results[side].append(r)
    return images, results


def save_grid(images: dict, path: Path) -> None:
    """One row per digit: the plain samples, a gap, the speculative ones (same seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = images["plain"].shape[1]
    fig, axes = plt.subplots(10, 2 * samples + 1, figsize=(0.7 * (2 * samples + 1), 7.4))
    for digit in range(10):
        for col in range(2 * samples + 1):
            ax = axes[digit, col]
            ax.axis("off")
            if col != samples:
                side, j = ("plain", col) if col < samples else ("speculative", col - samples - 1)
                ax.imshow(images[side][digit, j].reshape(8, 8), cmap="gray_r", vmin=0, vmax=16)
    fig.suptitle("plain decoding (left) and speculative decoding (right), same seeds", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def summary(results: dict) -> dict:
    """Acceptance, mean accepted length and the decode speedup over the runs of each side."""
    def rate(rs):
        return sum(r.stats.completion_tokens for r in rs) / sum(r.stats.decode_s for r in rs)

    spec = results["speculative"]
    drafted, accepted = sum(r.stats.drafted for r in spec), sum(r.stats.accepted for r in spec)
    forwards = sum(r.stats.target_forward_passes for r in spec)
    return {"acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round(sum(r.stats.committed_tokens for r in spec) / forwards, 3),
            "speculative_codes_per_s": round(rate(spec), 1), "plain_codes_per_s": round(rate(results["plain"]), 1),
            "speedup": round(rate(spec) / rate(results["plain"]), 3),
            "identical_images": sum(a.token_ids == b.token_ids for a, b in zip(spec, results["plain"])),
            "images_per_side": len(spec)}


def cpu_name() -> str:
    """The CPU's model name and its widest vector extension (the kinds differ up to 2x)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "CPU")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
    vector = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f"{name} ({vector}, {os.cpu_count()} CPUs)" if vector else name


def run(out: Path, steps: int = 400, samples: int = 4, k: int | str = 6, temperature: float = 1.0, seed: int = 0,
        retrain: bool = False, draft_steps: int | None = None) -> dict:
    """Train (or load) both models, sample every digit both ways, write out/digits.png and
    out/digits.json; returns the report."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seqs, _ = digit_sequences()
    print(f"training on {len(seqs)} digits of {N_CTX} codes ({V}-code codebook)")
    target, target_report = trained(TARGET, seqs, steps, seed, out, "target", retrain)
    draft, draft_report = trained(DRAFT, seqs, draft_steps or 5 * steps, seed + 1, out, "draft", retrain,
                                  teacher=target)
    with specdecode.Decoder(target=backend(target, "digits-target"), draft=backend(draft, "digits-draft"),
                            num_speculative_tokens=k, progress=False) as dec:
        dec.generate_ids([CLASS0], max_tokens=8, temperature=temperature, seed=0)  # warm up both paths
        dec.generate_ids([CLASS0], max_tokens=8, temperature=temperature, seed=0, plain=True)
        images, results = sample_all(dec, samples, temperature, seed)
    save_grid(images, out / "digits.png")
    report = {"cpu": cpu_name(), "k": k, "temperature": temperature, "target": target_report, "draft": draft_report,
              **summary(results), "grid": str(out / "digits.png")}
    with atomic_path(out / "digits.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    ap.add_argument("--steps", type=int, default=400, help="training steps of the target; the draft model trains 5x as many "
                    "(default %(default)s)")
    ap.add_argument("--samples", type=int, default=4, help="images per digit and side (default %(default)s)")
    ap.add_argument("-k", default="6", help="drafted codes per step, or auto (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retrain", action="store_true", help="train again even where out holds the models")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.samples < 1 or not 0 < a.temperature <= 10:
        ap.error(f"--steps {a.steps} and --samples {a.samples} must be >= 1, --temperature {a.temperature} in (0, 10]")
    k = a.k if a.k == "auto" else int(a.k) if a.k.isdigit() else ap.error(f"-k {a.k!r}: expected an integer or auto")
    try:
        r = run(a.out, a.steps, a.samples, k, a.temperature, a.seed, a.retrain)
    except specdecode.SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\n{r['images_per_side']} images per side on {r['cpu']} (target {r['target']['params']:,} parameters, "
          f"draft {r['draft']['params']:,}; K = {k}, temperature {a.temperature})")
    print(f"acceptance {r['acceptance_rate']:.1%}, mean accepted length {r['mean_accepted_length']:.2f} codes per "
          f"target forward")
    print(f"speculative {r['speculative_codes_per_s']} codes/s, plain {r['plain_codes_per_s']} codes/s: "
          f"speedup {r['speedup']:.2f}x; identical images from the same seed: {r['identical_images']} of "
          f"{r['images_per_side']}")
    print(f"grid: {r['grid']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
