"""One setting varied across the runs of ``specdecode bench`` (``--vary SETTING=V1,V2[,...]``),
as llama-bench takes a list per setting and prints one table.

Each value is a *variant*: a plain engine and the configurations' engines of its own (drafters
of its own, so that a drafter that learns across requests never sees another value's answer to
the same prompt), run on the same prompts as the other values, interleaved prompt by prompt
(:mod:`.runner` rotates the order, so that no value always runs first). A setting is one of two
kinds:

- ``load``: read by the llama.cpp backend when a model loads (an environment variable), so each
  value loads the target (and any draft model) again, with the variable set for that load only
  and put back after: ``flash_attn`` (``SPECDECODE_LLAMA_FLASH_ATTN``: auto, on, off; or
  measured, the variable unset: the path chosen by measurement, what a user gets) and
  ``buffers`` (``SPECDECODE_LLAMA_BUFFERS``: auto, the machine's own choice, or amx, repack,
  none). The loaded target must report the value asked (its ``flash_attention`` or ``buffers``),
  else the run stops with an error naming both: a comparison of a setting that did not take
  would be a comparison of nothing.
- ``generation``: an option of every generation (plain runs included) on one loaded target:
  ``strict`` (``batch_invariant``: auto, on, off; ``serve --strict`` is "on") and
  ``sampling_rule`` (auto, gumbel, rejection: needs a temperature above 0, where the rules differ).
- ``drafter``: how the configurations' drafters are built, on one loaded target: ``draft_vocab``
  (slem, tli: the method of a draft model of another tokenizer; a draft model of the target's
  tokenizer and the lookups draft as usual at every value).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ..backends.llama_cpp.buffers import BUFFER_CHOICES, BUFFERS_ENV, LEGACY_REPACK_ENV
from ..backends.llama_cpp.lib import FLASH_ATTENTION_ENV, FLASH_ATTENTION_MODES
from ..errors import SpecDecodeError
from ..limits import BATCH_INVARIANCE, DRAFT_VOCAB_METHODS, SAMPLING_RULES
from ..sampling import SamplingParams

AUTO = "auto"  # a load setting's value that leaves the variable unset: the backend decides
MEASURED = "measured"  # flash_attn unset: specdecode times both paths and keeps the cheaper (control/attention.py)


@dataclass(frozen=True)
class Setting:
    """A setting ``--vary`` knows.

    name: as ``--vary`` spells it. kind: "load", "generation" or "drafter" (module docstring).
    choices: the values it takes. env: (load) the environment variable set while a value's
    models load; clears: (load) variables unset meanwhile (an older spelling of the same choice,
    which would otherwise disagree with it); reports: (load) the loaded backend's attribute that
    says what it got. field: (generation) the :class:`specdecode.request.GenerationOptions`
    field, or ``sampling_rule`` of :class:`specdecode.SamplingParams`; (drafter) the drafter
    option the value sets.
    """

    name: str
    kind: str
    choices: tuple[str, ...]
    env: str | None = None
    clears: tuple[str, ...] = ()
    reports: str | None = None
    field: str | None = None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("flash_attn", "load", (MEASURED, *FLASH_ATTENTION_MODES), env=FLASH_ATTENTION_ENV,
            reports="flash_attention"),
    Setting("buffers", "load", (AUTO, *BUFFER_CHOICES), env=BUFFERS_ENV, clears=(LEGACY_REPACK_ENV,),
            reports="buffers"),
    Setting("strict", "generation", BATCH_INVARIANCE, field="batch_invariant"),
    Setting("sampling_rule", "generation", SAMPLING_RULES, field="sampling_rule"),
    Setting("draft_vocab", "drafter", DRAFT_VOCAB_METHODS, field="draft_vocab"),
)}


@dataclass(frozen=True)
class Vary:
    """A setting and the values the bench runs it at (two or more, distinct, in order: the
    first is the one the others are compared with)."""

    setting: Setting
    values: tuple[str, ...]

    def label(self, value: str) -> str:
        """"SETTING=VALUE", as row names and tables show a value."""
        return f"{self.setting.name}={value}"


def parse_vary(text: str) -> Vary:
    """``SETTING=V1,V2[,...]`` as a :class:`Vary`.

    Raises SpecDecodeError (param ``--vary``) naming the text for an unknown setting, fewer
    than two values, a repeated value or one the setting does not take (listing its choices).
    """
    name, eq, values = str(text).partition("=")
    name = name.strip()
    if name not in SETTINGS or not eq:
        raise SpecDecodeError(f"--vary {text!r}: expected SETTING=V1,V2 with SETTING one of {', '.join(SETTINGS)}",
                              param="--vary")
    setting = SETTINGS[name]
    vals = tuple(v.strip().lower() for v in values.split(","))
    bad = [v for v in vals if v not in setting.choices]
    if bad:
        raise SpecDecodeError(f"--vary {text!r}: {bad[0]!r} is not a value of {name}: expected "
                              f"{', '.join(setting.choices)}", param="--vary")
    if len(vals) < 2 or len(set(vals)) < len(vals):
        raise SpecDecodeError(f"--vary {text!r}: give two or more different values of {name}, comma-separated",
                              param="--vary")
    return Vary(setting, vals)


@contextmanager
def loading_with(setting: Setting, value: str) -> Iterator[None]:
    """While inside, the environment a load of ``value`` reads (a load setting: its variable
    set, or unset for "auto", and the variables it clears unset); afterwards the environment
    as it was. A generation setting changes nothing here."""
    if setting.kind != "load":
        yield
        return
    names = (setting.env, *setting.clears)
    saved = {n: os.environ.get(n) for n in names}
    for n in setting.clears:
        os.environ.pop(n, None)
    if (value == AUTO and setting.name == "buffers") or value == MEASURED:  # the variable unset: chosen at load
        os.environ.pop(setting.env, None)
    else:
        os.environ[setting.env] = value
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def check_loaded(setting: Setting, value: str, target) -> str:
    """What a target loaded for ``value`` of a load setting reports (its buffers' note or
    its attention), for the bench's header. Raises SpecDecodeError when the target has no
    such setting (a torch target: these are llama.cpp's) or reports another value than the
    one asked ("auto" of buffers and "measured" of flash_attn take whatever the machine chose)."""
    got = getattr(target, setting.reports, None)
    if not isinstance(got, str):
        raise SpecDecodeError(f"--vary {setting.name} is a setting of the llama.cpp backend: target "
                              f"{getattr(target, 'name', target)} has none", param="--vary")
    if got != value and not (setting.name == "buffers" and value == AUTO) and value != MEASURED:
        raise SpecDecodeError(f"--vary {setting.name}={value}: the target loaded with {setting.name} {got}",
                              param="--vary")
    if setting.name == "buffers":
        return target.weights_note
    why = target.attention_note
    return f"flash attention {got}" + (f" ({why})" if value == MEASURED and why else "")


def run_options(setting: Setting | None, value: str | None, sampling: SamplingParams) -> tuple[SamplingParams, dict]:
    """The sampling settings and the extra generation fields every run of ``value`` gets
    (without a varied setting, or for a load setting: ``sampling`` and none)."""
    if setting is None or setting.kind != "generation":
        return sampling, {}
    if setting.field == "sampling_rule":
        return dataclasses.replace(sampling, sampling_rule=value), {}
    return sampling, {setting.field: value}
