"""Benchmark the torch backend against plain decoding and transformers' own speculation.

Same process, same prompts, interleaved per prompt: plain decoding (specdecode, no
drafter), specdecode with the 0.5B draft, specdecode with ngram, transformers'
``generate(assistant_model=...)`` and ``generate(prompt_lookup_num_tokens=...)``, and
transformers' plain ``generate`` for reference. Greedy, the Qwen pair converted once to
Hugging Face folders (``specdecode models convert``). Also the torch draft scoring only
token ids below --draft-vocab plus the prompt's tokens (FR-Spec). On the CPU it also runs the same
0.5B draft in its registry form (GGUF, Q4_K_M) on llama.cpp drafting for the torch target
(cross-backend drafting): the same weights (the bf16 folders are dequantized from these
GGUFs), read quantized instead of in 16 bits.

    python benchmarks/torch_bench.py --device cpu --dtype bfloat16 --max-tokens 128 --out bench-out/torch.json

Prints a table of decode tokens/s, speedup over plain (ratio of medians), acceptance rate
and mean accepted length. Ratios are from one run on one machine; they are not tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = [
    "Add type hints and a docstring to every function below and return the whole file.\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs)\n\n"
    "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n\n"
    "def zscores(xs):\n    m = mean(xs)\n    s = variance(xs) ** 0.5\n    return [(x - m) / s for x in xs]\n",
    "Rename the variable `data` to `records` everywhere in this code and return the whole code.\n\n"
    "import json\n\ndef load(path):\n    with open(path) as f:\n        data = json.load(f)\n"
    "    data = [d for d in data if d.get('active')]\n    data.sort(key=lambda d: d['name'])\n"
    "    return data\n\ndef save(path, data):\n    with open(path, 'w') as f:\n        json.dump(data, f, indent=2)\n",
    "Write a Python class `LRUCache` with get and put methods, using collections.OrderedDict, "
    "with docstrings and a short usage example.",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="registry name or HF folder")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="registry name or HF folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--gguf-draft", default=None,
                    help="registry name or .gguf of the draft for a llama.cpp-drafted row "
                         "(default: --draft when it is a registry name and the device is cpu; 'none' to skip)")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="also run the torch draft scoring only ids < N plus the prompt's (FR-Spec); 0 to skip")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    from specdecode.assembly import registry
    from specdecode.backends.torch import TorchBackend
    from specdecode.backends.torch.runtime import resolve_device
    from specdecode.drafters import ModelDrafter, NgramDrafter, NoDrafter
    from specdecode.engine import SpeculativeEngine

    device = resolve_device(args.device)
    paths = {n: Path(n) if Path(n).is_dir() else registry.convert_to_hf(n, dtype=args.dtype)
             for n in (args.target, args.draft)}
    target = TorchBackend.load(paths[args.target], dtype=args.dtype, device=device, n_ctx=2048, name=args.target)
    draft = TorchBackend.load(paths[args.draft], dtype=args.dtype, device=device, n_ctx=2048, name=args.draft)
    tok = target.tokenizer
    K = args.num_speculative_tokens
    engines = {
        "plain": SpeculativeEngine(target, NoDrafter(), 0),
        "specdecode draft": SpeculativeEngine(target, ModelDrafter(draft, target=target), K),
        "specdecode ngram": SpeculativeEngine(target, NgramDrafter(), K),
    }
    if args.draft_vocab:
        # A second handle on the same draft weights, with its own cache and output subset.
        subset_draft = TorchBackend(draft.model, draft.tokenizer, n_ctx=2048, name=f"{args.draft} (subset)")
        engines[f"specdecode draft, vocab {args.draft_vocab}"] = SpeculativeEngine(
            target, ModelDrafter(subset_draft, target=target, vocab_subset=args.draft_vocab), K)
    gguf_draft = args.gguf_draft
    if gguf_draft is None and device == "cpu" and args.draft in registry.REGISTRY:
        gguf_draft = args.draft
    if gguf_draft and gguf_draft != "none":
        from specdecode.api import load_backend

        llama_draft = load_backend(gguf_draft, backend="llama.cpp", n_ctx=2048, progress=False)
        engines["specdecode draft on llama.cpp"] = SpeculativeEngine(
            target, ModelDrafter(llama_draft, target=target), K)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def run_hf(ids, **kw):
        inp = torch.tensor([ids], device=device)
        gen_cfg = dict(max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(inp, attention_mask=torch.ones_like(inp), **gen_cfg, **kw)
        sync()
        dt = time.perf_counter() - t0
        n = out.shape[1] - len(ids)
        return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}

    hf = {
        "transformers plain": {},
        "transformers assisted": {"assistant_model": draft.model, "num_assistant_tokens": K,
                                  "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0},
        "transformers prompt_lookup": {"prompt_lookup_num_tokens": K},
    }
    results: dict[str, list[dict]] = {name: [] for name in list(engines) + list(hf)}
    prompts = PROMPTS[: args.prompts]
    for pi, text in enumerate(prompts):
        ids = target.tokenize(target.apply_chat_template([{"role": "user", "content": text}]), add_special=False)
        if pi == 0:  # warm-up
            engines["plain"].generate(ids, max_tokens=8)
            run_hf(ids[:16])
        for name, eng in engines.items():
            sync()
            r = eng.generate(ids, max_tokens=args.max_tokens, record_top2_gaps=(name == "plain"))
            sync()
            s = r.stats
            results[name].append({"tokens": s.completion_tokens, "seconds": s.prefill_s + s.decode_s,
                                  "tokens_per_s": s.completion_tokens / (s.prefill_s + s.decode_s),
                                  "acceptance_rate": s.acceptance_rate,
                                  "mean_accepted_length": s.mean_accepted_length,
                                  "result": r})
            print(f"prompt {pi} {name}: {results[name][-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
        for name, kw in hf.items():
            results[name].append(run_hf(ids, **kw))
            print(f"prompt {pi} {name}: {results[name][-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)

    base = statistics.median(r["tokens_per_s"] for r in results["plain"])
    assisted = statistics.median(r["tokens_per_s"] for r in results["transformers assisted"])
    rows = []
    for name, rs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        row = {"config": name, "tokens_per_s": round(tps, 2), "speedup_vs_plain": round(tps / base, 2),
               "vs_transformers_assisted": round(tps / assisted, 2)}
        if "acceptance_rate" in rs[0]:
            row["acceptance_rate"] = round(statistics.mean(r["acceptance_rate"] for r in rs), 3)
            row["mean_accepted_length"] = round(statistics.mean(r["mean_accepted_length"] for r in rs), 2)
        rows.append(row)
    from specdecode.parity import parity_report

    parity = {name: [parity_report(r["result"], p["result"])["status"] for r, p in zip(results[name], results["plain"])]
              for name in engines if name != "plain"}
    print(f"\n{args.target} target, {args.draft} draft ({args.dtype}; on llama.cpp: {gguf_draft}), "
          f"{args.dtype} on {device}, K={K}, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy (tokens/s include prefill)")
    print(f"{'config':30} {'tok/s':>7} {'vs plain':>9} {'vs HF assisted':>15} {'accept':>7} {'mean len':>9}")
    for r in rows:
        print(f"{r['config']:30} {r['tokens_per_s']:7.2f} {r['speedup_vs_plain']:8.2f}x {r['vs_transformers_assisted']:14.2f}x "
              f"{r.get('acceptance_rate', float('nan')):7.3f} {r.get('mean_accepted_length', float('nan')):9.2f}")
    print(f"parity with plain decoding per prompt (near-tie = first difference where plain's top-2 gap <= 0.5): "
          f"{parity}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "dtype": args.dtype, "k": K, "rows": rows,
                                        "parity_vs_plain": parity}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
