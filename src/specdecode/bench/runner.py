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

When sampling is greedy, the oracle (:mod:`.oracle`) replays the plain outputs, in the
same order, with the target's measured cost curve T(n) and the lookup drafters of each
configuration's draft: the speedup a perfectly informed controller would reach.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..assembly import registry
from ..assembly.loading import make_speculation
from ..api import Decoder
from ..backends.base import Backend
from ..control.costmodel import CostCurve
from ..control.costcache import cached_forward_curve
from ..drafters.kinds import check_draft_options, resolve
from ..engine import SpeculativeEngine
from ..errors import SpecDecodeError
from ..grammar import check_grammar
from ..limits import (COST_CURVE_NS, DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_N_CTX, DEFAULT_TREE_WIDTH,
                      MAX_NUM_SPECULATIVE_TOKENS, check_max_tree_nodes, check_tree_width)
from ..output import GenerationResult
from ..parity import parity_report
from ..sampling import SamplingParams
from .load import BackgroundLoad
from .oracle import OracleResult, lookup_drafters, oracle_replay
from .peers import decode_rate, start_peer
from .report import summarize
from .suite import DEFAULT_BENCH_MAX_TOKENS, BenchPrompt, load_prompts, parse_config, select_prompts

DEFAULT_CONFIGS = ("auto:auto",)
WARMUP_TOKENS = 8  # tokens each engine and peer generates once before timing
WITH_PREDICTION = "+prediction"  # a configuration's rows run with the prompt's prediction
WITH_TREES = "+trees"  # a configuration's rows run with trees of drafts (--max-tree-nodes N)


@dataclass(frozen=True)
class BenchConfig:
    """What ``specdecode bench`` runs.

    target: registry name, .gguf path or Hugging Face folder.
    prompts: JSON Lines prompt file (None: the built-in suite; format in :func:`load_prompts`).
    configs: "DRAFT:K" configurations compared with plain decoding (see :func:`parse_config`).
    categories: only prompts of these categories (None: all). per_category: at most this
        many prompts per category (None: all).
    max_tokens: completion cap in tokens for prompts without their own.
    sampling: the sampling settings of every run (parity is checked only when greedy).
    n_ctx: context window in tokens. n_threads: CPU threads (None: all cores).
    backend, draft_backend: "auto", "llama.cpp" or "torch"; dtype, device: for the torch
        backend; draft_vocab: see :class:`specdecode.drafters.ModelDrafter` (0 = all).
    peer: also time the peers. progress: progress bars on stderr.
    background_load: run beside a CPU load of this fraction of the machine (0 < F <= 1;
        None: none).
    prediction: the predicted output of every prompt (None: each prompt's own, if any).
    max_tree_nodes: None (each engine's default), 0 (chains only), or N: every configuration
        runs with chains and, with drafters of its own, with trees of up to N nodes, as
        ``CONFIG+trees``, side by side (the target loaded to verify trees). tree_width:
        candidates per tree node.

    Raises SpecDecodeError naming the field when a value is out of range (before any
    model is loaded).
    """

    target: str = registry.DEFAULT_TARGET
    prompts: str | Path | None = None
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    categories: tuple[str, ...] | None = None
    per_category: int | None = None
    max_tokens: int = DEFAULT_BENCH_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(seed=0))
    n_ctx: int = DEFAULT_N_CTX
    n_threads: int | None = None
    backend: str = "auto"
    draft_backend: str = "auto"
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    draft_vocab: int = 0
    peer: bool = True
    progress: bool = True
    background_load: float | None = None
    prediction: str | None = None
    max_tree_nodes: int | None = None
    tree_width: int = DEFAULT_TREE_WIDTH

    def __post_init__(self) -> None:
        # Lists from callers become tuples, so configs stay immutable and comparable.
        object.__setattr__(self, "configs", tuple(self.configs))
        if self.categories is not None:
            object.__setattr__(self, "categories", tuple(self.categories))
        if not self.configs:
            raise SpecDecodeError("configs is empty: give at least one DRAFT:K", param="configs")
        for c in self.configs:
            parse_config(c)
        if self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens = {self.max_tokens} is out of range: expected >= 1", param="max_tokens")
        check_max_tree_nodes(self.max_tree_nodes)
        check_tree_width(self.tree_width)
        if self.background_load is not None:
            BackgroundLoad(self.background_load)  # raises for a value out of range
        if self.per_category is not None and self.per_category < 1:
            raise SpecDecodeError(f"per_category = {self.per_category} is out of range: expected >= 1 or None",
                                  param="per_category")

    def parsed_configs(self) -> list[tuple[str, int | str]]:
        """configs as (draft, K) pairs."""
        return [parse_config(c) for c in self.configs]


@contextmanager
def _no_load():
    yield None


def copy_limit(curve: CostCurve) -> float:
    """L = 33 T(1) / T(33): the speedup of a perfect 32-token copy verified in one forward
    against one-token decoding on this machine, the ceiling of any drafter's win."""
    return round(33 * curve(1) / curve(33), 3)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _build_engines(config: BenchConfig, target: Backend, engines: dict[str, SpeculativeEngine]) -> None:
    """Add one engine per configuration to ``engines`` (filled in place, so that a failure
    part way still leaves the drafters loaded so far to be closed)."""
    opts = dict(n_ctx=config.n_ctx, n_threads=config.n_threads, progress=config.progress,
                backend=config.draft_backend, dtype=config.dtype, device=config.device, draft_vocab=config.draft_vocab)
    for draft, k in config.parsed_configs():
        if f"{draft}:{k}" in engines:  # "ngram" and "ngram:auto" name the same configuration
            continue
        check_draft_options(draft, draft_vocab=config.draft_vocab, draft_backend=config.draft_backend)
        choice = resolve(draft, k)
        # With trees, CONFIG+trees gets drafters of its own: a lookup in earlier requests (suffix)
        # must not find the answer that CONFIG's run of the same prompt just gave.
        for name in (f"{draft}:{k}", f"{draft}:{k}{WITH_TREES}") if config.max_tree_nodes else (f"{draft}:{k}",):
            engines[name] = make_speculation(choice, target, tree_width=config.tree_width, **opts)


def _row(p: BenchPrompt, name: str, result: GenerationResult, plain: GenerationResult, plain_rate: float, greedy: bool,
         peer_rate: float | None, assisted_rate: float | None) -> dict:
    s = result.stats
    return {
        "id": p.id, "category": p.category, "config": name, "grammar": p.grammar is not None,
        "finish_reason": result.finish_reason,
        "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
        "spec_tokens_per_s": decode_rate(s.completion_tokens, s.first_token_s, s.prefill_s + s.decode_s),
        "plain_tokens_per_s": plain_rate,
        "drafted": s.drafted, "accepted": s.accepted, "target_forward_passes": s.target_forward_passes,
        "accepted_per_position": s.accepted_per_position, "drafted_per_position": s.drafted_per_position,
        "k_histogram": {str(k): v for k, v in s.k_histogram.items()},
        "tree_steps": s.tree_steps, "tree_nodes": s.tree_nodes,
        "parity": parity_report(result, plain)["status"] if greedy else "n/a",
        "peer_tokens_per_s": peer_rate,
        "peer_assisted_tokens_per_s": assisted_rate,
        "oracle_time_s": None, "oracle_plain_time_s": None,  # filled in by _add_oracle
    }


def _add_oracle(runs: list[tuple[list[int], list[int], list[dict], list[int] | None]], drafts: dict[str, str],
                oracle_drafters: dict[str, list], curve: CostCurve) -> None:
    """Replay each run's plain greedy output (prompt ids, output ids, its rows, its prediction), in bench
    order, with the oracle over each draft's lookup drafters (kept across runs, so suffix
    history accumulates as in the engines; a prompt's +prediction replay starts from the
    history its first replay started from, as :func:`_time_prompt` runs it), and set each row's oracle_time_s and
    oracle_plain_time_s (seconds: the oracle's, and len(output) * T(1)). One replay per
    draft serves every configuration of that draft ("ngram:3" and "ngram:auto")."""
    for ids, out, rows, prediction in runs:
        res: dict[tuple[str, bool], OracleResult] = {}
        for d, ds in oracle_drafters.items():  # as the engines run: +prediction from the history before the first
            learners = history_keepers(ds) if prediction else []
            before = [x.history_state() for x in learners]
            res[d, False] = oracle_replay(ids, out, curve, ds, MAX_NUM_SPECULATIVE_TOKENS)
            if prediction:
                with history_as(learners, before):
                    res[d, True] = oracle_replay(ids, out, curve, ds, MAX_NUM_SPECULATIVE_TOKENS, prediction=prediction)
        for row in rows:
            r = res.get((drafts[row["config"]], row["config"].endswith(WITH_PREDICTION)))
            if r is not None:
                row["oracle_time_s"], row["oracle_plain_time_s"] = r.time_s, r.plain_s


def _start_peers(config: BenchConfig, target: Backend, engines: dict[str, SpeculativeEngine],
                 prompts: list[BenchPrompt], ids_of) -> tuple[object, str | None, bool]:
    """The peer runner (or None), its note, and whether it also runs assisted generation;
    the note says which prompts the peers skip (those with a grammar)."""
    free = [p for p in prompts if p.grammar is None]  # the prompts a peer can run
    peer, note, assisted = None, None, False
    if config.peer and free:
        peer, note, assisted = start_peer(target, config.target, engines, config.n_ctx, ids_of(free[0]))
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


def _oracle_setup(drafts: dict[str, str], target: Backend, greedy: bool) -> tuple[dict[str, list], CostCurve | None]:
    """The oracle's lookup drafters per draft (kept across prompts) and the target's T(n).
    The oracle needs greedy outputs and drafters without model cost. The curve is measured
    (or read from the cache) before any generation, as the controller's is: measuring rolls
    the target's cache back."""
    oracle_drafters = {}
    if greedy:
        oracle_drafters = {d: ds for d in dict.fromkeys(drafts.values()) if (ds := lookup_drafters(d)) is not None}
    curve = cached_forward_curve(target, COST_CURVE_NS, registry.cache_dir()) if oracle_drafters else None
    return oracle_drafters, curve


def _warm_up(prompts: list[BenchPrompt], ids_of, target: Backend, plain_engine: SpeculativeEngine,
             engines: dict[str, SpeculativeEngine], params) -> tuple[list[int], list[int], list, None]:
    """Compile the prompts' grammars (vocabulary and schema: no timed run pays for it) and
    run every engine once on the first prompt. Returns the warm-up as an oracle run (prompt
    ids, plain output, no rows): the oracle's drafters see it as the engines' did."""
    for g in dict.fromkeys(p.grammar for p in prompts if p.grammar is not None):
        check_grammar(g, target)
    w = ids_of(prompts[0])
    warm = plain_engine.generate(w, sampling=params, max_tokens=WARMUP_TOKENS, grammar=prompts[0].grammar)
    for eng in engines.values():
        eng.generate(w, sampling=params, max_tokens=WARMUP_TOKENS, grammar=prompts[0].grammar)
    return w, warm.token_ids, [], None


def _drafts_by_row_name(config: BenchConfig) -> dict[str, str]:
    """Each row name a configuration may give (CONFIG, +prediction, +trees, both) -> its draft."""
    return {f"{d}:{k}{w}": d for d, k in config.parsed_configs()
            for w in ("", WITH_PREDICTION, WITH_TREES, WITH_TREES + WITH_PREDICTION)}


def history_keepers(drafters: list) -> list:
    """Among ``drafters`` and their members (a controller's sources), those that keep a
    history of earlier requests (suffix drafting: ``history_state``)."""
    return [m for d in drafters for m in [d, *d.members()] if hasattr(m, "history_state")]


@contextmanager
def history_as(learners: list, states: list):
    """Run the block with the learners' histories set to ``states`` (taken before the prompt's
    first run), then put back what they held: a prompt's second run (with its prediction)
    starts from the history its first run started from, and leaves the history as the first
    run left it, so later prompts see the same history either way."""
    after = [d.history_state() for d in learners]
    for d, s in zip(learners, states):
        d.set_history_state(s)
    try:
        yield
    finally:
        for d, s in zip(learners, after):
            d.set_history_state(s)


def follows_prediction(drafter) -> bool:
    """Whether a drafter drafts from a request's prediction (the prediction kind, or the
    controller over it)."""
    return drafter.follows("prediction")


def _time_prompt(p: BenchPrompt, ids: list[int], i: int, plain_engine: SpeculativeEngine,
                 engines: dict[str, SpeculativeEngine], params, prediction: list[int] | None = None,
                 trees: int | None = None) -> tuple[GenerationResult, dict]:
    """The i-th prompt's plain run and each configuration's (name -> result); with a
    prediction (its token ids), each configuration that follows one runs again with it, as
    ``NAME+prediction``, from the suffix history as it was before the configuration's first
    run of this prompt (:func:`history_as`); with trees (a node budget > 0), the engines named ``NAME+trees``
    (drafters of their own) run with trees and the others with chains. Plain goes first on even prompts and last on odd ones, so
    that load changing over the run weighs on both sides alike."""
    def run_plain():
        return plain_engine.generate(ids, sampling=params, max_tokens=p.max_tokens, record_top2_gaps=True,
                                     grammar=p.grammar)

    def run_configs():
        out = {}
        for name, eng in engines.items():
            nodes = trees if name.endswith(WITH_TREES) else 0 if trees else None  # None: the engine's default
            again = prediction and follows_prediction(eng.drafter)
            learners = history_keepers([eng.drafter]) if again else []
            before = [d.history_state() for d in learners]
            out[name] = eng.generate(ids, sampling=params, max_tokens=p.max_tokens, grammar=p.grammar,
                                     max_tree_nodes=nodes)
            if again:
                with history_as(learners, before):  # not the answer the run above just stored
                    out[name + WITH_PREDICTION] = eng.generate(ids, sampling=params, max_tokens=p.max_tokens,
                                                               grammar=p.grammar, prediction=prediction)
        return out

    if i % 2 == 0:
        plain = run_plain()
        return plain, run_configs()
    results = run_configs()
    return run_plain(), results


def run_bench(config: BenchConfig) -> dict:
    """Load the target and the configurations' drafters, warm up, and time plain decoding,
    each configuration and the peers on every selected prompt.

    Returns {"meta": run settings, peak RSS in MB, peer note; "summary": per configuration
    and category, as :func:`specdecode.bench.report.summarize`; "rows": one dict per prompt
    and configuration}. Decode tokens/s is :func:`decode_rate` for every runner alike.
    Raises SpecDecodeError for bad prompt files, an empty selection, and models that cannot
    load or do not share the target's vocabulary, or grammars that do not compile (named by
    file and line; all are compiled before anything is timed). Every generation of a prompt
    with a grammar is constrained by it. A peer that fails is noted in ``meta["peer"]``, not
    raised; so are the prompts the peers skip for their grammar (rows with ``grammar`` True
    and peer rates None). Greedy runs also get the oracle (:mod:`.oracle`):
    per row oracle_time_s and oracle_plain_time_s, per summary entry oracle_speedup and
    oracle_fraction (None for a draft model's configurations and when sampling), and
    ``meta["cost_curve"]``, the target's T(n) it used.
    """
    from tqdm import tqdm

    prompts = select_prompts(load_prompts(config.prompts, config.max_tokens), config.categories, config.per_category)
    if config.prediction:
        prompts = [dataclasses.replace(p, prediction=config.prediction) for p in prompts]
    params = config.sampling
    dec = Decoder(target=config.target, draft="none", num_speculative_tokens=0, n_ctx=config.n_ctx,
                  n_threads=config.n_threads, progress=config.progress, backend=config.backend,
                  dtype=config.dtype, device=config.device, max_tree_nodes=config.max_tree_nodes or None)
    engines: dict[str, SpeculativeEngine] = {}
    try:
        target, plain_engine = dec.target, dec.engine
        _build_engines(config, target, engines)
        names = list(engines)
        drafts = _drafts_by_row_name(config)
        oracle_drafters, curve = _oracle_setup(drafts, target, params.greedy)

        def ids_of(p: BenchPrompt) -> list[int]:
            return dec.prompt_ids(p.prompt, p.messages, p.tools)

        runs = [_warm_up(prompts, ids_of, target, plain_engine, engines, params)]

        rss_specdecode = peak_rss_mb()  # target, drafters and caches loaded and warmed up; before the peer
        peer, peer_note, assisted_peer = _start_peers(config, target, engines, prompts, ids_of)
        rows = []
        per_prompt = 1 + len(engines)  # runs, +prediction ones aside
        bar = tqdm(total=len(prompts) * per_prompt, desc="bench", unit="run", disable=not config.progress,
                   file=sys.stderr, mininterval=5)
        with BackgroundLoad(config.background_load) if config.background_load else _no_load():
            for i, p in enumerate(prompts):
                ids = ids_of(p)
                pred = dec.prediction_ids(p.prediction) if p.prediction else None
                plain, results = _time_prompt(p, ids, i, plain_engine, engines, params, pred, config.max_tree_nodes)
                bar.update(per_prompt)
                ps = plain.stats
                plain_rate = decode_rate(ps.completion_tokens, ps.first_token_s, ps.prefill_s + ps.decode_s)
                peer_rate = assisted_rate = None
                if peer is not None and p.grammar is None:
                    peer_rate, assisted_rate, failed = _run_peer(peer, assisted_peer, ids, p)
                    peer_note = f"{peer_note}; {failed}" if failed else peer_note
                runs.append((ids, plain.token_ids, [], pred))
                for name, r in results.items():
                    rows.append(_row(p, name, r, plain, plain_rate, params.greedy, peer_rate, assisted_rate))
                    runs[-1][2].append(rows[-1])
        bar.close()
        rss = peak_rss_mb()  # includes the peer's score buffer when the peer ran
        del peer
    finally:
        for eng in engines.values():
            eng.drafter.close()
        dec.close()
    names += [c for c in dict.fromkeys(r["config"] for r in rows) if c not in names]  # the +prediction, +trees runs
    if curve is not None:  # after the timed runs, so the replays never delay them
        _add_oracle(runs, drafts, oracle_drafters, curve)
    meta = {"target": config.target, "prompts": len(prompts), "temperature": params.temperature,
            "threads": getattr(target, "n_threads", None), "weights": getattr(target, "weights_note", ""), "peak_rss_mb": round(rss, 1),
            "rss_before_peer_mb": round(rss_specdecode, 1),
            "configs": names, "peer": peer_note, "prompts_file": str(config.prompts or "built-in suite"),
            "cost_curve": curve.to_dict() if curve is not None else None,
            "copy_limit": copy_limit(curve) if curve is not None else None,
            "background_load": config.background_load,
            "oracle_drafters": {d: [x.name for x in ds] for d, ds in oracle_drafters.items()}}
    return {"meta": meta, "summary": summarize(rows, names), "rows": rows}
