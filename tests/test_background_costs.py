"""A start that answers at once on a busy machine (issue 43): ``specdecode serve`` plans with the
cached curve (even a stale one) or a conservative one, and measures the target's T(n) and its
invariant block between requests, a part at a time, on the worker's thread; a stale mark from one
slow run costs a check of three sizes, not a whole measurement, when the machine is busy.

The fake target is a text model of bytes whose forwards advance a scripted clock by a scripted
T(n), and the machine's load is a scripted /proc/stat reading: the tests judge orders and counts
(what the measurement had done when a request was served), never the wall clock."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.cli import build_parser
from specdecode.control import costcache, measure
from specdecode.control.calibration import Calibration
from specdecode.control.costmodel import CostCurve
from specdecode.limits import COST_CURVE_NS
from specdecode.options import decoder_kwargs
from specdecode.server import create_app

from test_server import ServerThread
from test_server_access import ByteBackend

NS = COST_CURVE_NS  # what -k auto measures (K <= 32)
CONTEXT = 64  # tokens the measurement caches before each timed forward


def scripted_t(n: int) -> float:
    """The fake target's T(n) (seconds): flat enough that drafts pay."""
    return 0.03 * (1.0 + 0.15 * (n - 1))


SCRIPTED = CostCurve(NS, tuple(scripted_t(n) for n in NS))


class ClockedBytes(ByteBackend):
    """The byte model of tests/test_server_access.py whose forward of n tokens advances
    ``clock`` by scripted_t(n) and is recorded in ``sizes``."""

    def __init__(self) -> None:
        super().__init__(n_ctx=1024)  # too short for context costs (tests/test_context_costs.py): the curve's parts alone
        self.now = 0.0
        self.sizes: list[int] = []

    def clock(self) -> float:
        return self.now

    def forward(self, token_ids, logits_for, seq=0):
        self.sizes.append(len(token_ids))
        self.now += scripted_t(len(token_ids))
        return super().forward(token_ids, logits_for, seq)


class Load:
    """A scripted /proc/stat and os.times: every reading, other processes used ``others`` of
    the machine's CPU time since the last (100 s of it)."""

    def __init__(self, others: float) -> None:
        self.others, self.busy, self.total = others, 0.0, 0.0

    def __call__(self) -> tuple[float, float, float]:
        self.busy += 100.0 * self.others
        self.total += 100.0
        return self.busy, self.total, 0.0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    return tmp_path


def write_cache(target, cache_dir, curve: CostCurve, **fields) -> None:
    path = costcache.cost_cache_path(target, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**curve.to_dict(), "key": costcache.machine_key(target), "measured_at": time.time(),
                                "others_cpu": 0.0, "source": "measured", **fields}))


def background_decoder(target, others: float = 0.0, **kw) -> Decoder:
    """A Decoder as ``serve`` loads it, its measurements on the target's clock and load."""
    dec = Decoder(target=target, draft="ngram", num_speculative_tokens="auto", progress=False,
                  background_costs=True, **kw)
    dec.calibration.timer, dec.calibration.cpu_times = target.clock, Load(others)
    return dec


def settle(calibration, timeout: float = 60.0) -> None:
    """Wait until the worker has measured everything (a bound on the wait, not a timing)."""
    deadline = time.monotonic() + timeout
    while calibration.pending:
        assert time.monotonic() < deadline, f"still measuring {calibration.measuring()}"
        time.sleep(0.01)
    assert calibration.error is None, calibration.error


def test_serve_measures_between_requests_and_the_python_api_up_front():
    serve = build_parser().parse_args(["serve"])
    generate = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert decoder_kwargs(serve)["background_costs"] is True
    assert decoder_kwargs(generate)["background_costs"] is False


def test_the_server_answers_before_the_curve_is_measured_and_then_plans_with_it(cache, monkeypatch):
    """No cached curve: the server answers /health and a request while the measurement has run
    a few of its parts (the worker measures only while idle, a forward at a time); once it is
    done, the controller plans with the measured curve and the cache holds it."""
    target = ClockedBytes()
    dec = background_decoder(target)
    cal = dec.calibration
    assert cal.measuring() == ["cost curve"] and target.sizes == [8, 1, 1, 1, 1]  # only T(1), after 8 tokens
    conservative = dec.drafter.target_cost.base
    assert conservative.seconds == pytest.approx([n * conservative(1) for n in NS])  # T(n) = n T(1)
    app = create_app(dec)
    worker = app.state.worker

    queued = threading.Event()
    submit = worker.submit
    monkeypatch.setattr(worker, "submit", lambda job: (submit(job), queued.set())[0])
    run_one = cal.run_one

    def gated() -> None:  # the fourth part waits for the test's request: then it is served next
        if cal.parts == 3:
            assert queued.wait(60), "the test's request never came"
        run_one()

    monkeypatch.setattr(cal, "run_one", gated)
    seen = []
    begin = dec.engine.begin
    monkeypatch.setattr(dec.engine, "begin", lambda *a, **k: (seen.append((cal.parts, cal.measuring())),
                                                              begin(*a, **k))[1])
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["measuring"] == ["cost curve"]
        r = http.post("/v1/completions", json={"model": "bytes", "prompt": "hello", "max_tokens": 4,
                                                       "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "k", r.text  # the byte model: "k" after "o"
        assert seen == [(4, ["cost curve"])]  # served after 4 parts of more than a hundred
        settle(cal)
        assert http.get("/health").json()["measuring"] == []
    assert cal.parts > 100 and cal.error is None
    assert dec.drafter.target_cost.base.seconds == pytest.approx(SCRIPTED.seconds)  # measured, not n T(1)
    assert dec.drafter._costs.on_drift is not None  # live drift from the measured curve is reported again
    cached = json.loads(costcache.cost_cache_path(target, cache).read_text())
    assert cached["source"] == "measured" and cached["seconds"] == pytest.approx(SCRIPTED.seconds)
    assert "being measured" not in dec.generate("hello", max_tokens=4).stats.controller_note
    dec.close()


def test_a_stale_cache_on_a_busy_machine_is_checked_not_measured_again(cache):
    """The cache was marked stale (one slow run) and the machine is busy at the next start: the
    server plans with the cached curve at once, checks T(1), T(16) and T(33) between requests,
    finds the machine busy, and keeps the curve: no forward of any other size."""
    target = ClockedBytes()
    cached = CostCurve(NS, tuple(2 * s for s in SCRIPTED.seconds))  # an idle check would contradict it
    write_cache(target, cache, cached, stale="observed 2.0x the measured curve")
    dec = background_decoder(target, others=0.9)
    assert target.sizes == [] and dec.drafter.target_cost.base == cached  # nothing timed before it answers
    with ServerThread(create_app(dec)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        settle(dec.calibration)
    assert set(target.sizes) == {CONTEXT, 1, 16, 33} and len(target.sizes) == 1 + 3 * 4  # warm-ups and 3 rounds
    assert dec.drafter.target_cost.base == cached
    assert "stale" in json.loads(costcache.cost_cache_path(target, cache).read_text())  # checked again next time
    dec.close()


def test_a_stale_mark_costs_a_check_when_the_python_api_measures_up_front(cache, monkeypatch):
    """The same, when the curve is read up front (``specdecode generate``, the Python API): busy,
    the check keeps the cache; idle and agreeing, the stale mark is lifted; idle and contradicting,
    the curve is measured again."""
    target = ClockedBytes()
    monkeypatch.setattr(measure, "read_cpu_times", Load(0.9))
    real = measure.measure_forward_curve
    monkeypatch.setattr(costcache, "measure_forward_curve", lambda b, ns, **kw: real(b, ns, timer=b.clock, **kw))
    write_cache(target, cache, SCRIPTED, stale="observed 1.6x the measured curve")
    assert costcache.cached_measurement(target, NS, cache).curve == SCRIPTED
    assert set(target.sizes) == {CONTEXT, 1, 16, 33}  # the check alone
    path = costcache.cost_cache_path(target, cache)
    assert "stale" in json.loads(path.read_text())

    monkeypatch.setattr(measure, "read_cpu_times", Load(0.0))
    target.sizes.clear()
    assert costcache.cached_measurement(target, NS, cache).curve == SCRIPTED
    assert set(target.sizes) == {CONTEXT, 1, 16, 33} and "stale" not in json.loads(path.read_text())
    target.sizes.clear()
    costcache.cached_measurement(target, NS, cache)  # checked and agreed: trusted as it is
    assert target.sizes == []

    write_cache(target, cache, CostCurve(NS, tuple(2 * s for s in SCRIPTED.seconds)), stale="observed 2.0x")
    m = costcache.cached_measurement(target, NS, cache)
    assert set(target.sizes) == {CONTEXT, *NS} and m.curve.seconds == pytest.approx(SCRIPTED.seconds)


def test_a_strict_request_is_answered_before_the_invariant_block_is_known(cache):
    """The first strict request on a new configuration runs plain one-token steps in
    batch-invariant mode (exactly strict) instead of measuring the block inline; the block is
    measured between requests and the next strict request verifies in blocks of it. A seeded
    request ("auto") meanwhile runs the same plain steps, so its text is the one it keeps."""
    target = ClockedBytes()
    write_cache(target, cache, SCRIPTED)  # the curve is known: only the block is missing
    dec = background_decoder(target)
    cal = dec.calibration
    assert not cal.pending
    with ServerThread(create_app(dec)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "bytes", "prompt": "hello", "max_tokens": 4, "temperature": 0,
                "speculative": {"strict": True}}
        first = http.post("/v1/completions", json=body).json()
        assert first["speculation"]["invariant_block"] == 1 and first["speculation"]["drafted"] == 0
        settle(cal)
        assert cal.invariant_block == target.invariant_block == 33  # a fake's logits hold at every size
        again = http.post("/v1/completions", json=body).json()
        assert again["speculation"]["invariant_block"] == 33
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    dec.close()

    other = ClockedBytes()
    other.name = "bytes, another file"  # another key: nothing cached for it
    write_cache(other, cache, SCRIPTED)
    dec = background_decoder(other)
    sampled = dict(max_tokens=4, temperature=0.8, seed=5)
    before = dec.generate("hello", **sampled)
    assert before.stats.invariant_block == 1 and dec.calibration.measuring() == ["invariant block"]
    while dec.calibration.pending:
        dec.calibration.run_one()
    after = dec.generate("hello", **sampled)
    assert after.stats.invariant_block == 33 and after.text == before.text
    dec.close()


def test_a_measurement_that_fails_is_said_once_and_the_server_goes_on(cache):
    target = ClockedBytes()
    dec = background_decoder(target)
    told = []
    dec.calibration.say = told.append

    def broken(*a, **k):
        raise RuntimeError("the backend went away")

    target.forward = broken
    dec.calibration.run_one()  # its set-up
    dec.calibration.run_one()  # its first forward
    assert not dec.calibration.pending and "the backend went away" in dec.calibration.error
    assert len(told) == 1 and "measuring the cost curve failed" in told[0]
    assert dec.drafter.target_cost.base(33) == pytest.approx(33 * dec.drafter.target_cost.base(1))  # kept
    dec.close()


def test_a_long_cached_prompt_is_kept_for_the_next_turn(cache):
    """An agent's turns: the second prompt is the first one and more, seconds later. Measuring
    between them would overwrite the slot's cache (Codex's second turn read its 9,221 tokens
    again); while a slot holds a prompt of KEEP_CACHE_TOKENS or more the measurement waits
    keep_cache_s after the last request, and the next turn reuses the prompt. With no wait
    (the negative control) the measurement runs between the turns and nothing is reused."""
    from specdecode.server.worker import KEEP_CACHE_TOKENS

    first = "x" * (KEEP_CACHE_TOKENS + 100)
    for keep_s, reused in ((3600.0, True), (0.0, False)):
        target = ClockedBytes()
        target.name = f"bytes, keep {keep_s}"  # a cache key of its own: a whole measurement is pending
        dec = background_decoder(target)
        cal = dec.calibration
        assert cal.pending
        parts = []

        def a_part() -> None:  # a measurement that never ends: each part overwrites the slots' caches
            dec.engine.forget_prefix()
            parts.append(1)
            time.sleep(0.001)

        cal.run_one = a_part
        app = create_app(dec)
        app.state.worker.keep_cache_s = keep_s
        with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": target.name, "prompt": first, "max_tokens": 2, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
            done = len(parts)
            if not reused:  # wait until the worker has measured a part (a bound, not a timing)
                deadline = time.monotonic() + 60
                while len(parts) == done:
                    assert time.monotonic() < deadline, "the worker never measured"
                    time.sleep(0.01)
            r = http.post("/v1/completions", json={**body, "prompt": first + "yy"}).json()
            cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached >= len(first) - 1) if reused else cached == 0, (keep_s, cached)
            if reused:
                assert len(parts) == done  # nothing measured between the turns
        dec.close()


class TwinnedBytes(ClockedBytes):
    """:class:`ClockedBytes` that makes scratch twins, as the llama.cpp backend does: a byte model
    of its own cache whose forwards advance the owner's clock and count in ``twin_forwards``."""

    def __init__(self, owner: "TwinnedBytes | None" = None) -> None:
        super().__init__()
        self.owner, self.twins, self.closed, self.twin_forwards = owner, [], False, 0

    def forward(self, token_ids, logits_for, seq=0):
        if self.owner is None:
            return super().forward(token_ids, logits_for, seq)
        self.owner.now += scripted_t(len(token_ids))
        self.owner.twin_forwards += 1
        return ByteBackend.forward(self, token_ids, logits_for, seq)

    def scratch_twin(self, n_ctx, n_seq=None, mode=None):
        twin = TwinnedBytes(owner=self)
        twin.name = self.name  # what it measures is cached under the target's key
        self.twins.append(twin)
        return twin

    def close(self) -> None:
        self.closed = True


def test_measuring_on_a_scratch_twin_keeps_an_editors_cached_prompt(cache):
    """A fresh server measures between requests; on a backend that makes a scratch twin (llama.cpp:
    a KV cache of its own) the parts never touch the slot, so an editor's next keystroke reuses
    its prompt while the measurement goes on (issue 60: on a server just started, a keystroke read
    all 152 of its 152 tokens again). Negative control: a backend without a twin forgets the slot
    at every part. Once everything is measured the twin is closed."""
    prompt = "def area(radius):\n    return 3.14159 * radius * radius\n" * 3
    for twinned in (True, False):
        target = TwinnedBytes() if twinned else ClockedBytes()
        target.name = f"bytes, twinned {twinned}"
        dec = background_decoder(target)
        cal = dec.calibration
        assert cal.pending
        allowed = [0]  # parts the worker may run now
        run_one = cal.run_one

        def gated() -> None:
            if allowed[0] > 0:
                allowed[0] -= 1
                run_one()
            else:
                time.sleep(0.001)

        cal.run_one = gated
        with ServerThread(create_app(dec)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": target.name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
            done, allowed[0] = cal.parts, 3  # three parts between the two keystrokes
            deadline = time.monotonic() + 60
            while cal.parts < done + 3:
                assert time.monotonic() < deadline, "the worker never measured"
                time.sleep(0.01)
            r = http.post("/v1/completions", json={**body, "prompt": prompt + "x"}).json()
            cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached == len(prompt)) if twinned else cached == 0, (twinned, cached)
            allowed[0] = 1 << 30
            settle(cal)
        if twinned:
            assert len(target.twins) == 1 and target.twins[0].closed and target.twin_forwards > 100
            assert costcache.cost_cache_path(target, cal.cache_dir).exists()
        dec.close()


class PartsOnTheClock:
    """A stand-in for the decoder's Calibration: never done, each part takes ``part_s`` on the
    target's scripted clock and is logged with the clock's time; ``private`` as a scratch twin
    makes it (its parts leave the slots alone)."""

    def __init__(self, target, private: bool, part_s: float = 0.2) -> None:
        self.target, self.private, self.part_s, self.at = target, private, part_s, []
        self.pending, self._budget = True, 0.0

    between_steps = Calibration.between_steps  # the rule under test, on this stand-in

    def run_one(self) -> None:
        self.at.append(self.target.now)
        self.target.now += self.part_s

    def before_generation(self, options):
        return options

    def measuring(self) -> list[str]:
        return ["cost curve"] if self.pending else []

    def close(self) -> None:
        self.pending = False

    error = None


def test_a_measurement_on_a_scratch_twin_takes_its_share_between_a_streams_steps(cache):
    """Issue 61: under steady traffic a measurement was still pending after 425 s, nothing
    drafting meanwhile; an editor's server measured only after 548 s of idle. Measured on a
    scratch twin, parts run between a running generation's steps, within MEASURE_SHARE of the
    time served (judged on the scripted clock), and never wait for idle while a slot holds a
    long prompt. Negative control: parts that would touch the slots run only when idle."""
    from test_chunked_prefill import MODEL as CLOCKED, ClockedBytes as Clocked
    from specdecode.control.calibration import MEASURE_SHARE
    from specdecode.server.worker import KEEP_CACHE_TOKENS

    for private in (True, False):
        target = Clocked(n_seq=1)
        dec = Decoder(target=target, draft="none", num_speculative_tokens=0, progress=False)
        fake = dec.calibration = PartsOnTheClock(target, private)
        app = create_app(dec)
        worker = app.state.worker
        worker.clock, worker.keep_cache_s = target.clock, 3600.0
        fake.pending = False  # nothing to measure while the server starts
        with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            fake.pending = True
            start = target.now
            body = {"model": CLOCKED, "prompt": "x" * (KEEP_CACHE_TOKENS + 8), "max_tokens": 400, "temperature": 0}
            assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 400
            during = [t for t in fake.at if t < target.log[-1][4]]
            if private:
                served = target.log[-1][4] - start
                assert len(during) >= 10  # the stream's steps left room for parts all along
                assert len(during) * fake.part_s <= MEASURE_SHARE * served + fake.part_s
                assert worker._keep_cache_for() == 0.0  # and idle time is not held back for the slot
            else:
                assert during == [] and worker._keep_cache_for() > 0  # only when idle, after keep_cache_s
            fake.pending = False
        dec.close()


def test_generate_plans_with_a_stale_cached_curve_at_once_and_checks_it_between_steps(cache):
    """Issue 61: with both cores busy, ``specdecode generate`` re-measured a cached curve at 33
    sizes for over 7 minutes before its first token. The Python API (and so ``generate`` and
    ``bench``) now plans with a cached curve at once, stale or not, and checks it between the
    steps of its own streams on a scratch twin; busy, the check keeps the curve."""
    target = TwinnedBytes()
    target.name = "bytes, stale"
    cached = CostCurve(NS, tuple(2 * s for s in SCRIPTED.seconds))
    write_cache(target, cache, cached, stale="observed 2.0x the measured curve")
    dec = Decoder(target=target, draft="ngram", num_speculative_tokens="auto", progress=False)
    dec.clock, dec.calibration.timer, dec.calibration.cpu_times = target.clock, target.clock, Load(0.9)
    assert dec.calibration.pending and dec.drafter.target_cost.base == cached
    assert target.sizes == [] and target.twin_forwards == 0  # nothing timed before the first token
    dec.generate("hello", max_tokens=4)
    assert target.twin_forwards <= 2  # at most a part or two, within its share of the steps
    for _ in range(500):
        if not dec.calibration.pending:
            break
        dec.generate("hello", max_tokens=4)
    assert not dec.calibration.pending and dec.calibration.error is None
    assert target.twin_forwards == 1 + 3 * 4  # the check's context, 3 sizes' warm-ups and 3 rounds
    assert dec.drafter.target_cost.base == cached  # busy: kept
    assert target.twins[0].closed
    dec.close()
