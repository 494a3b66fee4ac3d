"""One prompt's timed runs in ``specdecode bench``: plain decoding and each configuration, for
each variant (each value of a ``--vary`` setting; one variant without it), in an order that
rotates from one prompt to the next, and the row each run leaves in the result.

A drafter that keeps a history of earlier requests (suffix drafting) sees the bench's prompts
in file order, as a server would; a prompt's second run of a configuration (with its
prediction) starts from the history its first run started from (:func:`history_as`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..api import Decoder
from ..control.costmodel import CostCurve
from ..engine import SpeculativeEngine
from ..output import GenerationResult
from ..parity import parity_report
from ..sampling import SamplingParams
from .config import WITH_PREDICTION, WITH_TREES, run_label
from .peers import decode_rate
from .suite import BenchPrompt


@dataclass
class Variant:
    """The engines of one value of the varied setting (or of the bench without ``--vary``).

    value: the value ("off"), None without --vary; label: "SETTING=VALUE" or "".
    params, fields: the sampling settings and the extra generation fields of its every run.
    dec: its Decoder (the target and the plain engine; shares_target: the first variant's,
    for a generation setting); engines: configuration row name -> engine, each with a drafter
    of its own. note: what its loaded target reports of a load
    setting. oracle_drafters, curve: its oracle's lookup drafters per draft and the target's
    T(n) (:mod:`.oracle`); runs: (prompt ids, plain output, its rows, prediction) per prompt,
    for the oracle's replay.
    """

    value: str | None
    label: str
    params: SamplingParams
    fields: dict
    dec: Decoder | None = None
    engines: dict[str, SpeculativeEngine] = field(default_factory=dict)
    note: str = ""
    oracle_drafters: dict[str, list] = field(default_factory=dict)
    curve: CostCurve | None = None
    context_costs: Any = None  # what a step costs more at its context (the oracle prices each step at its own)
    runs: list = field(default_factory=list)
    shares_target: bool = False

    def name(self, config: str) -> str:
        """A configuration's run name in this variant (:func:`specdecode.bench.config.run_label`)."""
        return run_label(config, self.label)

    def close(self) -> None:
        """Free the drafters' models and the target."""
        for eng in self.engines.values():
            eng.drafter.close()
        if self.dec is not None and not self.shares_target:
            self.dec.close()


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


def _run_plain(v: Variant, p: BenchPrompt, ids: list[int], fresh: bool = False) -> GenerationResult:
    if fresh:
        v.dec.engine.forget_prefix()
    return v.dec.engine.generate(ids, sampling=v.params, max_tokens=p.max_tokens, record_top2_gaps=True,
                                 grammar=p.grammar, **v.fields)


def _run_configs(v: Variant, p: BenchPrompt, ids: list[int], prediction: list[int] | None,
                 trees: int | None, fresh: bool = False) -> dict[str, GenerationResult]:
    out = {}
    forget = (lambda eng: eng.forget_prefix()) if fresh else (lambda eng: None)  # noqa: E731
    for name, eng in v.engines.items():
        nodes = trees if name.endswith(WITH_TREES) else 0 if trees else None  # None: the engine's default
        again = prediction and follows_prediction(eng.drafter)
        learners = history_keepers([eng.drafter]) if again else []
        before = [d.history_state() for d in learners]
        forget(eng)
        out[name] = eng.generate(ids, sampling=v.params, max_tokens=p.max_tokens, grammar=p.grammar,
                                 max_tree_nodes=nodes, **v.fields)
        if again:
            forget(eng)
            with history_as(learners, before):  # not the answer the run above just stored
                out[name + WITH_PREDICTION] = eng.generate(ids, sampling=v.params, max_tokens=p.max_tokens,
                                                           grammar=p.grammar, prediction=prediction, **v.fields)
    return out


def time_prompt(p: BenchPrompt, ids: list[int], i: int, variants: list[Variant], prediction: list[int] | None = None,
                trees: int | None = None, fresh: bool = False) -> list[tuple[GenerationResult, dict[str, GenerationResult]]]:
    """The i-th prompt's plain run and each configuration's (row name -> result), per variant.

    The runs go in units, each variant's plain run and its configurations' runs
    ([plain A, configs A, plain B, configs B, ...]), the order rotated by one unit per prompt:
    without --vary, plain goes first on even prompts and last on odd ones; with it, each unit
    takes each place in turn, so that load changing over the run weighs on every side alike.
    With a prediction (its token ids), each configuration that follows one runs again with it, as
    ``NAME+prediction``, from the suffix history as it was before the configuration's first
    run of this prompt (:func:`history_as`); with trees (a node budget > 0), the engines named
    ``NAME+trees`` (drafters of their own) run with trees and the others with chains. fresh:
    every run reads its whole prompt (no prefix reused from the run before: beside a peer that
    reads its own whole).
    """
    units = [(v, plain) for v in range(len(variants)) for plain in (True, False)]
    start = i % len(units)
    done: dict[tuple[int, bool], object] = {}
    for v, plain in units[start:] + units[:start]:
        variant = variants[v]
        done[v, plain] = (_run_plain(variant, p, ids, fresh) if plain
                          else _run_configs(variant, p, ids, prediction, trees, fresh))
    return [(done[v, True], done[v, False]) for v in range(len(variants))]


def plain_rate(plain: GenerationResult) -> float:
    """A plain run's decode tokens/s (:func:`specdecode.bench.peers.decode_rate`)."""
    s = plain.stats
    return decode_rate(s.completion_tokens, s.first_token_s, s.prefill_s + s.decode_s)


def make_row(p: BenchPrompt, name: str, result: GenerationResult, plain: GenerationResult, greedy: bool,
             peer_rate: float | None, assisted_rate: float | None, vary: str = "") -> dict:
    """The result row of one configuration's run of a prompt (rates in tokens/s; parity with
    the same variant's plain run when greedy, "n/a" when sampling; same_as_plain: the same
    tokens as that plain run, what a seed promises under batch invariance; vary: the variant's
    "SETTING=VALUE", or None; decode_s, plain_decode_s: seconds from the end of the prefill to
    the last token, the time to the whole answer (a completion's whole middle) that the user
    waits beyond the prompt; plain_completion_tokens: the plain answer's length (it differs where a
    near-tie sent greedy decoding another way); prompt_cached: the prompt's tokens a slot's cache
    already held; prefill_s, plain_prefill_s: seconds reading the prompt)."""
    s = result.stats
    return {
        "id": p.id, "category": p.category, "config": name, "vary": vary or None, "grammar": p.grammar is not None,
        "finish_reason": result.finish_reason,
        "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
        "plain_completion_tokens": plain.stats.completion_tokens,
        "spec_tokens_per_s": decode_rate(s.completion_tokens, s.first_token_s, s.prefill_s + s.decode_s),
        "plain_tokens_per_s": plain_rate(plain),
        "decode_s": s.decode_s, "plain_decode_s": plain.stats.decode_s, "prompt_cached": s.prompt_cached,
        "prefill_s": s.prefill_s, "plain_prefill_s": plain.stats.prefill_s,
        "drafted": s.drafted, "accepted": s.accepted, "target_forward_passes": s.target_forward_passes,
        "accepted_per_position": s.accepted_per_position, "drafted_per_position": s.drafted_per_position,
        "k_histogram": {str(k): v for k, v in s.k_histogram.items()},
        "tree_steps": s.tree_steps, "tree_nodes": s.tree_nodes,
        "parity": parity_report(result, plain)["status"] if greedy else "n/a",
        "same_as_plain": result.token_ids == plain.token_ids,
        "peer_tokens_per_s": peer_rate,
        "peer_assisted_tokens_per_s": assisted_rate,
        "oracle_time_s": None, "oracle_plain_time_s": None,  # filled in by the runner's oracle
    }
