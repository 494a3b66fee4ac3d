"""The cost-aware controller against the lookup oracle, replayed on recorded outputs at no
model cost: how much of the oracle the controller's choices reach, free of the machine's noise.

``specdecode bench`` sets each configuration's measured speedup beside the oracle of lookup
drafting (:mod:`specdecode.bench.oracle`), but the measured side carries the machine's noise
(a run of one long prompt moves by 5-10% on a shared 2-core CPU). This script records each
prompt's greedy output once with the real target (plain decoding, with each token's top-1
log-probability; cached in ``--outputs``), then runs the real engine and controller over the
lookup drafters ("auto" without a draft model) against a replay target: it answers each
verification with the recorded token (its top-1 probability as recorded, so the controller's
confidence feature sees what it saw live) and advances a clock by T(n) at the step's context
(the target's cached curve and context costs, the same the bench's oracle prices with). The
controller's decode time on that clock over the oracle's is the fraction of the oracle that its
choices reach; the script checks that the replay commits exactly the recorded output.

    python benchmarks/controller_replay.py --categories agent_long_2k,agent_long_4k --ctx-size 8192

Units: seconds of the cost clock (T(n) in seconds); no wall-clock time is measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from specdecode.api import Decoder
from specdecode.assembly import registry
from specdecode.backends import BackendBase
from specdecode.bench import load_prompts, lookup_drafters, oracle_replay, select_prompts
from specdecode.control.controller import Source, SpeculationController
from specdecode.control.costmodel import ObservedCurve
from specdecode.drafters.kinds import kind_of
from specdecode.engine import SpeculativeEngine
from specdecode.limits import MAX_NUM_SPECULATIVE_TOKENS


class ReplayTarget(BackendBase):
    """A target whose greedy continuation of ``prompt`` is ``output`` (token ids), with the
    top-1 probability of output[i] = probs[i]; each forward of n tokens after c cached ones
    advances ``now`` by T(n) + extra(n, c) (``cost(n, c)``, seconds). The first forward (the
    prompt) is free: only decoding is timed. Logits are [rows, V] float32."""

    name = "replay"
    path = None
    n_threads = 1
    device = "cpu"
    invariant_block = None
    invariant_mode = False

    def __init__(self, like, prompt: list[int], output: list[int], probs: list[float], cost) -> None:
        self.like, self.prompt, self.output, self.probs, self.cost = like, prompt, output, probs, cost
        self.cache: list[int] = []
        self.now = 0.0
        self.forwards = 0

    def clock(self) -> float:
        return self.now

    def token_bytes(self, token_id: int) -> bytes:
        return self.like.token_bytes(token_id)

    def token_text(self, token_id: int) -> bytes:
        return self.like.token_text(token_id)

    def seq_len(self, seq: int = 0) -> int:
        return len(self.cache)

    kv_len = property(lambda self: len(self.cache))
    n_vocab = property(lambda self: self.like.n_vocab)
    n_ctx = property(lambda self: self.like.n_ctx)
    eog_ids = property(lambda self: self.like.eog_ids)

    def set_batch_invariant(self, on: bool) -> None:
        self.invariant_mode = on

    def logits_row(self, position: int) -> np.ndarray:
        i = position + 1 - len(self.prompt)
        tok = self.output[i] if 0 <= i < len(self.output) else min(self.eog_ids)
        p = min(max(self.probs[i] if 0 <= i < len(self.probs) else 0.99, 1e-6), 1 - 1e-6)
        row = np.zeros(self.n_vocab, dtype=np.float32)
        row[tok] = np.log(p * (self.n_vocab - 1) / (1 - p))  # softmax top-1 = p
        return row

    def forward(self, token_ids, logits_for, seq=0):
        start = len(self.cache)
        if start:  # decoding: the prompt's forward is not timed
            self.now += self.cost(len(token_ids), start)
        self.forwards += 1
        self.cache.extend(int(t) for t in token_ids)
        rows = [self.logits_row(start + i) for i in logits_for]
        return np.stack(rows) if rows else np.zeros((0, self.n_vocab), dtype=np.float32)

    def forward_batch(self, items):
        return [self.forward(ids, logits_for, seq) for seq, ids, logits_for in items]

    def rollback(self, n: int, seq: int = 0) -> None:
        del self.cache[n:]

    def close(self) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=registry.DEFAULT_TARGET)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--categories", default="agent_long_2k,agent_long_4k")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--kmax", type=int, default=MAX_NUM_SPECULATIVE_TOKENS)
    ap.add_argument("--outputs", default="controller_replay_outputs.json",
                    help="recorded greedy outputs (read if present, else recorded and written)")
    ap.add_argument("--prediction", action="store_true", help="hand each prompt's prediction to the drafters")
    ap.add_argument("--fresh", action="store_true",
                    help="a new controller and new lookups for each prompt (default: kept across prompts in order, "
                         "as in the bench)")
    return ap


def _record(dec: Decoder, prompts, path: Path) -> dict:
    """{prompt id: {"prompt": ids, "output": ids, "probs": top-1 probabilities}}, recorded with
    plain greedy decoding where ``path`` lacks them (written atomically)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    for p in prompts:
        if p.id in data:
            continue
        ids = dec.prompt_ids(p.prompt, p.messages, p.tools)
        r = dec.generate(prompt_ids=ids, max_tokens=p.max_tokens, plain=True, logprobs=0)
        data[p.id] = {"prompt": list(ids), "output": list(r.token_ids),
                      "probs": [float(np.exp(lp.logprob)) for lp in r.logprobs]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        print(f"recorded {p.id}: {len(ids)} prompt tokens, {len(r.token_ids)} output", flush=True)
    return data


def lookup_controller(curve: ObservedCurve, kmax: int) -> SpeculationController:
    """The cost-aware controller over fresh lookup drafters ("auto" without a draft model),
    planning with ``curve`` (T(n), with its context costs or none) and learning from the
    replayed steps; kept across prompts, as a bench configuration keeps its engine."""
    sources = [Source(d, kind_of(d.name)[0].cost_s) for d in lookup_drafters("auto")]
    controller = SpeculationController(sources, curve.base, kmax=kmax, learn_costs=True)
    controller.target_cost.context = curve.context
    return controller


def replay(like, rec: dict, curve: ObservedCurve, controller: SpeculationController,
           prediction=None) -> tuple[float, dict]:
    """Decode seconds of ``controller`` on the cost clock over one recording, and its step
    counts. like: the real target (its vocabulary); rec: a recording (:func:`_record`);
    curve: T(n), with its context costs or none; prediction: token ids or None. Raises
    AssertionError if the replay's output differs from the recording."""
    base, context = curve.base, curve.context
    cost = (lambda n, c: base(n) + float(context(n, c))) if context is not None else (lambda n, c: base(n))
    target = ReplayTarget(like, rec["prompt"], rec["output"], rec["probs"], cost)
    engine = SpeculativeEngine(target, controller, controller.kmax)
    before = dict(controller.choices)
    real = time.perf_counter
    time.perf_counter = target.clock  # the engine and controller time steps with it
    try:
        r = engine.generate(rec["prompt"], max_tokens=len(rec["output"]), prediction=prediction)
    finally:
        time.perf_counter = real
    assert list(r.token_ids) == rec["output"], "the replay committed another output than the recording"
    choices = {k: v - before.get(k, 0) for k, v in controller.choices.items() if v - before.get(k, 0)}
    return target.now, {"passes": r.stats.target_forward_passes, "drafted": r.stats.drafted,
                        "accepted": r.stats.accepted, "choices": choices}


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    prompts = select_prompts(load_prompts(None), args.categories.split(","), args.per_category)
    with Decoder(target=args.target, draft="auto", n_ctx=args.ctx_size, progress=False) as dec:
        data = _record(dec, prompts, Path(args.outputs))
        curve = dec.engine.drafter.target_cost
        base, context = curve.base, curve.context
        print(f"{'prompt':18} {'ctx':>6} {'out':>4} {'plain s':>8} {'oracle':>7} {'ctrl':>6} {'of it':>6}  "
              "passes drafted/accepted")
        sums = np.zeros(3)
        controller, oracle_drafters = lookup_controller(curve, args.kmax), lookup_drafters("auto")
        for p in prompts:
            rec = data[p.id]
            if args.fresh:
                controller, oracle_drafters = lookup_controller(curve, args.kmax), lookup_drafters("auto")
            pred = dec.input_ids(p.prediction) if args.prediction and p.prediction else None
            o = oracle_replay(rec["prompt"], rec["output"], base, oracle_drafters, kmax=args.kmax,
                              prediction=pred, context_costs=context)
            t, books = replay(dec.target, rec, curve, controller, tuple(pred) if pred else None)
            sums += (o.plain_s, o.time_s, t)
            print(f"{p.id:18} {len(rec['prompt']):6} {len(rec['output']):4} {o.plain_s:8.2f} {o.speedup:6.2f}x "
                  f"{o.plain_s / t:5.2f}x {o.time_s / t:6.0%}  {books['passes']} {books['drafted']}/"
                  f"{books['accepted']} {books['choices']}", flush=True)
        print(f"{'all':18} {'':6} {'':4} {sums[0]:8.2f} {sums[0] / sums[1]:6.2f}x {sums[0] / sums[2]:5.2f}x "
              f"{sums[1] / sums[2]:6.0%}")


if __name__ == "__main__":
    main()
