"""The llama-server peer's runs in the bench (:mod:`.llama_server`): timing each prompt on each of
its configurations, and the side-by-side table against specdecode's runs of the same prompts.

Ratios (per category and overall; above 1: specdecode faster):
- ``plain_decode``: specdecode's plain decode tokens/s over llama-server plain's (medians);
- ``plain_prompt``: prompt tokens/s read, the same two (summed tokens over summed seconds);
- ``vs_best[config]``: the best llama-server configuration's time to the whole answer (reading
  the prompt and generating, its generation scaled to specdecode's answer's length) over
  specdecode's with that configuration (its prefill and decode seconds), summed over the
  prompts; ``plain`` likewise for specdecode's plain runs; ``vs_best_decode[config]``: [the
  same after the prompt (generation alone, an editor's keystroke whose prompt is cached), the
  llama-server configuration that is best there].

Units: seconds, tokens/s.
"""

from __future__ import annotations

import statistics
import sys
from typing import Sequence, TextIO

from ..backends.fim import DEFAULT_EXTRA_FILE
from .suite import BenchPrompt


def fim_body(p: BenchPrompt) -> dict:
    """The /infill body llama.vim would send for a fill-in-the-middle bench prompt."""
    return {"input_prefix": p.prompt or "", "input_suffix": p.suffix or "", "prompt": "",
            "input_extra": [{"filename": name or DEFAULT_EXTRA_FILE, "text": text} for name, text in p.extra]}


def time_servers(servers: dict, p: BenchPrompt, ids: list[int], plain_tokens: list[int]) -> tuple[list[dict], str]:
    """Run prompt p on every llama-server configuration: one row each (config, prompt_n and
    whether it is specdecode's prompt length, seconds, tokens, decode rate, drafts, whether its
    tokens are specdecode's plain ones) and "" or a note on a failure."""
    rows, failed = [], []
    for config, server in servers.items():
        try:
            run = server.run(None, p.max_tokens, fim_body(p)) if p.fim else server.run(ids, p.max_tokens)
        except Exception as e:  # one failed peer run is noted, not fatal
            failed.append(f"{config} on {p.id}: {type(e).__name__}: {e}")
            continue
        rows.append({"id": p.id, "category": p.category, "config": config, "prompt_n": run.prompt_n,
                     "prompt_match": run.prompt_n == len(ids), "prompt_s": run.prompt_s,
                     "predicted_s": run.predicted_s, "completion_tokens": len(run.tokens),
                     "tokens_per_s": run.decode_rate, "draft_n": run.draft_n, "draft_accepted": run.draft_accepted,
                     "same_as_plain": run.tokens == list(plain_tokens)})
    return rows, "; ".join(failed)


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x]
    return statistics.median(xs) if xs else None


def _scaled(peer: dict, n: int, prompt: bool = True) -> float:
    """The peer's seconds to an answer of n tokens: its prompt's (where ``prompt``), and its
    generation's per token."""
    per = peer["predicted_s"] / peer["completion_tokens"] if peer["completion_tokens"] else 0.0
    return (peer["prompt_s"] if prompt else 0.0) + per * n


def summarize_servers(rows: list[dict], peer_rows: list[dict], configs: Sequence[str]) -> dict:
    """Per category and "overall": llama-server's rates per configuration, specdecode's plain and
    per configuration, and the ratios of the module docstring."""
    out: dict = {}
    cats = list(dict.fromkeys(r["category"] for r in peer_rows))
    for cat in cats + ["overall"]:
        peers = [r for r in peer_rows if cat == "overall" or r["category"] == cat]
        ids = {r["id"] for r in peers}
        mine = [r for r in rows if r["id"] in ids]
        if not peers or not mine:
            continue
        by_id = {}
        for r in mine:  # one plain run per prompt (the first variant's): its times from any row
            by_id.setdefault(r["id"], r)
        plain = list(by_id.values())
        entry: dict = {"prompts": len(ids), "llama_server": {}, "specdecode": {}}
        for config in dict.fromkeys(r["config"] for r in peers):
            ps = [r for r in peers if r["config"] == config]
            drafted = sum(r["draft_n"] for r in ps)
            entry["llama_server"][config] = {
                "decode_tokens_per_s": _round(_median([r["tokens_per_s"] for r in ps])),
                "acceptance_rate": round(sum(r["draft_accepted"] for r in ps) / drafted, 3) if drafted else None,
                "same_as_specdecode_plain": sum(r["same_as_plain"] for r in ps),
                "prompt_matches": sum(r["prompt_match"] for r in ps)}
        entry["specdecode"]["plain"] = {"decode_tokens_per_s": _round(_median([r["plain_tokens_per_s"] for r in plain]))}
        for name in configs:
            rs = [r for r in mine if r["config"] == name]
            if rs:
                entry["specdecode"][name] = {"decode_tokens_per_s": _round(_median([r["spec_tokens_per_s"] for r in rs]))}
        ls_plain = entry["llama_server"].get("plain", {}).get("decode_tokens_per_s")
        sd_plain = entry["specdecode"]["plain"]["decode_tokens_per_s"]
        entry["plain_decode"] = _round(sd_plain / ls_plain, 3) if ls_plain and sd_plain else None
        lp = [r for r in peers if r["config"] == "plain"]
        if lp:
            ls_rate = sum(r["prompt_n"] for r in lp) / max(1e-9, sum(r["prompt_s"] for r in lp))
            sd_rate = sum(r["prompt_tokens"] - 1 for r in plain) / max(1e-9, sum(r["plain_prefill_s"] for r in plain))
            entry["plain_prompt"] = _round(sd_rate / ls_rate, 3)
        entry["vs_best"], entry["best"], entry["vs_best_decode"] = {}, {}, {}
        for name, sd in [("plain", plain)] + [(c, [r for r in mine if r["config"] == c]) for c in configs]:
            if not sd:
                continue
            n_of = (lambda r: r["plain_completion_tokens"]) if name == "plain" else (lambda r: r["completion_tokens"])
            t_of = (lambda r: r["plain_prefill_s"] + r["plain_decode_s"]) if name == "plain" else \
                (lambda r: r["prefill_s"] + r["decode_s"])
            d_of = (lambda r: r["plain_decode_s"]) if name == "plain" else (lambda r: r["decode_s"])
            mine_s, mine_d = sum(t_of(r) for r in sd), sum(d_of(r) for r in sd)
            best = best_d = None
            for config in entry["llama_server"]:
                peer = {r["id"]: r for r in peers if r["config"] == config}
                if all(r["id"] in peer for r in sd):
                    s = sum(_scaled(peer[r["id"]], n_of(r)) for r in sd)
                    d = sum(_scaled(peer[r["id"]], n_of(r), prompt=False) for r in sd)
                    best = min(best, (s, config)) if best else (s, config)
                    best_d = min(best_d, (d, config)) if best_d else (d, config)
            if best and mine_s > 0:
                entry["vs_best"][name], entry["best"][name] = round(best[0] / mine_s, 3), best[1]
            if best_d and mine_d > 0:
                entry["vs_best_decode"][name] = [round(best_d[0] / mine_d, 3), best_d[1]]
        out[cat] = entry
    return out


def _round(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def print_servers(result: dict, file: TextIO = sys.stdout) -> None:
    """The side-by-side table (nothing where llama-server did not run)."""
    for line in server_lines(result):
        print(line, file=file)


def server_lines(result: dict) -> list[str]:
    summary = result.get("llama_server")
    if not summary:
        return []
    lines = ["", f"llama-server side by side: {result['meta'].get('llama_server')}"]
    for cat, e in summary.items():
        ls = "  ".join(f"{c} {v['decode_tokens_per_s']}" + (f" (accept {v['acceptance_rate']})" if v["acceptance_rate"]
                                                           is not None else "") for c, v in e["llama_server"].items())
        sd = "  ".join(f"{c} {v['decode_tokens_per_s']}" for c, v in e["specdecode"].items())
        same = e["llama_server"].get("plain", {}).get("same_as_specdecode_plain")
        match = min((v["prompt_matches"] for v in e["llama_server"].values()), default=0)
        lines.append(f"  {cat} ({e['prompts']} prompts): decode tok/s llama-server: {ls}")
        lines.append(f"  {'':{len(cat)}}   specdecode: {sd}")
        vs = "  ".join(f"{c} {x:.2f}x (vs {e['best'][c]}; after the prompt {e['vs_best_decode'][c][0]:.2f}x vs "
                       f"{e['vs_best_decode'][c][1]})" for c, x in e["vs_best"].items())
        lines.append(f"  {'':{len(cat)}}   plain/plain decode {_x(e.get('plain_decode'))}, prompt "
                     f"{_x(e.get('plain_prompt'))}; time to the whole answer vs llama-server's best: {vs}; "
                     f"plain text the same on {same}/{e['prompts']}, prompt tokens the same on {match}/{e['prompts']}")
    return lines


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"
