"""Drafters: cheap guesses of the next K tokens (see :mod:`.base` for the contract).

Kinds: ``none`` (plain decoding), ``ngram`` (prompt lookup, :mod:`.ngram`), ``model`` (a
smaller model on any backend, :mod:`.model`). The cost-aware controller
(:mod:`specdecode.controller`) is a drafter over several of them.
"""

from .base import ContinuationRule, Draft, Drafter, DrafterBase, NoDrafter
from .model import ModelDrafter
from .ngram import Match, NgramDrafter

__all__ = ["ContinuationRule", "Draft", "Drafter", "DrafterBase", "NoDrafter", "ModelDrafter", "Match", "NgramDrafter"]
