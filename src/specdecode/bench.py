"""``specdecode bench``: speculative against plain decoding, side by side, per category.

For every prompt (JSON Lines: ``category``, ``prompt`` or ``messages``, optional
``max_tokens`` and ``id``), plain decoding and each configuration run back to back in
one process on the same loaded target, with the same sampling settings and max_tokens,
after a warm-up. Reported per category and overall: decode tokens/s (medians), speedup
(ratio of medians), acceptance rate, mean accepted length, per-position acceptance,
parity (exact / near-tie / divergent, from :func:`specdecode.parity.parity_report`), and
the process's peak resident memory. Peers: for a llama.cpp target, llama-cpp-python's own
prompt-lookup decoding (``LlamaPromptLookupDecoding``) on the same GGUF; for a torch target,
transformers' ``generate(prompt_lookup_num_tokens=10)`` and, when a configuration uses a
draft model on the torch backend, ``generate(assistant_model=...)`` with that draft.

Decode tokens/s here is (tokens - 1) / (time of last token - time of first token) for
every runner alike, so prefill never enters the comparison.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from .errors import SpecDecodeError

CATEGORIES = ("code_editing", "extraction", "qa_passages", "translation", "math", "chat", "multi_turn")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None
    messages: list | None
    max_tokens: int


def load_prompts(path: str | Path | None, default_max_tokens: int = 128) -> list[BenchPrompt]:
    """Read a JSON Lines prompt file (the built-in suite when path is None).

    Raises SpecDecodeError naming the file and line for malformed entries.
    """
    if path is None:
        text = resources.files("specdecode").joinpath("data/bench_suite.jsonl").read_text(encoding="utf-8")
        where = "built-in suite"
    else:
        p = Path(path)
        if not p.is_file():
            raise SpecDecodeError(f"prompts file {p} does not exist")
        text = p.read_text(encoding="utf-8")
        where = str(p)
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{where}, line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("category"), str):
            raise SpecDecodeError(f"{where}, line {i}: expected an object with a string 'category'")
        has_p, has_m = "prompt" in obj, "messages" in obj
        if has_p == has_m:
            raise SpecDecodeError(f"{where}, line {i}: give exactly one of 'prompt' or 'messages'")
        if has_p and not isinstance(obj["prompt"], str):
            raise SpecDecodeError(f"{where}, line {i}: 'prompt' must be a string")
        if has_m and (not isinstance(obj["messages"], list) or not obj["messages"]):
            raise SpecDecodeError(f"{where}, line {i}: 'messages' must be a non-empty list")
        mt = obj.get("max_tokens", default_max_tokens)
        if not isinstance(mt, int) or mt < 1:
            raise SpecDecodeError(f"{where}, line {i}: max_tokens = {mt!r}, expected a positive integer")
        out.append(BenchPrompt(str(obj.get("id", f"{obj['category']}-{i}")), obj["category"], obj.get("prompt"),
                               obj.get("messages"), mt))
    if not out:
        raise SpecDecodeError(f"{where} holds no prompts")
    return out


def parse_config(text: str) -> tuple[str, int | str]:
    """'DRAFT:K' (K an integer or auto), or 'DRAFT' meaning DRAFT:auto."""
    draft, _, k = text.partition(":")
    if not draft:
        raise SpecDecodeError(f"--config {text!r}: expected DRAFT[:K], e.g. ngram:4 or auto:auto")
    if not k or k == "auto":
        return draft, "auto"
    try:
        kk = int(k)
    except ValueError:
        raise SpecDecodeError(f"--config {text!r}: K must be an integer 0..32 or auto") from None
    if not 0 <= kk <= 32:
        raise SpecDecodeError(f"--config {text!r}: K = {kk} is out of range 0..32")
    return draft, kk


def decode_rate(n_tokens: int, first_s: float, total_s: float) -> float:
    """(n - 1) tokens over the time between the first and the last token."""
    span = total_s - first_s
    return (n_tokens - 1) / span if n_tokens > 1 and span > 0 else 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return statistics.median(xs) if xs else 0.0


def summarize(rows: list[dict], configs: list[str]) -> dict:
    """Per category and overall, per configuration: medians, ratios and sums."""
    cats = sorted({r["category"] for r in rows}, key=lambda c: (CATEGORIES + (c,)).index(c))
    out: dict = {}
    for cfg in configs:
        per: dict = {}
        for cat in cats + ["overall"]:
            rs = [r for r in rows if r["config"] == cfg and (cat == "overall" or r["category"] == cat)]
            if not rs:
                continue
            spec = _median([r["spec_tokens_per_s"] for r in rs])
            plain = _median([r["plain_tokens_per_s"] for r in rs])
            drafted = sum(r["drafted"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            tokens = sum(r["completion_tokens"] for r in rs)
            passes = sum(r["target_forward_passes"] for r in rs)
            width = max((len(r["accepted_per_position"]) for r in rs), default=0)
            acc_pos = [sum(r["accepted_per_position"][i] for r in rs if i < len(r["accepted_per_position"]))
                       for i in range(width)]
            dr_pos = [sum(r["drafted_per_position"][i] for r in rs if i < len(r["drafted_per_position"]))
                      for i in range(width)]
            entry = {
                "prompts": len(rs),
                "decode_tokens_per_s": round(spec, 2),
                "plain_decode_tokens_per_s": round(plain, 2),
                "speedup": round(spec / plain, 3) if plain else None,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_accepted_length": round(tokens / passes, 3) if passes else 0.0,
                "per_position_acceptance": [round(a / d, 4) if d else None for a, d in zip(acc_pos, dr_pos)],
                "parity": {s: sum(r["parity"] == s for r in rs) for s in ("exact", "near-tie", "divergent")},
            }
            peers = [r["peer_tokens_per_s"] for r in rs if r.get("peer_tokens_per_s")]
            if peers:
                entry["peer_prompt_lookup_tokens_per_s"] = round(_median(peers), 2)
                entry["vs_peer"] = round(spec / _median(peers), 3)
            assisted = [r["peer_assisted_tokens_per_s"] for r in rs if r.get("peer_assisted_tokens_per_s")]
            if assisted:
                entry["peer_assisted_tokens_per_s"] = round(_median(assisted), 2)
                entry["vs_peer_assisted"] = round(spec / _median(assisted), 3)
            per[cat] = entry
        out[cfg] = per
    return out


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# specdecode bench: {meta['target']}", "",
             f"{meta['prompts']} prompts, temperature {meta['temperature']}, {meta['threads']} threads, "
             f"peak RSS {meta['rss_before_peer_mb']:.0f} MB before the peer loads, {meta['peak_rss_mb']:.0f} MB in all",
             f"peer: {meta.get('peer')}", ""]
    for cfg, per in summary.items():
        lines += [f"## {cfg}", "",
                  "| category | decode tok/s | plain tok/s | speedup | acceptance | mean accepted length | "
                  "prompt-lookup peer tok/s | assisted peer tok/s | parity exact/near-tie/divergent |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for cat, e in per.items():
            p = e["parity"]
            lines.append(f"| {cat} | {e['decode_tokens_per_s']} | {e['plain_decode_tokens_per_s']} | "
                         f"{e['speedup']}x | {e['acceptance_rate']} | {e['mean_accepted_length']} | "
                         f"{e.get('peer_prompt_lookup_tokens_per_s', '-')} | "
                         f"{e.get('peer_assisted_tokens_per_s', '-')} | "
                         f"{p['exact']}/{p['near-tie']}/{p['divergent']} |")
        lines.append("")
    return "\n".join(lines)


def plots(summary: dict, rows: list[dict], out: Path) -> list[str]:
    """speedup by category, acceptance by draft position, tokens/s against K (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []

    def save(fig, ax, name: str) -> None:
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    cfgs = list(summary)
    cats = [c for c in next(iter(summary.values())) if c != "overall"] + ["overall"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(cfgs))
    for i, cfg in enumerate(cfgs):
        vals = [summary[cfg].get(c, {}).get("speedup") or 0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], vals, width, label=cfg)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + width * (len(cfgs) - 1) / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding (x)")
    save(fig, ax, "speedup_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for cfg in cfgs:
        acc = summary[cfg]["overall"]["per_position_acceptance"]
        if acc:
            ax.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc], marker="o", label=cfg)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted")
    ax.set_ylim(0, 1.05)
    save(fig, ax, "acceptance_by_position.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    by_draft: dict = {}
    for cfg in cfgs:
        draft, k = parse_config(cfg)
        if k != "auto":
            by_draft.setdefault(draft, []).append((k, summary[cfg]["overall"]["decode_tokens_per_s"]))
        else:
            ax.axhline(summary[cfg]["overall"]["decode_tokens_per_s"], ls="--", lw=1, label=f"{cfg}")
    for draft, pts in by_draft.items():
        pts.sort()
        ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=f"{draft}, fixed K")
    plain = _median([r["plain_tokens_per_s"] for r in rows])
    ax.axhline(plain, color="black", lw=0.8, label="plain")
    ax.set_xlabel("num_speculative_tokens (K)")
    ax.set_ylabel("decode tokens/s (median)")
    save(fig, ax, "tokens_per_s_vs_k.png")
    return files


class PromptLookupPeer:
    """llama-cpp-python's own prompt-lookup decoding on the same GGUF (greedy)."""

    def __init__(self, path: Path, n_ctx: int, n_threads: int, num_pred_tokens: int = 10):
        import llama_cpp.llama_cpp as lib  # the module llama_cpp.llama.Llama calls into
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from .backends.llama_cpp import extra_buffers_are_safe

        # Llama() has no option for llama.cpp's extra buffer types; give it the same
        # setting as our backend (see extra_buffers_are_safe: the AMX buffer crashes) for
        # the one call.
        default_params = lib.llama_model_default_params
        safe = extra_buffers_are_safe()

        def params():
            mp = default_params()
            mp.use_extra_bufts = safe
            return mp

        lib.llama_model_default_params = params
        try:
            # logits_all=True: with a draft model Llama evaluates many positions per call, but
            # sizes its score buffer from this argument (n_batch rows otherwise, which
            # overflows on prompts longer than n_batch).
            self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                             logits_all=True,
                             draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens), verbose=False)
        finally:
            lib.llama_model_default_params = default_params

    def run(self, ids: list[int], max_tokens: int) -> tuple[int, float]:
        """Generate greedily; returns (tokens, decode tokens/s as :func:`decode_rate`)."""
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        self.llm.reset()
        for chunk in self.llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, stream=True):
            if chunk["choices"][0]["finish_reason"] is not None:
                continue  # the closing chunk carries no token
            n += 1
            last = time.perf_counter() - t0
            if n == 1:
                first = last
        return n, decode_rate(n, first, last)


class TransformersPeer:
    """transformers' own speculative decoding on the torch target (greedy): prompt lookup
    (``prompt_lookup_num_tokens``) and, given a draft model, assisted generation
    (``assistant_model``, transformers' default schedule). Times tokens as they stream."""

    def __init__(self, model, eos_ids, assistant=None, num_pred_tokens: int = 10):
        self.model = model
        self.eos = sorted(eos_ids)
        self.assistant = assistant
        self.num_pred_tokens = num_pred_tokens

    def run(self, ids: list[int], max_tokens: int, assisted: bool = False) -> tuple[int, float]:
        """Generate greedily; returns (tokens, decode tokens/s as :func:`decode_rate`)."""
        import torch
        from transformers.generation.streamers import BaseStreamer

        marks: list[float] = []
        counts: list[int] = []
        t0 = time.perf_counter()

        class Clock(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # the first call carries the prompt
                    self.prompt_seen = True
                    return
                marks.append(time.perf_counter() - t0)
                counts.append(int(value.numel()))

            def end(self):
                pass

        device = next(self.model.parameters()).device
        inp = torch.tensor([ids], device=device)
        kw = {"assistant_model": self.assistant} if assisted else {"prompt_lookup_num_tokens": self.num_pred_tokens}
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.eos or None,
                                      pad_token_id=self.eos[0] if self.eos else None, streamer=Clock(), **kw)
        n = int(out.shape[1]) - len(ids)
        span = marks[-1] - marks[0] if marks else 0.0
        # As decode_rate: the tokens after the first chunk over the time after it (a first
        # assisted step may commit several tokens at once).
        return n, (n - counts[0]) / span if span > 0 else 0.0


def torch_draft_model(engines: dict):
    """The first draft model on the torch backend among the engines' drafters, or None."""
    from .backends.torch_backend import TorchBackend
    from .drafters import ModelDrafter

    for eng in engines.values():
        d = eng.drafter
        for cand in [d] + [src.drafter for src in getattr(d, "sources", [])]:
            if isinstance(cand, ModelDrafter) and isinstance(cand.backend, TorchBackend):
                return cand.backend.model
    return None


def run_bench(args) -> dict:
    from . import models
    from .api import AUTO_KMAX, Decoder, make_controller, make_drafter
    from .backends.llama_cpp import LlamaCppBackend
    from .engine import SpeculativeEngine
    from .parity import parity_report
    from .sampling import SamplingParams

    prompts = load_prompts(args.prompts, args.max_tokens)
    if args.categories:
        wanted = set(args.categories.split(","))
        prompts = [p for p in prompts if p.category in wanted]
    if args.per_category:
        seen: dict = {}
        prompts = [p for p in prompts if seen.setdefault(p.category, []).append(p) or len(seen[p.category]) <= args.per_category]
    if not prompts:
        raise SpecDecodeError("no prompts left after --categories / --per-category")
    configs = [parse_config(c) for c in (args.config or ["auto:auto"])]
    names = [f"{d}:{k}" for d, k in configs]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)

    dec = Decoder(target=args.target, draft="none", num_speculative_tokens=0, n_ctx=args.ctx_size,
                  n_threads=args.threads, progress=not args.quiet, backend=args.backend,
                  dtype=args.dtype, device=args.device)
    target = dec.target
    plain_engine = dec.engine
    opts = dict(n_ctx=args.ctx_size, n_threads=args.threads, progress=not args.quiet, backend=args.draft_backend,
                dtype=args.dtype, device=args.device, draft_vocab=args.draft_vocab)
    engines = {}
    for (draft, k), name in zip(configs, names):
        if k == "auto":
            engines[name] = SpeculativeEngine(target, make_controller(draft, target, kmax=AUTO_KMAX, **opts), AUTO_KMAX)
        else:
            engines[name] = SpeculativeEngine(target, make_drafter(draft, target, **opts), k)

    def ids_of(p: BenchPrompt) -> list[int]:
        return dec.prompt_ids(p.prompt, p.messages)

    # Warm-up: one short run of each engine.
    w = ids_of(prompts[0])
    plain_engine.generate(w, sampling=params, max_tokens=8)
    for eng in engines.values():
        eng.generate(w, sampling=params, max_tokens=8)

    from tqdm import tqdm

    rss_specdecode = peak_rss_mb()  # target, drafters and caches loaded and warmed up; before the peer
    peer, peer_note, assisted_peer = None, None, False
    if args.peer and not isinstance(target, LlamaCppBackend) and hasattr(target, "model"):
        try:
            assistant = torch_draft_model(engines)
            peer = TransformersPeer(target.model, target.eog_ids, assistant)
            peer.run(w, 8)
            peer_note = "transformers generate(prompt_lookup_num_tokens=10), greedy"
            if assistant is not None:
                peer.run(w, 8, assisted=True)
                assisted_peer = True
                peer_note += "; transformers generate(assistant_model=<the torch draft>), greedy"
        except Exception as e:  # a peer that cannot run is reported, not fatal
            peer, peer_note = None, f"transformers peers not run: {type(e).__name__}: {e}"
    if args.peer and isinstance(target, LlamaCppBackend):
        try:
            # The peer keeps an n_ctx x vocabulary score buffer; 2048 positions hold every
            # built-in prompt with its answer.
            peer = PromptLookupPeer(models.resolve(args.target), min(args.ctx_size, 2048), target.n_threads)
            peer.run(w, 8)
            peer_note = "llama-cpp-python LlamaPromptLookupDecoding(num_pred_tokens=10), temperature 0"
        except Exception as e:  # a peer that cannot run is reported, not fatal
            peer, peer_note = None, f"llama-cpp-python prompt lookup not run: {type(e).__name__}: {e}"

    rows = []
    bar = tqdm(total=len(prompts) * (1 + len(engines)), desc="bench", unit="run", disable=args.quiet, file=sys.stderr,
               mininterval=5)
    for p in prompts:
        ids = ids_of(p)
        plain = plain_engine.generate(ids, sampling=params, max_tokens=p.max_tokens, record_top2_gaps=True)
        bar.update(1)
        ps = plain.stats
        plain_rate = decode_rate(ps.completion_tokens, ps.first_token_s, ps.prefill_s + ps.decode_s)
        peer_rate = assisted_rate = None
        if peer is not None:
            try:
                peer_rate = peer.run(ids, p.max_tokens)[1]
                if assisted_peer:
                    assisted_rate = peer.run(ids, p.max_tokens, assisted=True)[1]
            except Exception as e:  # one failed peer run must not lose the benchmark
                peer_note = f"{peer_note}; failed on {p.id}: {type(e).__name__}: {e}"
        for name, eng in engines.items():
            r = eng.generate(ids, sampling=params, max_tokens=p.max_tokens)
            bar.update(1)
            s = r.stats
            rows.append({
                "id": p.id, "category": p.category, "config": name,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "spec_tokens_per_s": decode_rate(s.completion_tokens, s.first_token_s, s.prefill_s + s.decode_s),
                "plain_tokens_per_s": plain_rate,
                "drafted": s.drafted, "accepted": s.accepted, "target_forward_passes": s.target_forward_passes,
                "accepted_per_position": s.accepted_per_position, "drafted_per_position": s.drafted_per_position,
                "k_histogram": {str(k): v for k, v in s.k_histogram.items()},
                "parity": parity_report(r, plain)["status"] if params.greedy else "n/a",
                "peer_tokens_per_s": peer_rate,
                "peer_assisted_tokens_per_s": assisted_rate,
            })
    bar.close()
    rss = peak_rss_mb()  # includes the peer's score buffer when the peer ran

    del peer
    dec.close()
    meta = {"target": args.target, "prompts": len(prompts), "temperature": args.temperature,
            "threads": target.n_threads if hasattr(target, "n_threads") else None, "peak_rss_mb": round(rss, 1),
            "rss_before_peer_mb": round(rss_specdecode, 1),
            "configs": names, "peer": peer_note, "prompts_file": str(args.prompts or "built-in suite")}
    summary = summarize(rows, names)
    return {"meta": meta, "summary": summary, "rows": rows}


def print_table(result: dict, file=sys.stdout) -> None:
    meta = result["meta"]
    print(f"target {meta['target']}, {meta['prompts']} prompts, temperature {meta['temperature']}, "
          f"peak RSS {meta['rss_before_peer_mb']:.0f} MB before the peer, {meta['peak_rss_mb']:.0f} MB in all", file=file)
    if meta.get("peer"):
        print(f"peer: {meta['peer']}", file=file)
    for cfg, per in result["summary"].items():
        print(f"\n{cfg}", file=file)
        assisted = any("peer_assisted_tokens_per_s" in e for e in per.values())
        print(f"  {'category':14} {'tok/s':>7} {'plain':>7} {'speedup':>8} {'accept':>7} {'len':>5} "
              f"{'peer':>7}{' assisted' if assisted else ''} {'parity e/n/d':>13}", file=file)
        for cat, e in per.items():
            p = e["parity"]
            peer = e.get("peer_prompt_lookup_tokens_per_s")
            extra = f" {e.get('peer_assisted_tokens_per_s', '-'):>8}" if assisted else ""
            print(f"  {cat:14} {e['decode_tokens_per_s']:7.2f} {e['plain_decode_tokens_per_s']:7.2f} "
                  f"{(e['speedup'] or 0):7.2f}x {e['acceptance_rate']:7.3f} {e['mean_accepted_length']:5.2f} "
                  f"{peer if peer is not None else '-':>7}{extra} {p['exact']:>5}/{p['near-tie']}/{p['divergent']}",
                  file=file)


def cmd_bench(args) -> int:
    result = run_bench(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))
        (out / "results.md").write_text(markdown(result["summary"], result["meta"]))
        result["meta"]["plots"] = plots(result["summary"], result["rows"], out)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def add_bench_parser(sub) -> None:
    from . import models
    from .cli import add_backend_options

    b = sub.add_parser("bench", help="benchmark speculative against plain decoding, per prompt category")
    b.add_argument("--target", default=models.DEFAULT_TARGET)
    b.add_argument("--prompts", default=None, help="JSON Lines prompt file (default: the built-in suite)")
    b.add_argument("--config", action="append", metavar="DRAFT[:K]",
                   help="a configuration to compare with plain decoding, e.g. auto:auto, ngram:4, "
                        "qwen2.5-coder-0.5b-instruct:3 (repeatable; default auto:auto)")
    b.add_argument("--categories", default=None, help="comma-separated categories to run")
    b.add_argument("--per-category", type=int, default=None, help="at most this many prompts per category")
    b.add_argument("--max-tokens", type=int, default=128, help="for prompts without their own max_tokens")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--ctx-size", type=int, default=4096)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--no-peer", dest="peer", action="store_false", help="skip llama-cpp-python's prompt lookup")
    b.add_argument("--out", default=None, help="folder for results.json, results.md and PNG plots")
    b.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    b.add_argument("--quiet", action="store_true")
    add_backend_options(b)
    b.set_defaults(func=cmd_bench)
