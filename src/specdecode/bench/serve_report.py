"""bench-serve's outputs: the terminal table, results.md and PNG plots (matplotlib,
imported only when plotting)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

COLUMNS = (("tok/s", "tokens_per_s"), ("TTFT p50", "ttft_p50_s"), ("TTFT p95", "ttft_p95_s"),
           ("TTFT max", "ttft_max_s"), ("TPOT p50", "tpot_p50_s"), ("TPOT p95", "tpot_p95_s"),
           ("ITL p50", "itl_p50_s"), ("ITL p99", "itl_p99_s"), ("ITL max", "itl_max_s"),
           ("accept", "acceptance_rate"), ("errors", "errors"))


def _cell(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def rows(result: dict) -> list[list[str]]:
    """[server, clients, figures...] per measured level."""
    out = []
    for label, levels in result["servers"].items():
        for c, s in levels.items():
            out.append([label, str(c)] + [_cell(s.get(key)) for _, key in COLUMNS])
    for label, levels in result.get("long", {}).items():  # bench-serve --long-prompts: those requests' own
        for c, s in levels.items():
            out.append([f"{label}, long prompts", f"beside {c}"] + [_cell(s.get(key)) for _, key in COLUMNS])
    return out


def print_table(result: dict, file: TextIO = sys.stdout) -> None:
    """One line per (server, clients); then speedups and parity."""
    head = ["server", "clients"] + [h for h, _ in COLUMNS]
    table = [head] + rows(result)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print(f"{result['prompts']} prompts, max_tokens {result['config']['max_tokens']}, greedy; seconds", file=file)
    for r in table:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), file=file)
    for c, x in result.get("speedup", {}).items():
        print(f"{c} client(s): batched / one-slot aggregate tokens/s = {x:.2f}x", file=file)
    for c, x in result.get("vs_llama_server", {}).items():
        print(f"{c} client(s): specdecode's batched server / llama-server's aggregate tokens/s = {x:.2f}x", file=file)
    for c, p in result.get("parity", {}).items():
        print(f"{c} client(s): greedy outputs vs alone: {p['exact']} exact, {p['near_tie']} near-tie, "
              f"{p['divergent']} divergent{' ' + str(p['divergent_ids']) if p['divergent_ids'] else ''}", file=file)


def markdown(result: dict) -> str:
    head = ["server", "clients"] + [h for h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    for c, x in result.get("speedup", {}).items():
        lines.append(f"\n{c} client(s): batched / one-slot aggregate tokens/s = **{x:.2f}x**")
    for c, x in result.get("vs_llama_server", {}).items():
        lines.append(f"\n{c} client(s): specdecode's batched server / llama-server's aggregate tokens/s = **{x:.2f}x**")
    for c, p in result.get("parity", {}).items():
        lines.append(f"\n{c} client(s): greedy outputs vs alone: {p['exact']} exact, {p['near_tie']} near-tie, "
                     f"{p['divergent']} divergent")
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> list[str]:
    """Aggregate tokens/s and TTFT p95 against clients, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, ylabel, name in (("tokens_per_s", "aggregate decode tokens/s", "serve_throughput.png"),
                              ("ttft_p95_s", "time to first token, p95 (s)", "serve_ttft_p95.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, levels in result["servers"].items():
            cs = [int(c) for c in levels]
            ax.plot(cs, [levels[c].get(key) or 0 for c in levels], marker="o", label=label)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        names.append(name)
    return names


def write_outputs(result: dict, out: Path) -> None:
    """serve_results.json, serve_results.md and the plots into folder ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = plots(result, out)
    (out / "serve_results.json").write_text(json.dumps(result, indent=2))
    (out / "serve_results.md").write_text(markdown(result))
