"""Statistics of one generation, with the names docs/architecture.md fixes.

Units: seconds for *_s fields, tokens for counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from .backends.base import Placement


@dataclass
class Stats:
    """Counters and timings of one generation.

    prompt_tokens, prompt_cached: the prompt's tokens, and how many of them a slot's cache
        already held (a prefix reused, not evaluated again: an editor's next keystroke).
    prompt_shifted: of prompt_cached, the tokens of cached chunks moved into place after the
        common prefix (cache reuse, :mod:`specdecode.engine.reuse`; 0 without it).
    drafted: drafted tokens sent to verification.
    accepted: drafted tokens accepted (and kept: tokens cut by a stop are not counted).
    target_forward_passes: target forward calls in the decode phase (prefill excluded).
    accepted_per_position[i] / drafted_per_position[i]: how often draft position i
        (0-based) was accepted / drafted; their ratio is per-position acceptance.
    k_histogram: number of decode steps that drafted k tokens, by k.
    prefill_s: time to fill the target's cache with the prompt.
    first_token_s: time from the start of the call to the first committed token.
    decode_s: time from the end of prefill to the last committed token.
    draft_s, verify_s: parts of decode_s spent drafting and in target forward plus
        acceptance.
    controller_note: what the cost-aware controller chose and why, in one line ("" when
        the drafter has nothing to say).
    invariant_block: 0, or for a batch-invariant generation the most tokens one of its
        verifications held (the target's measured invariant_block); 1 for a seeded generation
        decoded in plain one-token steps where no block of 2+ tokens is invariant.
    weights: where the target's weights live (llama.cpp: the buffer choice and its buffer
        types with their MiB, "repack (CPU_Mapped 1060 MiB, CPU_REPACK 597 MiB)"); "" elsewhere.
    placement: where the target's layers ran ({"device", "gpu_layers", "n_layers"}: llama.cpp's
        device name, "CPU" where none; layers on a GPU, of the model's total:
        :class:`specdecode.backends.base.Placement`); draft_placements: the same for each draft
        model the generation could draft with, with its "name" ([] where none).
    draft, num_speculative_tokens, max_tree_nodes, strict: what the generation ran with, as
        the engine decided it once at its start ("none" and 0 for plain decoding; the cap on
        drafted tokens per step; the node budget of its trees, 0: chains; strict mode): what
        a response's ``speculation`` reports.
    accepted_prediction_tokens / rejected_prediction_tokens: None without a prediction;
        else the tokens drafted from the prediction that the target accepted / rejected
        (verified and discarded), as OpenAI's usage.completion_tokens_details reports them.
    """

    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_shifted: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forward_passes: int = 0
    committed_tokens: int = 0  # tokens committed by decode steps (see mean_accepted_length)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    k_histogram: Counter = field(default_factory=Counter)
    eog_committed: int = 0  # 1 when the target's end-of-generation token ended the output
    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    controller_note: str = ""
    invariant_block: int = 0
    weights: str = ""
    placement: dict = field(default_factory=dict)
    draft_placements: list[dict] = field(default_factory=list)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    draft: str = ""
    num_speculative_tokens: int = 0
    max_tree_nodes: int = 0
    strict: bool = False
    tree_steps: int = 0
    tree_nodes: int = 0  # nodes verified in tree steps
    tree_accepted: int = 0  # nodes of the accepted paths of tree steps
    accepted_per_rank: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward pass (plain decoding = 1.0): what the target's
        verification kept each step, an end-of-generation token and tokens a stop string later
        cuts off included (they were committed; the output just ends before them)."""
        return self.committed_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def record_step(self, k: int, num_accepted: int, committed: int) -> None:
        """Count one decode step that drafted k tokens of which num_accepted were kept, and
        committed tokens in all (accepted drafts, the target's own, an end-of-generation token)."""
        self.target_forward_passes += 1
        self.committed_tokens += committed
        self.k_histogram[k] += 1
        self.drafted += k
        self.accepted += num_accepted
        grow = k - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_tree(self, parents: list[int], path: tuple[int, ...]) -> None:
        """After :meth:`record_step` of a tree step's accepted path: count the tree's other
        nodes as drafted (verified), the rejection at the depth where the path stopped, and
        the sibling rank (0: its parent's first child) of each accepted node."""
        self.tree_steps += 1
        self.tree_nodes += len(parents)
        self.tree_accepted += len(path)
        self.drafted += len(parents) - len(path)
        at = path[-1] if path else -1
        depth = len(path)
        if any(p == at for p in parents):  # the path stopped at a node with children
            if depth >= len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafted_per_position[depth] += 1
        for node in path:
            rank = sum(1 for i in range(node) if parents[i] == parents[node])
            self.accepted_per_rank += [0] * (rank + 1 - len(self.accepted_per_rank))
            self.accepted_per_rank[rank] += 1

    def retract_accepted(self, positions: Iterable[int]) -> None:
        """Uncount accepted drafts (at the given draft positions) that a stop string cut off."""
        for i in positions:
            self.accepted -= 1
            self.accepted_per_position[i] -= 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_cached": self.prompt_cached,
            "prompt_shifted": self.prompt_shifted,
            "completion_tokens": self.completion_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "k_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
            "target_forward_passes": self.target_forward_passes,
            "prefill_s": round(self.prefill_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "decode_s": round(self.decode_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "controller_note": self.controller_note,
            "invariant_block": self.invariant_block,
            "weights": self.weights,
            "device": self.placement.get("device", "CPU"),
            "gpu_layers": self.placement.get("gpu_layers", 0),
            "n_layers": self.placement.get("n_layers", 0),
            "draft_models": [dict(d) for d in self.draft_placements],
            "tree_steps": self.tree_steps,
            "tree_nodes": self.tree_nodes,
            "tree_accepted": self.tree_accepted,
            "accepted_per_rank": list(self.accepted_per_rank),
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "draft": self.draft,
            "num_speculative_tokens": self.num_speculative_tokens,
            "max_tree_nodes": self.max_tree_nodes,
            "strict": self.strict,
        }


def placement_words(stats: dict) -> str:
    """Where a generation's models ran, in words, from its statistics (:meth:`Stats.to_dict`):
    "target on the CPU", "target all 29 layers on Vulkan0; draft model qwen2.5-coder-0.5b-instruct
    all 25 layers on Vulkan0"."""
    def words(d: dict) -> str:
        return Placement(d.get("device", "CPU"), d.get("gpu_layers", 0), d.get("n_layers", 0)).words()
    return "; ".join([f"target {words(stats)}"] + [f"draft model {d.get('name', '')} {words(d)}"
                                                  for d in stats.get("draft_models", [])])
