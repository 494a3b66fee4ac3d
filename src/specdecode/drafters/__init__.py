"""Drafters: cheap guesses of the next K tokens (see :mod:`.base` for the contract).

Kinds: ``none`` (plain decoding), ``ngram`` (prompt lookup, :mod:`.ngram`), ``suffix``
(lookup in this and earlier requests, :mod:`.suffix`), ``model`` (a smaller model on any
backend, :mod:`.model`). The cost-aware controller
(:mod:`specdecode.controller`) is a drafter over several of them.
"""

from .base import ContinuationRule, Draft, Drafter, DrafterBase, DraftOffer, NoDrafter
from .model import ModelDrafter
from .ngram import Match, NgramDrafter
from .suffix import SuffixDrafter

__all__ = ["DraftOffer", "ContinuationRule", "Draft", "Drafter", "DrafterBase", "NoDrafter", "ModelDrafter", "Match", "NgramDrafter",
           "SuffixDrafter"]
