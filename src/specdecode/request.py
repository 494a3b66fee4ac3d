"""What one generation asks for: :class:`GenerationOptions`, one object from the server's
request parsing (:mod:`specdecode.server.protocol`) through the Python API
(:class:`specdecode.api.Decoder`) to the engine (:meth:`specdecode.engine.SpeculativeEngine.begin`).

The options are checked once, when the object is made, and every error names the option and
what it accepts (a misspelt or mistyped option must not be ignored or fail deep in a step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import SpecDecodeError
from .grammar import Grammar
from .limits import (BATCH_INVARIANCE, DEFAULT_MAX_TOKENS, MAX_CACHE_REUSE, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                     check_logprobs, check_max_tree_nodes, check_num_speculative_tokens, check_text, is_int)
from .sampling import SamplingParams


@dataclass(frozen=True)
class GenerationOptions:
    """One generation's options.

    sampling: how the target's logits become tokens (:class:`SamplingParams`; greedy by default).
    max_tokens: exact cap on generated tokens (>= 1).
    stop: strings that end the output (excluded from it); a str is one stop string.
    logprobs: None, or N (0..MAX_LOGPROBS): the N most likely tokens per emitted token.
    record_top2_gaps: record the target's top-2 logit gap per emitted token (parity reports).
    grammar: structured output (:mod:`specdecode.grammar`), or None.
    plain: decode without the drafter (the baseline on the same loaded target).
    num_speculative_tokens: K for this generation (0..MAX_NUM_SPECULATIVE_TOKENS), or None
        for the engine's.
    batch_invariant: "auto" (on for seeded sampling under the gumbel rule, where the target's
        measured invariant block holds at least 2 tokens), "on" or "off"
        (:data:`specdecode.limits.BATCH_INVARIANCE`): verify in forwards whose every row has
        the logits of a one-token step (:attr:`invariant`), so that no choice of K, drafter or
        batch can change a token, at the cost of smaller verification blocks.
    prediction: the predicted output as target token ids [P] (OpenAI's predicted outputs;
        :mod:`specdecode.drafters.prediction` drafts from it), or None. It never changes the
        output, only how fast it comes.
    draft: which loaded drafter this generation may use: None or "auto" (the engine's, all
        of a controller's sources, planned), "none" (plain decoding), or one source's name
        (a kind such as "ngram", "suffix", "prediction", or a loaded draft model's name).
        With one source named and num_speculative_tokens set, it drafts that many each step
        (no planning); with "auto" num_speculative_tokens is the cap.
    max_tree_nodes: the nodes a tree of drafts may hold in this generation (0..MAX_TREE_NODES;
        0: chains only), or None for the engine's (:func:`specdecode.engine.plan.plan_generation`).
    inputs: request-fed inputs of other drafter kinds, by request field (a kind's
        ``request_field``), each as target token ids [P]: a mapping, kept as sorted
        (field, ids) pairs. ``prediction`` is the one OpenAI names; :meth:`request_inputs`
        gives them all.
    trace: each streamed text delta also says which drafter each piece of its text came from
        and its step (the server's ``speculative.trace``).
    cache_reuse: N > 0: cached chunks of at least N tokens that the prompt holds after its
        common prefix with the slot's cache are shifted into place rather than evaluated again
        (llama.cpp's ``--cache-reuse``, :mod:`specdecode.engine.reuse`; close to, not bitwise,
        a fresh evaluation; never for a batch-invariant generation). 0 (default): off.

    Raises SpecDecodeError (``param`` = the option) for a value of the wrong type or range.
    """

    sampling: SamplingParams = SamplingParams()
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    record_top2_gaps: bool = False
    grammar: Grammar | None = None
    plain: bool = False
    num_speculative_tokens: int | None = None
    batch_invariant: str = "auto"
    prediction: tuple[int, ...] | None = None
    draft: str | None = None
    max_tree_nodes: int | None = None
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    trace: bool = False
    cache_reuse: int = 0

    def request_inputs(self) -> dict[str, tuple[int, ...]]:
        """Every request-fed input by field, the prediction's included."""
        return {**dict(self.inputs), **({"prediction": self.prediction} if self.prediction else {})}

    @property
    def invariant(self) -> bool:
        """Whether this generation verifies batch-invariantly (see batch_invariant)."""
        if self.batch_invariant == "auto":
            return self.sampling.keyed and self.sampling.seed is not None
        return self.batch_invariant == "on"

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise SpecDecodeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}",
                                  param="sampling")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens = {self.max_tokens!r} is out of range: expected an integer "
                                  f"max_tokens >= 1", param="max_tokens")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise SpecDecodeError(f"stop must be a string or a list of strings, got {type(stop).__name__} "
                                  f"{stop!r}", param="stop")
        if any(not isinstance(s, str) or not s for s in stop):
            raise SpecDecodeError(f"stop strings must be non-empty strings, got {list(stop)[:8]!r}", param="stop")
        for i, s in enumerate(stop):
            check_text(s, f"stop[{i}]")
        if len(stop) > MAX_STOP_STRINGS:
            raise SpecDecodeError(f"{len(stop)} stop strings is too many: at most {MAX_STOP_STRINGS}", param="stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise SpecDecodeError(f"a stop string of {longest} characters is too long: at most {MAX_STOP_CHARS}",
                                  param="stop")
        object.__setattr__(self, "stop", stop)
        check_logprobs(self.logprobs)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise SpecDecodeError(f"grammar must be a specdecode.grammar.Grammar (e.g. Grammar.json_schema"
                                  f"({{...}}) or Grammar('regex', '[0-9]+')), got {type(self.grammar).__name__} "
                                  f"{self.grammar!r}", param="grammar")
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens, allow_auto=False)
        if self.batch_invariant not in BATCH_INVARIANCE:
            raise SpecDecodeError(f"batch_invariant = {self.batch_invariant!r} is not one of "
                                  f"{', '.join(BATCH_INVARIANCE)}", param="batch_invariant")
        if self.prediction is not None:
            if not isinstance(self.prediction, (list, tuple)) or not all(is_int(t) and t >= 0 for t in self.prediction):
                raise SpecDecodeError(f"prediction must be the predicted text (a string, or a list of {{\"type\": "
                                      f"\"text\", \"text\": ...}} parts) or its token ids, got "
                                      f"{str(self.prediction)[:60]}", param="prediction")
            object.__setattr__(self, "prediction", tuple(self.prediction))
        check_max_tree_nodes(self.max_tree_nodes)
        self._check_inputs()
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft):
            raise SpecDecodeError(f"draft must be a non-empty string, got {self.draft!r}", param="draft")
        if not is_int(self.cache_reuse) or not 0 <= self.cache_reuse <= MAX_CACHE_REUSE:
            raise SpecDecodeError(f"cache_reuse = {self.cache_reuse!r} is out of range: expected an integer "
                                  f"0..{MAX_CACHE_REUSE} (tokens; 0: off)", param="cache_reuse")
        for name in ("record_top2_gaps", "plain", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecodeError(f"{name} must be True or False, got {getattr(self, name)!r}", param=name)

    def _check_inputs(self) -> None:
        items = self.inputs.items() if isinstance(self.inputs, dict) else self.inputs
        try:
            pairs = sorted((name, tuple(ids)) for name, ids in items)
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or not all(isinstance(n, str) and n and all(is_int(t) and t >= 0 for t in ids)
                                    for n, ids in pairs):
            raise SpecDecodeError(f"inputs must map request fields to token ids (e.g. {{\"hint\": [12, 7]}}), got "
                                  f"{str(self.inputs)[:60]}", param="inputs")
        object.__setattr__(self, "inputs", tuple((n, ids) for n, ids in pairs if ids))

    @classmethod
    def from_kwargs(cls, base: "GenerationOptions | None" = None, **kwargs: Any) -> "GenerationOptions":
        """Options from keyword arguments: the fields above, and the fields of
        :class:`SamplingParams` (temperature, top_p, seed, ...) directly. base: options to
        start from. Raises SpecDecodeError naming an unknown keyword and the known ones."""
        if base is not None and not kwargs:
            return base  # checked when it was made: not again on its way to the engine
        own = {f.name for f in fields(cls)}
        sampling_names = set(SamplingParams.__dataclass_fields__)
        unknown = sorted(set(kwargs) - own - sampling_names)
        if unknown:
            raise SpecDecodeError(f"unknown option(s) {', '.join(unknown)}: the options are "
                                  f"{', '.join(sorted(own - {'sampling'}))} and the sampling options "
                                  f"{', '.join(SamplingParams.__dataclass_fields__)}", param=unknown[0])
        base = base or cls()
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_names}
        if sampling:
            if "sampling" in kwargs:
                raise SpecDecodeError(f"give sampling= or its fields ({', '.join(sorted(sampling))}), not both",
                                      param="sampling")
            kwargs["sampling"] = sampling_params(base.sampling, **sampling)
        return replace(base, **kwargs)


def sampling_params(base: SamplingParams | None = None, **fields_: Any) -> SamplingParams:
    """SamplingParams from keyword arguments (over base); an unknown name or a value of the
    wrong type is a SpecDecodeError naming it (a misspelt option must not be ignored)."""
    known = SamplingParams.__dataclass_fields__
    unknown = sorted(set(fields_) - set(known))
    if unknown:
        raise SpecDecodeError(f"unknown option(s) {', '.join(unknown)}: the sampling options are "
                              f"{', '.join(known)}", param=unknown[0])
    for name, value in fields_.items():
        want = _SAMPLING_TYPES[name]
        if value is None and name == "seed":
            continue
        bad = (want is int and not is_int(value) or want is float and not _is_number(value)
               or want is str and not isinstance(value, str))
        if bad:
            kind = {int: "an integer", float: "a number", str: "a string"}[want]
            raise SpecDecodeError(f"{name} = {value!r} is not {kind}", param=name)
    return replace(base or SamplingParams(), **{k: (float(v) if _SAMPLING_TYPES[k] is float else v)
                                                 for k, v in fields_.items()})


_SAMPLING_TYPES = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
                   "frequency_penalty": float, "presence_penalty": float, "penalty_last_n": int, "seed": int,
                   "sampling_rule": str}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
