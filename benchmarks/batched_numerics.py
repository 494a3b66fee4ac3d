"""How much llama.cpp's logits of one sequence change with how it is batched.

specdecode's llama.cpp backend packs several sequences (and K+1 verification tokens per
sequence) into one llama_decode. Plain decoding evaluates one token of one sequence at a
time. This script measures, on the real backend (LlamaCppBackend, unchanged), the
difference between the logits of the same tokens at the same positions evaluated:

  prefill   a prompt prefilled alone vs beside 3 other prompts in one forward_batch
            (prompt on the same sequence id as alone, and on a different one)
  decode    greedy decoding, one token per forward: alone vs 4 sequences per forward
            (one token each; the batched run is fed the lone run's tokens so that every
            position is comparable; a "flip" is a position whose argmax differs)
  verify    a block of k tokens (k = 4, 16, 33) in one forward vs the same tokens one at
            a time (alone; and 4 blocks of 4 sequences in one forward_batch)
  controls  the lone run repeated; alone on another sequence id; alone with the other
            prompts resident in the (unified) KV cache

For each comparison and each compared logit row: max |logit difference| over the
vocabulary, and |change of the top-2 gap| (top-1 minus top-2 logit). Distributions are
reported as p50 / p99 / max over rows.

Settings (part of the cause search) are applied without editing the backend: the context
params are changed on their way into llama_init_from_model (flash_attn_type, n_ubatch,
kv_unified), the repack switch through SPECDECODE_LLAMA_REPACK, threads and n_batch
through the backend's constructor.

    python benchmarks/batched_numerics.py measure --model smollm2-135m-instruct \
        --config default --config fa0 ...          # numerics, one JSON per config
    python benchmarks/batched_numerics.py speed --model ... --config default ...
    python benchmarks/batched_numerics.py report   # tables.md from the JSON files

Configs (CONFIGS below) are changes from the backend's defaults: flash attention auto
(= on for CPU), n_batch = n_ubatch = 512, kv_unified on, weights' buffers per
specdecode.backends.llama_cpp.buffers, threads = the cores this process may use.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

OUT_DIR = Path(__file__).parent / "results" / "batched_numerics"

# "default" is the backend as shipped (flash attention auto = on, n_batch = n_ubatch = 512,
# kv_unified, buffers per llama_cpp.buffers.resolve_buffers, threads = the cores this process may use,
# 2 here). Every other config runs with 1 thread unless it says otherwise: on the 2 shared
# cores of this machine, with other processes running, 2 ggml threads spin-wait for each
# other and a one-token forward of smollm2 took 0.06-1.5 s instead of 0.006 s.
#   threads:      n_threads and n_threads_batch (the backend's n_threads argument)
#   threads_1tok: n_threads alone (llama.cpp uses it for ubatches of one token,
#                 n_threads_batch for larger ones)
#   n_ubatch:     tokens per ubatch (llama.cpp splits each llama_decode into ubatches)
#   n_batch:      the backend's n_batch (tokens per llama_decode; n_ubatch follows it)
#   flash_attn:   -1 auto, 0 off, 1 on;  kv_unified: bool;  repack: SPECDECODE_LLAMA_REPACK
BASE = {"threads": 1}
CONFIGS: dict[str, dict] = {"default": {}, **{name: {**BASE, **c} for name, c in {
    "base": {},
    "fa0": {"flash_attn": 0},
    "ubatch1": {"n_ubatch": 1},
    "ubatch4": {"n_ubatch": 4},
    "ubatch32": {"n_ubatch": 32},
    "ubatch63": {"n_ubatch": 63},
    "batch4": {"n_batch": 4},
    "unified0": {"kv_unified": False},
    "repack0": {"repack": "0"},
    "repack1": {"repack": "1"},
    "threads2": {"threads": 2},
    "fa0_ubatch1": {"flash_attn": 0, "n_ubatch": 1},
    "fa0_unified0": {"flash_attn": 0, "kv_unified": False},
    "ubatch1_threads2": {"n_ubatch": 1, "threads": 2},
    "ubatch32_threads2": {"n_ubatch": 32, "threads": 2},
    "ubatch32_1tok1": {"n_ubatch": 32, "threads": 2, "threads_1tok": 1},
    "ubatch32_repack0": {"n_ubatch": 32, "repack": "0"},
    "ubatch3": {"n_ubatch": 3},
    "ubatch7_repack0": {"n_ubatch": 7, "repack": "0"},
    "ubatch3_1tok1": {"n_ubatch": 3, "threads": 2, "threads_1tok": 1},
    "ubatch7_repack0_1tok1": {"n_ubatch": 7, "repack": "0", "threads": 2, "threads_1tok": 1},
    "ubatch32_repack0_1tok1": {"n_ubatch": 32, "repack": "0", "threads": 2, "threads_1tok": 1},
}.items()}}

CODE_PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):\n",
    "class Stack:\n    def __init__(self):\n",
    "// Reverse a C string in place.\nvoid reverse(char *s) {\n",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning Python.",
]
N_SEQ = 4
N_CTX = 2048
MAX_ROWS = 64  # the backend's MAX_OUTPUT_ROWS per sequence and call
KS = (4, 16, 33, 64)  # 64: diagnostic only (specdecode verifies at most K + 1 = 33)
OFFSETS = (0, 31)


# --- loading with settings --------------------------------------------------------------
@contextlib.contextmanager
def patched_context_params(flash_attn=None, n_ubatch=None, kv_unified=None, threads_1tok=None):
    """Change llama.cpp context params as the backend hands them to llama_init_from_model."""
    import llama_cpp

    orig = llama_cpp.llama_init_from_model

    def init(model, cparams):
        if flash_attn is not None:
            cparams.flash_attn_type = flash_attn  # -1 auto, 0 off, 1 on
        if n_ubatch is not None:
            cparams.n_ubatch = min(n_ubatch, cparams.n_batch)
        if kv_unified is not None:
            cparams.kv_unified = kv_unified
        if threads_1tok is not None:
            cparams.n_threads = threads_1tok
        return orig(model, cparams)

    llama_cpp.llama_init_from_model = init
    try:
        yield
    finally:
        llama_cpp.llama_init_from_model = orig


def load(model: str, cfg: dict):
    from specdecode.assembly.registry import resolve
    from specdecode.backends.llama_cpp import LlamaCppBackend

    old = os.environ.get("SPECDECODE_LLAMA_REPACK")
    if "repack" in cfg:
        os.environ["SPECDECODE_LLAMA_REPACK"] = cfg["repack"]
    try:
        with patched_context_params(cfg.get("flash_attn"), cfg.get("n_ubatch"), cfg.get("kv_unified"),
                                    cfg.get("threads_1tok")):
            kw = {"n_ctx": N_CTX, "n_seq": N_SEQ, "name": model}
            if "threads" in cfg:
                kw["n_threads"] = cfg["threads"]
            if "n_batch" in cfg:
                kw["n_batch"] = cfg["n_batch"]
            return LlamaCppBackend(resolve(model), **kw)
    finally:
        if old is None:
            os.environ.pop("SPECDECODE_LLAMA_REPACK", None)
        else:
            os.environ["SPECDECODE_LLAMA_REPACK"] = old


def prompts(b, which: str = "short") -> list[list[int]]:
    """short: 4 code prompts (raw) and 4 chat prompts (chat template), 6-40 tokens.
    long: 2 raw and 2 chat prompts of 500-700 tokens (slices of the standard library's
    textwrap.py), so that one sequence alone fills >= 512 KV cells."""
    if which == "gen":  # 2 code and 2 chat prompts of the short set, for long generations
        raw, chat = CODE_PROMPTS[:2], CHAT_PROMPTS[1:3]
    elif which == "long":
        import textwrap

        src = open(textwrap.__file__, encoding="utf-8").read()
        raw = [src[0:2400], src[2400:4800]]
        chat = ["Explain what this code does:\n\n" + src[4800:7000], "Find a bug in this code:\n\n" + src[7000:9200]]
    else:
        raw, chat = CODE_PROMPTS, CHAT_PROMPTS
    out = [b.tokenize(p) for p in raw]
    for p in chat:
        text = b.apply_chat_template([{"role": "user", "content": p}])
        out.append(b.tokenize(text, add_special=False, parse_special=True))
    return out


def clear(b) -> None:
    for s in range(b.n_seq):
        b.rollback(0, s)


# --- comparison -------------------------------------------------------------------------
def top2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """argmax [M] and top-1 minus top-2 logit [M] of logits [M, V]."""
    part = np.partition(x, -2, axis=1)[:, -2:]
    return x.argmax(axis=1), part[:, 1] - part[:, 0]


class Acc:
    """Rows of one comparison: reference (lone / one-at-a-time) vs candidate."""

    def __init__(self) -> None:
        self.maxabs: list[float] = []
        self.dgap: list[float] = []
        self.flips: list[dict] = []
        self.rows = 0

    def add(self, ref: np.ndarray, cand: np.ndarray, tag: str = "", pos0: int = 0) -> None:
        assert ref.shape == cand.shape, (ref.shape, cand.shape)
        d = np.abs(ref.astype(np.float64) - cand.astype(np.float64)).max(axis=1)
        a_ref, g_ref = top2(ref)
        a_c, g_c = top2(cand)
        self.maxabs += d.tolist()
        self.dgap += np.abs(g_ref - g_c).tolist()
        self.rows += len(d)
        for j in np.nonzero(a_ref != a_c)[0]:
            self.flips.append({"where": tag, "row": int(pos0 + j), "ref_gap": round(float(g_ref[j]), 4),
                               "cand_gap": round(float(g_c[j]), 4)})

    def summary(self) -> dict:
        if not self.rows:
            return {"rows": 0}
        m, g = np.array(self.maxabs), np.array(self.dgap)
        return {
            "rows": self.rows,
            "identical_rows": int((m == 0).sum()),
            "maxabs_p50": float(np.percentile(m, 50)), "maxabs_p99": float(np.percentile(m, 99)),
            "maxabs_max": float(m.max()),
            "dgap_p50": float(np.percentile(g, 50)), "dgap_p99": float(np.percentile(g, 99)),
            "dgap_max": float(g.max()),
            "flips": self.flips,
        }


# --- experiments ------------------------------------------------------------------------
def rows_of(n: int) -> list[int]:
    return list(range(max(0, n - MAX_ROWS), n))


def lone_prefill(b, toks, seq):
    clear(b)
    return b.forward(toks, rows_of(len(toks)), seq=seq)


def exp_prefill(b, P, acc: dict[str, Acc], full: bool = True) -> None:
    """full: every prompt alone on every sequence id, controls, and n batches (each prompt
    once at each id); else alone on its id in one batch of the first 4 prompts, repeat."""
    n = len(P)
    if not full:
        lone = {(i, i): lone_prefill(b, P[i], i) for i in range(N_SEQ)}
        acc["ctl_repeat"].add(lone[0, 0], lone_prefill(b, P[0], 0), "p0")
        clear(b)
        from specdecode.backends.base import SeqForward

        outs = b.forward_batch([SeqForward(i, P[i], rows_of(len(P[i]))) for i in range(N_SEQ)])
        for i, o in enumerate(outs):
            acc["prefill_batch_same_id"].add(lone[i, i], o, f"p{i} s{i}")
        return
    lone = {(i, s): lone_prefill(b, P[i], s) for i in range(n) for s in range(N_SEQ)}
    for i in range(n):  # controls: repeat, another sequence id, others resident in the cache
        acc["ctl_repeat"].add(lone[i, 0], lone_prefill(b, P[i], 0), f"p{i}")
        for s in range(1, N_SEQ):
            acc["ctl_other_seq_id"].add(lone[i, 0], lone[i, s], f"p{i} s{s}")
        clear(b)
        others = [(i + j) % n for j in range(1, N_SEQ)]
        for s, o in enumerate(others, start=1):
            b.forward(P[o], [len(P[o]) - 1], seq=s)
        acc["ctl_resident"].add(lone[i, 0], b.forward(P[i], rows_of(len(P[i])), seq=0), f"p{i}")
    for r in range(n):  # every prompt at every sequence id once
        group = [(r + j) % n for j in range(N_SEQ)]
        clear(b)
        from specdecode.backends.base import SeqForward

        outs = b.forward_batch([SeqForward(s, P[i], rows_of(len(P[i]))) for s, i in enumerate(group)])
        for s, (i, o) in enumerate(zip(group, outs)):
            acc["prefill_batch_same_id"].add(lone[i, s], o, f"p{i} s{s}")
            for t in range(N_SEQ):
                if t != s:
                    acc["prefill_batch_other_id"].add(lone[i, t], o, f"p{i} s{s} vs s{t}")


def lone_decode(b, toks, seq, steps):
    """Prefill alone, then greedy one token per forward: tokens [steps+1] fed / generated
    and logits [steps, V] of the one-token forwards."""
    clear(b)
    t = int(b.forward(toks, [len(toks) - 1], seq=seq)[0].argmax())
    fed, rows = [t], []
    for _ in range(steps):
        lg = b.forward([fed[-1]], [0], seq=seq)[0]
        rows.append(lg)
        fed.append(int(lg.argmax()))
    return fed, np.stack(rows)


def exp_decode_verify(b, P, steps, acc: dict[str, Acc], offsets=OFFSETS) -> dict:
    from specdecode.backends.base import SeqForward

    n = len(P)
    lone: dict[int, tuple[list[int], np.ndarray]] = {}
    first_flip: dict[str, dict] = {}
    for i in range(n):
        s = i % N_SEQ
        fed, rows = lone_decode(b, P[i], s, steps)
        lone[i] = (fed, rows)
        L = len(P[i])
        for o in sorted(offsets, reverse=True):  # verify block alone vs one at a time (same prefix)
            for k in KS:
                if o + k > steps:
                    continue
                b.rollback(L + o, s)
                blk = b.forward(fed[o:o + k], list(range(k)), seq=s)
                acc[f"verify_k{k}"].add(rows[o:o + k], blk, f"p{i} o{o}", o)
    for g0 in range(0, n, N_SEQ):
        group = list(range(g0, min(n, g0 + N_SEQ)))
        # prefill one by one (as alone), then all prompts in one forward (as Decoder(parallel=4)
        # admitting 4 requests at once); the decode steps batched after either
        for mode in ("bprefill", "lprefill"):
            clear(b)
            if mode == "lprefill":
                for s, i in enumerate(group):
                    b.forward(P[i], [len(P[i]) - 1], seq=s)
            else:
                b.forward_batch([SeqForward(s, P[i], [len(P[i]) - 1]) for s, i in enumerate(group)])
            outs = {i: [] for i in group}
            for step in range(steps):
                res = b.forward_batch([SeqForward(s, [lone[i][0][step]], [0]) for s, i in enumerate(group)])
                for i, r in zip(group, res):
                    outs[i].append(r[0])
            a = acc["decode_batch4" if mode == "lprefill" else "decode_batch4_after_batch_prefill"]
            for i in group:
                before = len(a.flips)
                a.add(lone[i][1], np.stack(outs[i]), f"p{i}")
                if len(a.flips) > before:
                    first_flip[f"{mode} p{i}"] = a.flips[before]
        for o in sorted(offsets, reverse=True):  # 4 blocks of k in one forward_batch vs one at a time
            for k in KS:
                if o + k > steps:
                    continue
                for s, i in enumerate(group):
                    b.rollback(len(P[i]) + o, s)
                res = b.forward_batch([SeqForward(s, lone[i][0][o:o + k], list(range(k)))
                                       for s, i in enumerate(group)])
                for i, r in zip(group, res):
                    acc[f"verify_batch4_k{k}"].add(lone[i][1][o:o + k], r, f"p{i} o{o}", o)
    return {"first_flip_decode": first_flip}


def cpu_info() -> dict:
    name, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model_name": name, "avx512f": "avx512f" in flags, "amx": sorted(f for f in flags if f.startswith("amx")),
            "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version()}


class Accs(dict):
    def __missing__(self, k):
        self[k] = Acc()
        return self[k]


def measure(model: str, cfg_name: str, steps: int, n_prompts: int, sets: list[str], long_steps: int,
            gen_steps: int = 448) -> dict:
    import llama_cpp

    cfg = CONFIGS[cfg_name]
    t0 = time.time()
    b = load(model, cfg)
    results, extra, lengths = {}, {}, {}
    for which in sets:
        P = prompts(b, which)
        if which == "short":
            P = P[:n_prompts // 2] + P[len(P) // 2:][:n_prompts - n_prompts // 2]  # code and chat
        lengths[which] = [len(p) for p in P]
        acc = Accs()
        if which == "gen":  # long generations from short prompts: decode and verify only
            extra[which] = exp_decode_verify(b, P, gen_steps, acc, offsets=(0, gen_steps // 2, gen_steps - 33))
        else:
            exp_prefill(b, P, acc, full=which == "short")
            extra[which] = exp_decode_verify(b, P, steps if which == "short" else long_steps, acc)
        results[which] = {k: v.summary() for k, v in acc.items()}
    b.close()
    return {
        "model": model, "config": cfg_name, "settings": cfg, "steps": steps, "long_steps": long_steps,
        "gen_steps": gen_steps,
        "repack_effective": cfg.get("repack", "0" if b.buffers == "none" else "1"),
        "llama_cpp_python": llama_cpp.__version__, "prompt_tokens": lengths,
        "seconds": round(time.time() - t0, 1), "cpu": cpu_info(), "loadavg_end": os.getloadavg(),
        "results": results, "first_flips": extra,
    }


# --- speed ------------------------------------------------------------------------------
def speed(model: str, cfg_name: str, steps: int, reps: int) -> dict:
    """Best of reps: one-token decode of one sequence, 4 sequences one token each per forward,
    a block of 16 on one sequence, 4 blocks of 16 in one forward_batch (tokens/s), and the
    prefill of the first long prompt (tokens/s). Contexts: the 4 long prompts resident."""
    from specdecode.backends.base import SeqForward

    b = load(model, CONFIGS[cfg_name])
    P = prompts(b, "long")
    L = [len(p) for p in P]
    best = {"decode1": 0.0, "decode_batch4": 0.0, "verify_k16": 0.0, "verify_batch4_k16": 0.0, "prefill": 0.0}

    def keep(k, n, t):
        best[k] = max(best[k], n / (time.perf_counter() - t))

    for _ in range(reps):
        clear(b)
        t = time.perf_counter()
        b.forward(P[0], [L[0] - 1], seq=0)
        keep("prefill", L[0], t)
        for s in range(1, N_SEQ):
            b.forward(P[s], [L[s] - 1], seq=s)
        b.forward([100], [0], seq=0)  # warm-up
        b.rollback(L[0], 0)
        t = time.perf_counter()
        for j in range(steps):
            b.forward([100 + j], [0], seq=0)
        keep("decode1", steps, t)
        b.rollback(L[0], 0)
        t = time.perf_counter()
        for j in range(steps):
            b.forward_batch([SeqForward(s, [100 + j], [0]) for s in range(N_SEQ)])
        keep("decode_batch4", N_SEQ * steps, t)
        n = max(2, steps // 8)
        t = time.perf_counter()
        for j in range(n):
            b.rollback(L[0], 0)
            b.forward(list(range(200, 216)), list(range(16)), seq=0)
        keep("verify_k16", 16 * n, t)
        t = time.perf_counter()
        for j in range(n):
            for s in range(N_SEQ):
                b.rollback(L[s], s)
            b.forward_batch([SeqForward(s, list(range(200, 216)), list(range(16))) for s in range(N_SEQ)])
        keep("verify_batch4_k16", N_SEQ * 16 * n, t)
    b.close()
    return {"model": model, "config": cfg_name, "settings": CONFIGS[cfg_name], "steps": steps, "reps": reps,
            "context_tokens": L, **{k + "_tok_s": round(v, 2) for k, v in best.items()},
            "loadavg_end": os.getloadavg()}


# --- report -----------------------------------------------------------------------------
ORDER = ["prefill_batch_same_id", "prefill_batch_other_id", "decode_batch4", "decode_batch4_after_batch_prefill",
         "verify_k4", "verify_k16", "verify_k33", "verify_batch4_k4", "verify_batch4_k16", "verify_batch4_k33",
         "verify_k64", "verify_batch4_k64", "ctl_repeat", "ctl_other_seq_id", "ctl_resident"]
# what specdecode does (k <= 33 tokens a sequence); verify_k64 is a diagnostic, ctl_* are controls
ENGINE = [k for k in ORDER if not k.startswith("ctl") and not k.endswith("k64")]


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def detail_table(r: dict, which: str) -> list[str]:
    lines = [f"\n#### {r['model']}, `{r['config']}` {r['settings']}, {which} prompts "
             f"({r['prompt_tokens'][which]} tokens; repack {r['repack_effective']})\n",
             "| comparison | rows | identical | max\\|dlogit\\| p50 | p99 | max | \\|dgap\\| p99 | max | flips: lone gap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in ORDER:
        s = r["results"][which].get(k)
        if not s or not s["rows"]:
            continue
        gaps = sorted({f["ref_gap"] for f in s["flips"]}, reverse=True)
        fl = f"{len(s['flips'])}" + (f": max {gaps[0]:.3g}" if gaps else "")
        lines.append(f"| {k} | {s['rows']} | {s['identical_rows']} | {fmt(s['maxabs_p50'])} | "
                     f"{fmt(s['maxabs_p99'])} | {fmt(s['maxabs_max'])} | {fmt(s['dgap_p99'])} | "
                     f"{fmt(s['dgap_max'])} | {fl} |")
    return lines


def summary_row(r: dict, which: str, keys: list[str]) -> str:
    res = r["results"].get(which, {})
    keys = [k for k in keys if res.get(k, {}).get("rows")]
    if not keys:
        return ""
    rows = sum(res[k]["rows"] for k in keys)
    ident = sum(res[k]["identical_rows"] for k in keys)
    flips = [f for k in keys for f in res[k]["flips"]]
    return (f"| {r['model'].split('-')[0]} | {r['config']} | {which} | {fmt(max(res[k]['maxabs_max'] for k in keys))} | "
            f"{fmt(max(res[k]['maxabs_p99'] for k in keys))} | {fmt(max(res[k]['dgap_max'] for k in keys))} | "
            f"{fmt(max(res[k]['dgap_p99'] for k in keys))} | {len(flips)}"
            f"{' (max lone gap %.3g)' % max(f['ref_gap'] for f in flips) if flips else ''} | {ident}/{rows} |")


def report() -> str:
    runs = [json.loads(f.read_text()) for f in sorted(OUT_DIR.glob("numerics_*.json"))]
    lines = ["### Summary: batched vs lone, over the comparisons the engine makes",
             "(prefill beside 3 others, decode 4 per forward, verify k = 4/16/33 alone and 4 per forward;",
             "max and p99 of the per-row max over the vocabulary; k = 64 and the controls excluded)\n",
             "| model | config | prompts | max \\|dlogit\\| | p99 | max \\|dgap\\| | p99 | flips | identical rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for which in r["results"]:
            row = summary_row(r, which, ENGINE)
            if row:
                lines.append(row)
    lines += ["\n### Single-sequence verification only (verify_k4/16/33 vs one token at a time)\n",
              "| model | config | prompts | max \\|dlogit\\| | p99 | max \\|dgap\\| | p99 | flips | identical rows |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for which in r["results"]:
            row = summary_row(r, which, ["verify_k4", "verify_k16", "verify_k33"])
            if row:
                lines.append(row)
    sp = [json.loads(f.read_text()) for f in sorted(OUT_DIR.glob("speed_*.json"))]
    if sp:
        lines += ["\n### Speed (tokens/s, best of reps; 4 long prompts resident; other processes were running)\n",
                  "| model | config | 1-token decode | 4-seq decode | verify k=16 | 4 x verify k=16 | prefill |",
                  "|---|---|---|---|---|---|---|"]
        for s in sp:
            lines.append(f"| {s['model'].split('-')[0]} | {s['config']} | {s['decode1_tok_s']} | "
                         f"{s['decode_batch4_tok_s']} | {s['verify_k16_tok_s']} | {s['verify_batch4_k16_tok_s']} | "
                         f"{s['prefill_tok_s']} |")
    lines.append("\n## Details")
    for r in runs:
        for which in r["results"]:
            lines += detail_table(r, which)
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["measure", "speed", "report"])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS))
    ap.add_argument("--sets", default="short,long",
                    help="prompt sets measured, comma-separated: short, long, gen (4 short prompts, --gen-steps "
                         "decode steps, verify at 3 offsets; no prefill comparison)")
    ap.add_argument("--gen-steps", type=int, default=448, help="decode steps of the gen set")
    ap.add_argument("--steps", type=int, default=64, help="decode steps, short prompts (measure); timed steps (speed)")
    ap.add_argument("--long-steps", type=int, default=40, help="decode steps, long prompts")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="short prompts measured (half code, half chat; 4-8)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if a.what == "report":
        (OUT_DIR / "tables.md").write_text(report())
        print(OUT_DIR / "tables.md")
        return 0
    short = a.model.split("-")[0]
    for c in a.config or ["default"]:
        if a.what == "measure":
            res = measure(a.model, c, a.steps, a.prompts, a.sets.split(","), a.long_steps, a.gen_steps)
        else:
            res = speed(a.model, c, a.steps, a.reps)
        kind = "numerics" if a.what == "measure" else "speed"
        tail = "" if a.what == "speed" or a.sets == "short,long" else "_" + a.sets.replace(",", "+")
        path = OUT_DIR / f"{kind}_{short}_{c}{tail}.json"
        path.write_text(json.dumps(res, indent=1))
        if a.what == "measure":
            print(f"{a.model} {c} ({res['seconds']} s):")
            for which, rr in res["results"].items():
                for k in ORDER:
                    s = rr.get(k)
                    if s and s["rows"]:
                        print(f"  {which:5s} {k:34s} rows {s['rows']:5d} ident {s['identical_rows']:5d} maxabs p99 "
                              f"{s['maxabs_p99']:.4g} max {s['maxabs_max']:.4g} dgap p99 {s['dgap_p99']:.4g} "
                              f"max {s['dgap_max']:.4g} flips {len(s['flips'])}")
        else:
            print(json.dumps(res))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
