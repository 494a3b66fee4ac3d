"""Drafters: cheap guesses of the next K tokens (see :mod:`.base` for the contract).

Kinds: ``none`` (plain decoding), ``ngram`` (prompt lookup, :mod:`.ngram`), ``suffix``
(lookup in this and earlier requests, :mod:`.suffix`), ``model`` (a smaller model on any
backend, :mod:`.model`). The cost-aware controller
(:mod:`specdecode.controller`) is a drafter over several of them.
"""

from .base import BatchLoad, ContinuationRule, Draft, Drafter, DrafterBase, NoDrafter
from .model import ModelDrafter
from .ngram import Match, NgramDrafter
from .suffix import SuffixDrafter

__all__ = ["BatchLoad", "ContinuationRule", "Draft", "Drafter", "DrafterBase", "NoDrafter", "ModelDrafter", "Match", "NgramDrafter",
           "SuffixDrafter"]
