"""The benchmark run as a library call: :class:`BenchConfig` in, result dict out.

For every prompt, plain decoding and each configuration run back to back in one process
on the same loaded target, with the same sampling settings and max_tokens, after a
warm-up; the peers (:mod:`.peers`) run on the same prompts. The order alternates from one
prompt to the next (plain first, then the configurations first), so load that changes over
the run weighs on both sides alike; ``background_load`` runs the whole bench beside a
bounded CPU load (:mod:`.load`). Prompts run in file order and
each configuration keeps its engine (and so its drafter) from one prompt to the next, so
a drafter that learns across requests has seen the earlier ones. A prompt with a grammar
(its ``json_schema``) is constrained to it in every generation, plain and speculative
alike; the peers cannot constrain their output, so they skip such prompts.

With ``vary`` (:mod:`.vary`) each value of the setting gets engines of its own (and, for a
setting read when a model loads, a target of its own), and the values' runs of each prompt are
interleaved (:func:`specdecode.bench.runs.time_prompt`).

When sampling is greedy, the oracle (:mod:`.oracle`) replays the plain outputs, in the
same order, with the target's measured cost curve T(n) and the lookup drafters of each
configuration's draft: the speedup a perfectly informed controller would reach.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from contextlib import contextmanager
from pathlib import Path

from ..assembly import registry
from ..assembly.loading import make_speculation
from ..api import Decoder
from ..backends.base import Backend
from ..backends.fim import FimBudget
from ..backends.llama_cpp.lib import FLASH_ATTENTION_ENV, default_threads
from ..control.costmodel import CostCurve
from ..control.context_costs import cached_context_costs
from ..control.costcache import cached_forward_curve
from ..drafters.kinds import resolve, uses_option
from ..engine import SpeculativeEngine
from ..errors import SpecDecodeError
from ..grammar import check_grammar
from ..limits import COST_CURVE_NS, MAX_NUM_SPECULATIVE_TOKENS
from ..parity import parity_report
from .config import DEFAULT_CONFIGS, WARMUP_TOKENS, WITH_PREDICTION, WITH_TREES, BenchConfig, run_label
from .load import BackgroundLoad
from .tools import cpu_name
from .oracle import OracleResult, lookup_drafters, oracle_replay
from .llama_server import default_binary, start_llama_servers
from .llama_server_report import summarize_servers, time_servers
from .peers import start_peer
from .report import summarize
from .runs import Variant, history_as, history_keepers, make_row, time_prompt
from .suite import BenchPrompt, load_prompts, select_prompts
from .vary import check_loaded, loading_with, run_options

__all__ = ["BenchConfig", "DEFAULT_CONFIGS", "run_bench", "open_decoder", "copy_limit", "peak_rss_mb",
           "history_as", "history_keepers"]


@contextmanager
def _no_load():
    yield None


def copy_limit(curve: CostCurve, context_costs=None, context: int = 0) -> float:
    """L = 33 T(1) / T(33): the speedup of a perfect 32-token copy verified in one forward
    against one-token decoding on this machine, the ceiling of any drafter's win; with
    context_costs, after ``context`` tokens (T(n) + extra(n, c))."""
    if context_costs is None or not context_costs.measured:
        return round(33 * curve(1) / curve(33), 3)
    return round(33 * (curve(1) + context_costs(1, context)) / (curve(33) + context_costs(33, context)), 3)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def open_decoder(config: BenchConfig) -> Decoder:
    """The target loaded for plain decoding (the bench's baseline engine; the configurations'
    engines are built on its target). Raises what :class:`specdecode.Decoder` raises."""
    return Decoder(target=config.target, draft="none", num_speculative_tokens=0, n_ctx=config.n_ctx,
                   n_threads=config.n_threads, progress=config.progress, backend=config.backend,
                   dtype=config.dtype, device=config.device, max_tree_nodes=config.max_tree_nodes or None,
                   gpu_layers=config.gpu_layers)


def _build_engines(config: BenchConfig, target: Backend, engines: dict[str, SpeculativeEngine],
                   draft_vocab: int | str | None = None) -> None:
    """Add one engine per configuration to ``engines`` (filled in place, so that a failure
    part way still leaves the drafters loaded so far to be closed). draft_vocab: a varied
    drafter setting's value (None: the config's)."""
    opts = dict(n_ctx=config.n_ctx, n_threads=config.n_threads, progress=config.progress, dtype=config.dtype,
                device=config.device)
    for draft, k in config.parsed_configs():
        if f"{draft}:{k}" in engines:  # "ngram" and "ngram:auto" name the same configuration
            continue
        # the draft options reach the drafters that use them (a varied draft_vocab too); the others draft as usual
        given = config.draft_options(draft)
        if draft_vocab is not None and uses_option(draft, "draft_vocab"):
            given["draft_vocab"] = draft_vocab
        opts.update(draft_vocab=given["draft_vocab"], backend=given["draft_backend"], gpu_layers=given["draft_gpu_layers"])
        choice = resolve(draft, k)
        # With trees, CONFIG+trees gets drafters of its own: a lookup in earlier requests (suffix)
        # must not find the answer that CONFIG's run of the same prompt just gave.
        for name in (f"{draft}:{k}", f"{draft}:{k}{WITH_TREES}") if config.max_tree_nodes else (f"{draft}:{k}",):
            engines[name] = make_speculation(choice, target, tree_width=config.tree_width, **opts)


def _open_variants(config: BenchConfig, variants: list[Variant]) -> None:
    """Load each variant's target and engines into ``variants`` (filled in place, so that a
    failure part way still leaves what loaded to be closed): one without --vary; with it one
    per value, each loaded with the environment its value asks for (a load setting), or on the
    first variant's target (a generation setting: the same model, drafters of its own)."""
    vary = config.parsed_vary()
    setting = vary.setting if vary else None
    for value in vary.values if vary else (None,):
        params, fields = run_options(setting, value, config.sampling)
        v = Variant(value, vary.label(value) if vary else "", params, fields)
        variants.append(v)
        with loading_with(setting, value) if setting else _no_load():
            if setting is None or setting.kind == "load" or len(variants) == 1:
                v.dec = open_decoder(config)
                if setting is not None and setting.kind == "load":
                    v.note = check_loaded(setting, value, v.dec.target)
            else:
                v.dec, v.shares_target = variants[0].dec, True
            _build_engines(config, v.dec.target, v.engines, value if setting and setting.kind == "drafter" else None)


def _add_oracle(runs: list[tuple[list[int], list[int], list[dict], list[int] | None]], drafts: dict[str, str],
                oracle_drafters: dict[str, list], curve: CostCurve, context_costs=None) -> None:
    """Replay each run's plain greedy output (prompt ids, output ids, its rows, its prediction), in bench
    order, with the oracle over each draft's lookup drafters (kept across runs, so suffix
    history accumulates as in the engines; a prompt's +prediction replay starts from the
    history its first replay started from, as :func:`specdecode.bench.runs.time_prompt` runs it), and set each
    row's oracle_time_s and oracle_plain_time_s (seconds: the oracle's, and len(output) * T(1)).
    One replay per draft serves every configuration of that draft ("ngram:3" and "ngram:auto").
    context_costs: each step priced at its context (:func:`.oracle.oracle_replay`)."""
    for ids, out, rows, prediction in runs:
        res: dict[tuple[str, bool], OracleResult] = {}
        for d, ds in oracle_drafters.items():  # as the engines run: +prediction from the history before the first
            learners = history_keepers(ds) if prediction else []
            before = [x.history_state() for x in learners]
            res[d, False] = oracle_replay(ids, out, curve, ds, MAX_NUM_SPECULATIVE_TOKENS, context_costs=context_costs)
            if prediction:
                with history_as(learners, before):
                    res[d, True] = oracle_replay(ids, out, curve, ds, MAX_NUM_SPECULATIVE_TOKENS, prediction=prediction,
                                                 context_costs=context_costs)
        for row in rows:
            r = res.get((drafts[row["config"]], row["config"].endswith(WITH_PREDICTION)))
            if r is not None:
                row["oracle_time_s"], row["oracle_plain_time_s"] = r.time_s, r.plain_s


def _start_peers(config: BenchConfig, target: Backend, engines: dict[str, SpeculativeEngine],
                 prompts: list[BenchPrompt], ids_of) -> tuple[object, str | None, bool]:
    """The peer runner (or None), its note, and whether it also runs assisted generation;
    the note says which prompts the peers skip (those with a grammar), or that --vary left them out."""
    if config.vary is not None:
        note = "peers not run with --vary (the runs compare the setting's values)" if config.peer else None
        return None, note, False
    free = [p for p in prompts if p.grammar is None]  # the prompts a peer can run
    peer, note, assisted = None, None, False
    if config.peer and free:
        peer, note, assisted = start_peer(target, config.target, engines, target.n_ctx, ids_of(free[0]))
    if config.peer and len(free) < len(prompts):
        skipped = (f"skipped on {len(prompts) - len(free)} of {len(prompts)} prompts, those with a grammar "
                   "(peers cannot constrain output)")
        note = f"{note}; {skipped}" if note else f"peers {skipped}"
    return peer, note, assisted


def _run_peer(peer, assisted: bool, ids: list[int], p: BenchPrompt) -> tuple[float | None, float | None, str]:
    """(peer rate, assisted rate, "" or a note on the failure): one failed peer run must not
    lose the benchmark."""
    rate = assisted_rate = None
    try:
        rate = peer.run(ids, p.max_tokens)[1]
        if assisted:
            assisted_rate = peer.run(ids, p.max_tokens, assisted=True)[1]
    except Exception as e:
        return rate, assisted_rate, f"failed on {p.id}: {type(e).__name__}: {e}"
    return rate, assisted_rate, ""


def _oracle_setup(v: Variant, drafts: dict[str, str]) -> None:
    """Set the variant's oracle lookup drafters per draft (kept across prompts) and the target's
    T(n) and context costs. The oracle needs greedy outputs and drafters without model cost. The curve is measured
    (or read from the cache) before any generation, as the controller's is: measuring rolls
    the target's cache back."""
    if v.params.greedy:
        v.oracle_drafters = {d: ds for d in dict.fromkeys(drafts.values()) if (ds := lookup_drafters(d)) is not None}
    v.curve = cached_forward_curve(v.dec.target, COST_CURVE_NS, registry.cache_dir()) if v.oracle_drafters else None
    if v.curve is not None:
        v.context_costs = cached_context_costs(v.dec.target, registry.cache_dir())


def _warm_up(prompts: list[BenchPrompt], ids_of, v: Variant) -> None:
    """Compile the prompts' grammars (vocabulary and schema: no timed run pays for it) and
    run every engine of the variant once on the first prompt. The warm-up is the variant's
    first oracle run (prompt ids, plain output, no rows): the oracle's drafters see it as the
    engines' did."""
    for g in dict.fromkeys(p.grammar for p in prompts if p.grammar is not None):
        check_grammar(g, v.dec.target)
    w, g = ids_of(prompts[0]), prompts[0].grammar
    warm = v.dec.engine.generate(w, sampling=v.params, max_tokens=WARMUP_TOKENS, grammar=g, **v.fields)
    for eng in v.engines.values():
        eng.generate(w, sampling=v.params, max_tokens=WARMUP_TOKENS, grammar=g, **v.fields)
    v.runs.append((w, warm.token_ids, [], None))


def _drafts_by_row_name(config: BenchConfig) -> dict[str, str]:
    """Each row name a configuration may give (CONFIG, +prediction, +trees, both) -> its draft."""
    return {f"{d}:{k}{w}": d for d, k in config.parsed_configs()
            for w in ("", WITH_PREDICTION, WITH_TREES, WITH_TREES + WITH_PREDICTION)}


def _plain_vs_first(plains: list, greedy: bool, counts: dict[str, dict[str, int]], variants: list[Variant]) -> None:
    """Count, per variant after the first, how its plain run of a prompt compares with the
    first variant's: parity status when greedy (exact, near-tie, divergent), else same or differs."""
    for v, plain in zip(variants[1:], plains[1:]):
        status = (parity_report(plain, plains[0])["status"] if greedy
                  else "exact" if plain.token_ids == plains[0].token_ids else "differs")
        counts.setdefault(v.value, {})
        counts[v.value][status] = counts[v.value].get(status, 0) + 1


def _time_all(config: BenchConfig, prompts: list[BenchPrompt], variants: list[Variant], ids_of, peer, assisted_peer,
              peer_note: str | None, servers: dict, server_rows: list[dict]) -> tuple[list[dict], str | None, dict]:
    """Every prompt's runs (:func:`specdecode.bench.runs.time_prompt`): the rows, the peer note
    and the count of plain runs that equal the first variant's (by value); each llama-server
    configuration's run of the prompt right after specdecode's, into server_rows."""
    from tqdm import tqdm

    rows: list[dict] = []
    vs_first: dict[str, dict[str, int]] = {}
    greedy = config.sampling.greedy and all(v.params.greedy for v in variants)
    first = variants[0].dec
    per_prompt = sum(1 + len(v.engines) for v in variants)  # runs, +prediction ones aside
    bar = tqdm(total=len(prompts) * per_prompt, desc="bench", unit="run", disable=not config.progress,
               file=sys.stderr, mininterval=5)
    with BackgroundLoad(config.background_load) if config.background_load else _no_load():
        for i, p in enumerate(prompts):
            ids = ids_of(p)
            pred = first.prediction_ids(p.prediction) if p.prediction else None
            timed = time_prompt(p, ids, i, variants, pred, config.max_tree_nodes, fresh=bool(servers))
            bar.update(per_prompt)
            peer_rate = assisted_rate = None
            if peer is not None and p.grammar is None:
                peer_rate, assisted_rate, failed = _run_peer(peer, assisted_peer, ids, p)
                peer_note = f"{peer_note}; {failed}" if failed else peer_note
            for v, (plain, results) in zip(variants, timed):
                v.runs.append((ids, plain.token_ids, [], pred))
                for name, r in results.items():
                    rows.append(make_row(p, name, r, plain, v.params.greedy, peer_rate, assisted_rate, v.label))
                    v.runs[-1][2].append(rows[-1])
            _plain_vs_first([plain for plain, _ in timed], greedy, vs_first, variants)
            if servers:
                done, failed = time_servers(servers, p, ids, timed[0][0].token_ids)
                server_rows += done
                peer_note = f"{peer_note}; {failed}" if failed and peer_note else failed or peer_note
    bar.close()
    return rows, peer_note, vs_first


def run_bench(config: BenchConfig) -> dict:
    """Load the target and the configurations' drafters (per value of ``vary``), warm up, and
    time plain decoding, each configuration and the peers on every selected prompt.

    A target without fill-in-the-middle tokens skips the ``fim`` prompts (:func:`fim_served`:
    a note on stderr and in ``meta["skipped"]``, else None).
    Returns {"meta": run settings, peak RSS in MB, peer note, the CPU, ``vary`` (None, or the
    setting, its values, what each value's target reported, each value's copy limit and how
    its plain runs compare with the first value's); "summary": per run name (configuration,
    and "[SETTING=VALUE]" with vary) and category, as :func:`specdecode.bench.report.summarize`;
    "rows": one dict per prompt and run}. Decode tokens/s is :func:`decode_rate` for every runner alike.
    Raises SpecDecodeError for bad prompt files, an empty selection (also when only ``fim``
    prompts were selected for a target without FIM tokens), and models that cannot
    load or do not share the target's vocabulary, or grammars that do not compile (named by
    file and line; all are compiled before anything is timed), and a varied load setting the
    target does not have or did not take. Every generation of a prompt
    with a grammar is constrained by it. A peer that fails is noted in ``meta["peer"]``, not
    raised; so are the prompts the peers skip for their grammar (rows with ``grammar`` True
    and peer rates None). Greedy runs also get the oracle (:mod:`.oracle`):
    per row oracle_time_s and oracle_plain_time_s, per summary entry oracle_speedup and
    oracle_fraction (None for a draft model's configurations and when sampling), and
    ``meta["cost_curve"]``, the target's T(n) it used (the first value's, with vary).
    """
    prompts = select_prompts(load_prompts(config.prompts, config.max_tokens), config.categories, config.per_category)
    if config.prediction:
        prompts = [dataclasses.replace(p, prediction=config.prediction) for p in prompts]
    variants: list[Variant] = []
    drafts = _drafts_by_row_name(config)
    skipped = None
    try:
        _open_variants(config, variants)
        first = variants[0].dec
        prompts, skipped = fim_served(prompts, first.target)

        ids_of = _ids_of(first, config.llama_server is not None)

        for v in variants:
            _oracle_setup(v, drafts)
            _warm_up(prompts, ids_of, v)
        rss_specdecode = peak_rss_mb()  # target, drafters and caches loaded and warmed up; before the peer
        peer, peer_note, assisted_peer = _start_peers(config, first.target, variants[0].engines, prompts, ids_of)
        servers, server_note = _start_servers(config, first.target)
        server_rows: list[dict] = []
        with _closing(servers):
            rows, peer_note, vs_first = _time_all(config, prompts, variants, ids_of, peer, assisted_peer, peer_note,
                                                  servers, server_rows)
        rss = peak_rss_mb()  # includes the peer's score buffer when the peer ran
        del peer
        target = first.target
    finally:
        for v in variants:
            v.close()
    for v in variants:
        if v.curve is not None:  # after the timed runs, so the replays never delay them
            _add_oracle(v.runs, drafts, v.oracle_drafters, v.curve, v.context_costs)
    names = [v.name(c) for v in variants for c in v.engines]
    # Then the +prediction and +trees runs, in the order they first ran.
    names += [c for c in dict.fromkeys(run_label(r["config"], r["vary"]) for r in rows) if c not in names]
    curve = variants[0].curve
    meta = {"target": config.target, "prompts": len(prompts), "temperature": config.sampling.temperature,
            "threads": target.n_threads, "weights": target.weights_note,
            "cpu": cpu_name(), "peak_rss_mb": round(rss, 1), "rss_before_peer_mb": round(rss_specdecode, 1),
            "configs": names, "peer": peer_note, "prompts_file": str(config.prompts or "built-in suite"),
            "cost_curve": curve.to_dict() if curve is not None else None,
            "copy_limit": copy_limit(curve) if curve is not None else None,
            "copy_limit_at": {c: copy_limit(curve, variants[0].context_costs, c) for c in
                              getattr(variants[0].context_costs, "contexts", ())} if curve is not None else {},
            "background_load": config.background_load, "skipped": skipped,
            "oracle_drafters": {d: [x.name for x in ds] for d, ds in variants[0].oracle_drafters.items()},
            "vary": _vary_meta(config, variants, vs_first), "llama_server": server_note}
    result = {"meta": meta, "summary": summarize(rows, names), "rows": rows}
    if server_rows:
        result["llama_server"] = summarize_servers(rows, server_rows, names)
        result["llama_server_rows"] = server_rows
    return result


@contextmanager
def _closing(servers: dict):
    """Stop every llama-server however the runs end."""
    try:
        yield
    finally:
        for s in servers.values():
            s.close()


def _ids_of(dec: Decoder, infill: bool):
    """A prompt's token ids on the first variant's decoder; with ``infill`` (llama-server beside
    it), a fill-in-the-middle prompt as /infill lays it out (llama-server's budgets)."""
    def ids_of(p: BenchPrompt) -> list[int]:
        if p.fim:
            budget = FimBudget.for_context(dec.target.n_ctx, p.max_tokens) if infill else None
            return dec.prompt_ids(p.prompt, suffix=p.suffix, extra=p.extra, fim_budget=budget)
        return dec.prompt_ids(p.prompt, p.messages, p.tools)
    return ids_of


def _start_servers(config: BenchConfig, target: Backend) -> tuple[dict, str | None]:
    """llama-server's configurations (:mod:`.llama_server`) where asked for: ({config: server}, note)."""
    if config.llama_server is None:
        return {}, None
    draft = config.llama_server_draft or next((d for d, _ in config.parsed_configs() if d in registry.REGISTRY
                                               or d.endswith(".gguf")), None)
    binary = Path(config.llama_server).expanduser() if config.llama_server else default_binary()
    return start_llama_servers(binary, target.path, draft, target.n_ctx, target.n_threads or default_threads(),
                               config.llama_server_configs, os.environ.get(FLASH_ATTENTION_ENV) or None)


def fim_served(prompts: list[BenchPrompt], target: Backend) -> tuple[list[BenchPrompt], str | None]:
    """The prompts the target can run and a note on those it cannot (None when none): a target
    without fill-in-the-middle tokens skips the fill-in-the-middle prompts (the ``fim``
    category), and the note is printed on stderr. Raises SpecDecodeError, naming the target,
    when no prompt is left."""
    if target.fim_tokens is not None or not any(p.fim for p in prompts):
        return prompts, None
    cats = ", ".join(dict.fromkeys(p.category for p in prompts if p.fim))
    note = (f"{sum(p.fim for p in prompts)} fill-in-the-middle prompt(s) ({cats}) skipped: the target "
            f"{target.name} has no fill-in-the-middle tokens")
    kept = [p for p in prompts if not p.fim]
    if not kept:
        raise SpecDecodeError(f"no prompts left: {note}; choose other categories or a code model trained for it "
                              "(such as qwen2.5-coder-1.5b-instruct)", param="categories")
    print(f"specdecode bench: {note}", file=sys.stderr, flush=True)
    return kept, note


def _vary_meta(config: BenchConfig, variants: list[Variant], vs_first: dict) -> dict | None:
    """meta["vary"]: the setting, its kind and values, what each value's target reported (a
    load setting), each value's copy limit L, and per later value how its plain runs compare
    with the first value's."""
    vary = config.parsed_vary()
    if vary is None:
        return None
    return {"setting": vary.setting.name, "kind": vary.setting.kind, "values": list(vary.values),
            "loaded": {v.value: v.note for v in variants if v.note},
            "copy_limit": {v.value: copy_limit(v.curve) for v in variants if v.curve is not None},
            "plain_vs_first": vs_first}
