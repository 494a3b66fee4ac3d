"""Summaries and reports of a bench result: per-category statistics, a Markdown table,
PNG plots (matplotlib, imported only when plotting) and the terminal table.

Units: tokens/s for rates (medians over prompts), MB for resident memory, speedups are
ratios of medians; the oracle's speedup is a ratio of summed modelled times (seconds, see
:mod:`.oracle`).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Sequence, TextIO

from .llama_server_report import print_servers, server_lines
from .config import WITH_PREDICTION, WITH_TREES, config_of, run_label
from .suite import CATEGORIES, parse_config

PARITY_STATES = ("exact", "near-tie", "divergent")


def _median(xs: Sequence[float]) -> float:
    # Rates of 0 mean "not measurable" (one token, or no span); they would drag medians down.
    xs = [x for x in xs if x > 0]
    return statistics.median(xs) if xs else 0.0


def _per_position(rows: list[dict], key: str, width: int) -> list[int]:
    return [sum(r[key][i] for r in rows if i < len(r[key])) for i in range(width)]


def _oracle(rs: list[dict], speedup: float | None) -> dict:
    """oracle_speedup: summed plain over summed oracle times of the rows (None unless every
    row has them); oracle_fraction: the measured speedup over it."""
    plain_s = [r.get("oracle_plain_time_s") for r in rs]
    oracle_s = [r.get("oracle_time_s") for r in rs]
    if any(x is None for x in plain_s + oracle_s) or not sum(oracle_s):
        return {"oracle_speedup": None, "oracle_fraction": None}
    oracle = sum(plain_s) / sum(oracle_s)
    return {"oracle_speedup": round(oracle, 3), "oracle_fraction": round(speedup / oracle, 3) if speedup else None}


def plain_time_for(r: dict) -> float | None:
    """A row's plain time to the whole answer, for an answer as long as the speculative one: where
    the two differ in length (a near-tie sent greedy decoding another way, and one answer ended
    sooner), the plain seconds scaled by the ratio of their tokens, so that a longer answer is not
    counted as a slower one (rows of older versions, without the plain answer's length: as they are)."""
    plain_s, n, n_plain = r.get("plain_decode_s"), r.get("completion_tokens"), r.get("plain_completion_tokens")
    if not plain_s or not n or not n_plain or n == n_plain:
        return plain_s
    return plain_s * n / n_plain


def _times(rs: list[dict]) -> dict:
    """time_speedup: the rows' summed plain over summed speculative time to the whole answer
    (``decode_s``: from the end of the prefill to the last token, the first token included; the
    plain time for an answer of the speculative one's length, :func:`plain_time_for`);
    lowest_time_speedup: the lowest one row's ratio. None where a row lacks the times (results
    of older versions) or one is 0."""
    pairs = [(plain_time_for(r), r.get("decode_s")) for r in rs]
    if not pairs or any(not p or not s for p, s in pairs):
        return {"time_speedup": None, "lowest_time_speedup": None}
    return {"time_speedup": round(sum(p for p, _ in pairs) / sum(s for _, s in pairs), 3),
            "lowest_time_speedup": round(min(p / s for p, s in pairs), 3)}


def prompt_lines(result: dict, categories: Sequence[str] = ("fim",)) -> list[str]:
    """One line per run of the prompts in ``categories`` (the fill-in-the-middle ones: what a user
    waits for is the whole middle): its configuration, tokens and why it ended, the plain and
    speculative seconds to the whole answer and their ratio, drafts accepted, parity."""
    rows = [r for r in result.get("rows", ()) if r["category"] in categories and r.get("decode_s")]
    if not rows:
        return []
    out = [f"per prompt ({', '.join(categories)}): seconds to the whole answer after the prompt, plain / speculative"]
    for r in rows:
        plain_s = plain_time_for(r)
        out.append(f"  {r['id']:38} {run_label(r['config'], r.get('vary')):14} {r['completion_tokens']:4} tok "
                   f"{r['finish_reason']:6} {plain_s:6.2f} s {r['decode_s']:6.2f} s "
                   f"{plain_s / r['decode_s']:5.2f}x  accepted {r['accepted']}/{r['drafted']}  {r['parity']}")
    return out


def summarize(rows: list[dict], configs: list[str]) -> dict:
    """Per run name (``configs``: a configuration, "CONFIG [SETTING=VALUE]" with --vary; a row
    counts under :func:`specdecode.bench.config.run_label` of its config and vary), per category
    and "overall": median decode tokens/s (speculative,
    plain, peers), speedup, the time to the whole answer (:func:`_times`), acceptance rate, mean accepted length, per-position acceptance,
    parity counts, and the oracle's speedup and the fraction of it reached (None where the
    rows have no oracle times: sampling, draft models). A peer's ratio (vs_peer,
    vs_peer_assisted) sets the rows that peer ran on against the same rows' speculative
    rate."""
    cats = sorted({r["category"] for r in rows}, key=lambda c: (CATEGORIES + (c,)).index(c))
    out: dict = {}
    for cfg in configs:
        per: dict = {}
        for cat in cats + ["overall"]:
            rs = [r for r in rows if run_label(r["config"], r.get("vary")) == cfg
                  and (cat == "overall" or r["category"] == cat)]
            if not rs:
                continue
            spec = _median([r["spec_tokens_per_s"] for r in rs])
            plain = _median([r["plain_tokens_per_s"] for r in rs])
            speedup = round(spec / plain, 3) if plain else None
            drafted = sum(r["drafted"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            tokens = sum(r["completion_tokens"] for r in rs)
            passes = sum(r["target_forward_passes"] for r in rs)
            width = max((len(r["accepted_per_position"]) for r in rs), default=0)
            acc_pos = _per_position(rs, "accepted_per_position", width)
            dr_pos = _per_position(rs, "drafted_per_position", width)
            entry = {
                "prompts": len(rs),
                "decode_tokens_per_s": round(spec, 2),
                "plain_decode_tokens_per_s": round(plain, 2),
                "speedup": speedup,
                **_oracle(rs, speedup),
                **_times(rs),
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_accepted_length": round(tokens / passes, 3) if passes else 0.0,
                "per_position_acceptance": [round(a / d, 4) if d else None for a, d in zip(acc_pos, dr_pos)],
                "parity": {s: sum(r["parity"] == s for r in rs) for s in PARITY_STATES},
            }
            for row_key, rate_key, ratio_key in (
                    ("peer_tokens_per_s", "peer_prompt_lookup_tokens_per_s", "vs_peer"),
                    ("peer_assisted_tokens_per_s", "peer_assisted_tokens_per_s", "vs_peer_assisted")):
                # Over the rows the peer ran on (it skips prompts with a grammar, and may fail).
                timed = [r for r in rs if r.get(row_key)]
                peer = _median([r[row_key] for r in timed])
                if peer:
                    entry[rate_key] = round(peer, 2)
                    entry[ratio_key] = round(_median([r["spec_tokens_per_s"] for r in timed]) / peer, 3)
            per[cat] = entry
        out[cfg] = per
    return out


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "-"


def markdown(summary: dict, meta: dict) -> str:
    """The summary as Markdown: a header with the run's settings, one table per configuration."""
    lines = [f"# specdecode bench: {meta['target']}", "",
             f"{meta['prompts']} prompts, temperature {meta['temperature']}, {meta['threads']} threads, "
             + (f"weights {meta['weights']}, " if meta.get("weights") else "") +
             f"peak RSS {meta['rss_before_peer_mb']:.0f} MB before the peer loads, {meta['peak_rss_mb']:.0f} MB in all",
             f"peer: {meta.get('peer')}", "",
             "oracle speedup: the greedy outputs replayed with the measured T(n), each step taking the "
             "lookup draft and K that commit the most tokens per second knowing the outcome (draft models "
             "are left out, so a configuration with one can pass it); of oracle: measured speedup / oracle speedup.",
             ""]
    for cfg, per in summary.items():
        lines += [f"## {cfg}", "",
                  "| category | decode tok/s | plain tok/s | speedup | oracle speedup | of oracle | acceptance | "
                  "mean accepted length | prompt-lookup peer tok/s | assisted peer tok/s | "
                  "parity exact/near-tie/divergent | time to the whole answer, speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cat, e in per.items():
            p = e["parity"]
            lines.append(f"| {cat} | {e['decode_tokens_per_s']} | {e['plain_decode_tokens_per_s']} | "
                         f"{e['speedup']}x | {_x(e.get('oracle_speedup'))} | {_pct(e.get('oracle_fraction'))} | "
                         f"{e['acceptance_rate']} | {e['mean_accepted_length']} | "
                         f"{e.get('peer_prompt_lookup_tokens_per_s', '-')} | "
                         f"{e.get('peer_assisted_tokens_per_s', '-')} | "
                         f"{p['exact']}/{p['near-tie']}/{p['divergent']} | {_x(e.get('time_speedup'))} |")
        lines.append("")
    return "\n".join(lines)


def plots(summary: dict, rows: list[dict], out: Path) -> list[str]:
    """Write speedup by category, acceptance by draft position and tokens/s against K as
    PNGs into ``out``; returns their file names. Raises ImportError without matplotlib."""
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
    oracle_label = "oracle (lookups, known outcomes)"
    for i, cfg in enumerate(cfgs):
        vals = [summary[cfg].get(c, {}).get("speedup") or 0 for c in cats]
        xs = [x + i * width for x in range(len(cats))]
        ax.bar(xs, vals, width, label=cfg)
        oracle = [(x, summary[cfg].get(c, {}).get("oracle_speedup")) for x, c in zip(xs, cats)]
        oracle = [(x, v) for x, v in oracle if v is not None]
        if oracle:  # a black tick over each bar: that configuration's oracle speedup
            ax.scatter([x for x, _ in oracle], [v for _, v in oracle], marker="_", s=300, color="black", zorder=3,
                       label=oracle_label)
            oracle_label = None
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
        name = config_of(cfg)  # the configuration's row name, without a varied setting's value
        base = name.removesuffix(WITH_PREDICTION).removesuffix(WITH_TREES)  # runs of the same configuration
        draft, k = parse_config(base)
        if k != "auto" and base == name:
            by_draft.setdefault(draft + cfg[len(name):], []).append((k, summary[cfg]["overall"]["decode_tokens_per_s"]))
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


def write_outputs(result: dict, out: Path) -> None:
    """Write results.json, results.md and the plots into folder ``out`` (created if
    missing); records the plot file names in ``result["meta"]["plots"]``. Raises OSError
    when the folder cannot be written, ImportError without matplotlib."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    per_prompt = prompt_lines(result)
    servers = server_lines(result)
    (out / "results.md").write_text(markdown(result["summary"], result["meta"]) + "\n".join(vary_markdown(result))
                                    + ("\n```\n" + "\n".join(per_prompt) + "\n```\n" if per_prompt else "")
                                    + ("\n```" + "\n".join(servers) + "\n```\n" if servers else ""))
    result["meta"]["plots"] = plots(result["summary"], result["rows"], out)


def print_table(result: dict, file: TextIO = sys.stdout) -> None:
    """The summary as a plain-text table, one block per configuration."""
    meta = result["meta"]
    print(f"target {meta['target']}, {meta['prompts']} prompts, temperature {meta['temperature']}, "
          f"peak RSS {meta['rss_before_peer_mb']:.0f} MB before the peer, {meta['peak_rss_mb']:.0f} MB in all", file=file)
    if meta.get("peer"):
        print(f"peer: {meta['peer']}", file=file)
    if meta.get("copy_limit"):
        at = "".join(f", {L:.2f}x after {c} tokens" for c, L in (meta.get("copy_limit_at") or {}).items())
        print(f"copy limit L = 33 T(1) / T(33) = {meta['copy_limit']:.2f}x (a perfect 32-token copy){at}", file=file)
    if meta.get("background_load"):
        print(f"beside a background CPU load of {meta['background_load']:.0%} of the machine", file=file)
    for cfg, per in result["summary"].items():
        print(f"\n{cfg}", file=file)
        assisted = any("peer_assisted_tokens_per_s" in e for e in per.values())
        print(f"  {'category':14} {'tok/s':>7} {'plain':>7} {'speedup':>8} {'time':>6} {'oracle':>7} {'of it':>6} "
              f"{'accept':>7} {'len':>5} "
              f"{'peer':>7}{' assisted' if assisted else ''} {'parity e/n/d':>13}", file=file)
        for cat, e in per.items():
            p = e["parity"]
            peer = e.get("peer_prompt_lookup_tokens_per_s")
            extra = f" {e.get('peer_assisted_tokens_per_s', '-'):>8}" if assisted else ""
            print(f"  {cat:14} {e['decode_tokens_per_s']:7.2f} {e['plain_decode_tokens_per_s']:7.2f} "
                  f"{(e['speedup'] or 0):7.2f}x {_x(e.get('time_speedup')):>6} {_x(e.get('oracle_speedup')):>7} {_pct(e.get('oracle_fraction')):>6} "
                  f"{e['acceptance_rate']:7.3f} {e['mean_accepted_length']:5.2f} "
                  f"{peer if peer is not None else '-':>7}{extra} {p['exact']:>5}/{p['near-tie']}/{p['divergent']}",
                  file=file)
    for line in prompt_lines(result):
        print(line, file=file)
    if meta.get("skipped"):
        print(f"skipped: {meta['skipped']}", file=file)
    print_vary(result, file)
    print_servers(result, file)


def _num(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def vary_table(result: dict) -> tuple[str, list[list[str]], list[str]]:
    """The ``--vary`` table of a result (as llama-bench prints one table over a setting's
    values): a title, rows of cells (the header first) and notes.

    Rows: plain decoding's and each configuration's decode tokens/s (medians over all prompts)
    at each value, each configuration's speedup over the same value's plain decoding, and how
    many of its runs gave that plain run's tokens; the last columns divide each later value by
    the first. Notes: what each value's target reported, each value's copy limit L, and how
    each later value's plain runs compare with the first's (greedy: parity exact / near-tie /
    divergent; sampling: the same tokens or not).
    """
    meta, summary = result["meta"], result["summary"]
    vary = meta["vary"]
    setting, values = vary["setting"], vary["values"]
    configs = list(dict.fromkeys(config_of(n) for n in meta["configs"]))

    def overall(cfg: str, v: str) -> dict:
        return summary.get(run_label(cfg, f"{setting}={v}"), {}).get("overall") or {}

    rows = [["run"] + [f"{setting}={v}" for v in values] + [f"{v} / {values[0]}" for v in values[1:]]]

    def line(name: str, nums: list, unit: str) -> None:
        ratios = [f"{x / nums[0]:.2f}x" if x and nums[0] else "-" for x in nums[1:]]
        rows.append([name] + [_num(x, unit) for x in nums] + ratios)

    line("plain tok/s", [next((overall(c, v)["plain_decode_tokens_per_s"] for c in configs if overall(c, v)), None)
                         for v in values], "")
    for c in configs:
        line(f"{c} tok/s", [overall(c, v).get("decode_tokens_per_s") for v in values], "")
        line(f"{c} speedup over its plain", [overall(c, v).get("speedup") for v in values], "x")
        same = []
        for v in values:
            rs = [r for r in result["rows"] if r["config"] == c and r.get("vary") == f"{setting}={v}"]
            same.append(f"{sum(bool(r.get('same_as_plain')) for r in rs)}/{len(rs)}")
        rows.append([f"{c} same tokens as its plain"] + same + ["" for _ in values[1:]])
    notes = [f"{setting}={v}: {note}" for v, note in vary.get("loaded", {}).items()]
    if vary.get("copy_limit"):
        notes.append("copy limit L = 33 T(1) / T(33): "
                     + ", ".join(f"{v} {L:.2f}x" for v, L in vary["copy_limit"].items()))
    for v, counts in vary.get("plain_vs_first", {}).items():
        notes.append(f"plain runs at {setting}={v} against {values[0]}: "
                     + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    title = (f"{setting}: {', '.join(values)}, each value's runs interleaved with the others' on the same "
             f"{meta['prompts']} prompts (decode tok/s: medians)")
    return title, rows, notes


def vary_markdown(result: dict) -> list[str]:
    """:func:`vary_table` as Markdown lines (none without --vary)."""
    if not result["meta"].get("vary"):
        return []
    title, rows, notes = vary_table(result)
    out = [f"## {title}", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return out + [""] + [f"- {n}" for n in notes] + [""]


def print_vary(result: dict, file: TextIO = sys.stdout) -> None:
    """:func:`vary_table` as aligned plain text (nothing without --vary)."""
    if not result["meta"].get("vary"):
        return
    title, rows, notes = vary_table(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\n{title}", file=file)
    for r in rows:
        print("  " + r[0].ljust(widths[0]) + "".join(f"  {c:>{w}}" for c, w in zip(r[1:], widths[1:])), file=file)
    for n in notes:
        print(f"  {n}", file=file)
