"""The speculative decoding loop: one step drafts, verifies and commits; the loop around it
streams what the step commits.

One step (docs/architecture.md):
    drafter.propose(committed, k) -> draft [k] (+ draft probs [k, V])
    target.forward([last committed] + draft) -> target logits [k+1, V]
    sampling -> target choice (greedy argmax [k+1] or target probs [k+1, V])
    verify -> num_accepted, next token (recovered or bonus)
    commit num_accepted + 1 tokens, cut at end-of-generation / max_tokens
    target.rollback(len(committed) - 1)

What the committed tokens become (text, stop strings, logprobs, statistics) is
:class:`specdecode.output.OutputAccumulator`'s job.

KV invariant: after every step the target's KV cache of the generation's sequence holds
exactly committed[:-1] (``target.seq_len(seq) == len(committed) - 1``): the last
committed token is fed at the start of the next step together with the drafts.

Continuous batching: several generations, each in its own slot (a KV sequence of the
target, and of shared draft models), run the same step together: their blocks
[last committed + drafts] go into one ``target.forward_batch`` and each is verified with
its own sampler. One generation alone is the batch of one, by the same code.

Sources: Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2.
Dimension letters: K = drafted tokens this step, V = vocabulary size.
"""

from ..output import GenerationResult, TextDelta, TokenLogprob, drive
from .core import Generation, Slot, SpeculativeEngine

__all__ = ["SpeculativeEngine", "Generation", "Slot", "GenerationResult", "TextDelta", "TokenLogprob", "drive"]
