"""Drafters: cheap guesses of the next K tokens (see :mod:`.base` for the contract and its
extensions, :mod:`.kinds` for the table of kinds that ``--draft`` names).

Kinds: ``none`` (plain decoding), ``ngram`` (prompt lookup, :mod:`.ngram`), ``suffix``
(lookup in this and earlier requests, :mod:`.suffix`), ``heads`` (heads on the target's
hidden state, :mod:`.heads`), a draft model (a smaller model on any backend,
:mod:`.model`). The cost-aware controller (:mod:`specdecode.control.controller`) is a
drafter over several of them.
"""

from .base import (ContinuationRule, Draft, Drafter, DrafterBase, HiddenStateDrafter, IncrementalDrafter,
                   LookupDrafter, Match, NoDrafter, StepOutcome)
from .model import ModelDrafter
from .ngram import NgramDrafter
from .prediction import PredictionDrafter
from .suffix import SuffixDrafter

__all__ = ["ContinuationRule", "Draft", "Drafter", "DrafterBase", "HiddenStateDrafter", "IncrementalDrafter",
           "LookupDrafter", "Match", "NoDrafter", "StepOutcome", "ModelDrafter", "NgramDrafter", "PredictionDrafter", "SuffixDrafter"]
