"""The kinds of drafter that ``--draft`` (and ``Decoder(draft=...)``, the server, the bench
configurations ``DRAFT:K``) can name: one row each, read by the ``--draft`` help, option
validation, loading (:mod:`specdecode.assembly.loading`) and the bench's oracle.

This module is the one reader of a speculation choice: :func:`resolve` turns ``draft`` and
K, as a Decoder, the bench or the server is built with, into a :class:`Choice`;
:func:`resolve_request` turns one generation's own ``draft``, K and request-fed inputs into
what its engine runs and what its drafter is asked (:class:`specdecode.drafters.base.DraftingRequest`).
A kind fed by the request (OpenAI's ``prediction``) names its field in its row
(``request_field``): the server then takes that field, tokenizes it, and hands it to the
drafter through its one door, ``configure``. So a request-fed drafter, too, is one file here
and one row.

A new drafter is one file in this package and one row in :data:`KINDS`. A row builds its
drafter from a :class:`DraftRequest`, which the assembly layer fills (drafters load no
model themselves: ``request.load_model`` does). A kind whose drafter cannot be forked for
concurrent generations says ``parallel=False``, and ``parallel > 1`` refuses it by name.

``auto`` is not a kind: it is the cost-aware controller over the kinds marked ``in_auto``
and the registry's default draft model (:func:`specdecode.assembly.loading.make_controller`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from ..errors import IncompatibleVocabularyError, SpecDecodeError
from ..limits import AUTO_KMAX, DRAFT_VOCAB_METHODS, check_num_speculative_tokens
from ..backends.vocab import check_vocab_compatible
from .base import Drafter, DraftingRequest, NoDrafter
from .cross_vocab import CrossVocabDrafter
from .heads import load_heads_drafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .prediction import PredictionDrafter
from .suffix import SuffixDrafter

if TYPE_CHECKING:
    from ..backends.base import Backend

AUTO = "auto"
# Seconds per proposed token the controller starts from for drafters without a model to
# measure (it then follows what proposals are observed to cost).
LOOKUP_COST_S = 2e-4  # a numpy scan of the context: negligible next to a forward
HEADS_COST_S = 2e-3  # K (H^2 + S H) multiply-adds


@dataclass(frozen=True)
class DraftRequest:
    """What building a drafter may use.

    target: the loaded target. arg: what follows ``KIND:`` in the name (``heads:FILE`` ->
    FILE), or the whole name for a draft model (or a loaded draft Backend itself, e.g. a
    :class:`specdecode.backends.module.ModuleBackend`). load_model(name): loads a draft model
    on the draft backend with the decoder's context, threads, dtype, device and sequences
    (a Backend given as arg is returned as it is).
    draft_vocab: a torch draft model's output subset (0 = all), or how a draft model of another
    tokenizer drafts ("slem", "tli"; :mod:`specdecode.drafters.cross_vocab`).
    """

    target: "Backend"
    arg: "str | Backend"
    load_model: Callable[["str | Backend"], "Backend"]
    draft_vocab: int | str = 0


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    name: the kind's name (and how ``--draft`` names it, with ``:ARG`` when ``arg`` is set).
    usage, help: for the ``--draft`` help. build: the drafter for a request.
    arg: the meaning of ``NAME:ARG`` ("" for a kind that takes none).
    options: the draft options it uses ("draft_backend", "draft_vocab", "draft_gpu_layers"); any other given
        with it is refused by name. cost_s: the controller's starting cost per drafted token
        (seconds); None: measured (a draft model). in_auto: a free lookup that ``auto``
        always drafts with (and the bench's oracle replays). parallel: forks for
        concurrent generations.
    request_field: the request field whose text it drafts from ("" for none): the server
        accepts the field (OpenAI's content shape, ``{"type": "content", "content": ...}``),
        the Python API takes it in ``inputs``, and either hands its tokens over in
        ``DraftingRequest.inputs``.
    """

    name: str
    usage: str
    help: str
    build: Callable[[DraftRequest], Drafter]
    arg: str = ""
    options: frozenset[str] = frozenset()
    cost_s: float | None = LOOKUP_COST_S
    in_auto: bool = False
    parallel: bool = True
    request_field: str = ""


def _model(req: DraftRequest) -> Drafter:
    """A draft model: of the target's tokenizer, a :class:`ModelDrafter`; of another, a
    :class:`CrossVocabDrafter` by the method ``draft_vocab`` names ("slem", "tli"; else chosen
    per generation). An integer draft_vocab above 0, an output subset, needs the target's
    tokenizer."""
    backend = req.load_model(req.arg)
    method = req.draft_vocab if req.draft_vocab in DRAFT_VOCAB_METHODS else "auto"
    try:
        if method == "auto" and int(req.draft_vocab) > 0 and req.target is not None:
            try:  # before the output-subset check: across tokenizers no backend would serve it
                check_vocab_compatible(backend, req.target)
            except IncompatibleVocabularyError as e:
                raise IncompatibleVocabularyError(
                    f"draft_vocab = {req.draft_vocab} (an output subset) needs a draft model of the target's tokenizer: "
                    f"{e}; without it (or with slem|tli) {backend.name} drafts across tokenizers",
                    param="draft_vocab") from None
        try:
            return ModelDrafter(backend, target=req.target, vocab_subset=0 if method != "auto" else int(req.draft_vocab))
        except IncompatibleVocabularyError:
            if req.draft_vocab not in (0, *DRAFT_VOCAB_METHODS) or not (
                    backend.has_text and req.target.has_text):
                raise
            return CrossVocabDrafter(backend, req.target, method=str(method))
    except SpecDecodeError:
        backend.close()
        raise


MODEL = DrafterKind("model", "NAME|PATH", "a draft model: registry name, .gguf path or Hugging Face folder (of "
                    "another tokenizer too: --draft-vocab)",
                    _model, options=frozenset({"draft_backend", "draft_vocab", "draft_gpu_layers"}), cost_s=None)

KINDS: tuple[DrafterKind, ...] = (
    DrafterKind("none", "none", "plain decoding", lambda req: NoDrafter(), cost_s=0.0),
    DrafterKind("ngram", "ngram", "prompt lookup", lambda req: NgramDrafter(), in_auto=True),
    DrafterKind("suffix", "suffix", "lookup in this and earlier requests", lambda req: SuffixDrafter(), in_auto=True),
    DrafterKind("prediction", "prediction", "the request's predicted output (prediction=, --prediction-file)",
                lambda req: PredictionDrafter(), in_auto=True, request_field="prediction"),
    DrafterKind("heads", "heads:FILE", "draft heads trained on the target (specdecode heads train)",
                lambda req: load_heads_drafter(req.arg, req.target), arg="FILE", cost_s=HEADS_COST_S),
    MODEL,
)


def kind_of(draft: "str | Backend") -> tuple[DrafterKind, "str | Backend"]:
    """The kind a ``--draft`` value names and its argument: ``"ngram"`` -> (ngram, ""),
    ``"heads:f.safetensors"`` -> (heads, "f.safetensors"); anything else is a draft model
    named by it, as is a loaded Backend (-> (model, the backend)). Raises SpecDecodeError
    for "auto" (not a kind) or anything else that is not a non-empty string."""
    from ..backends.base import Backend

    if isinstance(draft, Backend):
        return MODEL, draft
    if not isinstance(draft, str) or not draft:
        raise SpecDecodeError(f"draft must be a non-empty string, got {draft!r}", param="draft")
    if draft == AUTO:
        raise SpecDecodeError("draft 'auto' is the controller over several kinds, not one kind", param="draft")
    for kind in KINDS:
        if kind is MODEL:
            continue
        if kind.arg and draft.startswith(kind.name + ":"):
            return kind, draft[len(kind.name) + 1:]
        if not kind.arg and draft == kind.name:
            return kind, ""
    return MODEL, draft


def names_with_arg(text: str) -> bool:
    """Whether text starts as a kind with an argument is named (``heads:...``)."""
    return any(kind.arg and text.startswith(kind.name + ":") for kind in KINDS)


def check_draft_options(draft: str, parallel: int = 1, **given: object) -> None:
    """Refuse a draft option the named drafter does not use, and ``parallel > 1`` for a kind
    that serves one generation. given: option name -> value, where a value that is falsy or
    "auto" means not given. "auto" uses what its default draft model uses.
    Raises SpecDecodeError naming the option and the drafter."""
    for name, value in given.items():
        if value and value != AUTO and not uses_option(draft, name):
            raise SpecDecodeError(f"{name} = {value!r} applies to a draft model; draft {draft!r} has none",
                                  param=name)
    if draft != AUTO and parallel > 1 and not kind_of(draft)[0].parallel:
        raise SpecDecodeError(f"draft {draft!r} serves one generation at a time: parallel = {parallel} needs "
                              f"another drafter", param="parallel")


def uses_option(draft: str, name: str) -> bool:
    """Whether the drafter ``draft`` names ("auto": its default draft model) uses the draft
    option ``name`` ("draft_vocab", "draft_backend")."""
    return name in (MODEL.options if draft == AUTO else kind_of(draft)[0].options)


def draft_help(default_draft: str) -> str:
    """The ``--draft`` help, from the table."""
    kinds = ", ".join(f"'{k.usage}' ({k.help})" for k in KINDS)
    return (f"{kinds}, or 'auto' (lookups when they match, and the default draft model {default_draft} when it "
            f"shares the target's tokenizer and pays) (default: %(default)s)")


def auto_kinds() -> list[DrafterKind]:
    """The free lookups that ``auto`` drafts with."""
    return [k for k in KINDS if k.in_auto]


def request_fields() -> list[str]:
    """The request fields that feed a kind of drafter (``prediction``, and any a new row names)."""
    return [k.request_field for k in KINDS if k.request_field]


@dataclass(frozen=True)
class Choice:
    """A speculation choice, resolved once (:func:`resolve`) for a Decoder, the bench or a server.

    names: the drafters (a kind's name with its argument, a draft model's name or loaded
        Backend); empty for plain decoding. default_model: also the registry's default draft
        model, where it shares the target's tokenizer (``auto``). k: the engine's K, the cap
        on drafted tokens per step. planned: the cost-aware controller chooses the drafter
        and K <= k each step; else names[0] drafts k tokens every step.
    """

    names: tuple = ()
    k: int = 0
    planned: bool = False
    default_model: bool = False


def resolve(draft: "str | Backend", k: "int | str") -> Choice:
    """``draft`` ("auto", "none", a kind, a draft model) and K (0..32 or "auto") as one Choice.
    "auto" as K plans K <= AUTO_KMAX; "auto" as draft plans over the free lookups of the table
    and the default draft model (an integer K is then the cap; 0 is plain decoding).
    Raises SpecDecodeError naming ``draft`` or ``num_speculative_tokens``."""
    k = check_num_speculative_tokens(k)
    cap = AUTO_KMAX if k == "auto" else k
    if draft == "none":
        return Choice((), cap)
    if draft == AUTO:
        return Choice(tuple(kind.name for kind in auto_kinds()), cap, True, True) if cap else Choice()
    kind_of(draft)  # validates
    return Choice((draft,), cap, planned=k == "auto")


@dataclass(frozen=True)
class RequestChoice:
    """What one generation runs (:func:`resolve_request`): plain decoding, or K (the cap on
    drafted tokens per step) with ``drafting`` handed to its drafter's ``configure``."""

    plain: bool
    k: int
    drafting: DraftingRequest


def resolve_request(draft: str | None, k: int | None, engine_k: int, inputs: Mapping[str, tuple],
                    plain: bool = False, token_bytes: Callable[[int], bytes] | None = None) -> RequestChoice:
    """One generation's own choice: draft (None or "auto": the engine's drafter; "none":
    plain; a name: that drafter), K (None: the engine's), its request-fed inputs by field.
    Raises SpecDecodeError (param: the field) for an input that the named drafter does not
    read, and for a kind named without the field it reads."""
    if plain or draft == "none":
        return RequestChoice(True, 0, DraftingRequest())
    named = kind_of(draft)[0] if draft not in (None, AUTO) else None
    for name in inputs:
        if named is not None and named.request_field != name:
            readers = " or ".join(repr(k.name) for k in KINDS if k.request_field == name)
            raise SpecDecodeError(f"a {name} is followed by draft 'auto' or {readers}; this request chose draft "
                                  f"{draft!r}", param=name)
    if named is not None and named.request_field and named.request_field not in inputs:
        raise SpecDecodeError(f"draft {draft!r} drafts from the request's {named.request_field}, and none was given",
                              param=named.request_field)
    drafting = DraftingRequest(None if named is None else draft, fixed=k is not None, planned=draft == AUTO,
                               inputs=dict(inputs), token_bytes=token_bytes)
    return RequestChoice(False, engine_k if k is None else k, drafting)
