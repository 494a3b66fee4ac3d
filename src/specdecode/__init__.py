"""specdecode: lossless speculative decoding of large language models.

A cheap drafter proposes up to K tokens; the target scores them in one forward pass;
the acceptance rule keeps what the target agrees with (Leviathan et al. 2023; Chen et
al. 2023). Greedy output equals the target's own; sampled output has its distribution.
Any autoregressive model over discrete codes can be the target (:class:`ModuleBackend`).
"""

from .api import Decoder, generate
from .backends.module import ModuleBackend
from .engine import SpeculativeEngine
from .output import GenerationResult
from .errors import ContextOverflowError, IncompatibleVocabularyError, ModelFileError, SpecDecodeError
from .sampling import SamplingParams
from .stats import Stats

__all__ = [
    "Decoder",
    "generate",
    "ModuleBackend",
    "GenerationResult",
    "SpeculativeEngine",
    "SamplingParams",
    "Stats",
    "SpecDecodeError",
    "ModelFileError",
    "IncompatibleVocabularyError",
    "ContextOverflowError",
]
__version__ = "0.1.0"
