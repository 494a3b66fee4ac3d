"""Trees of drafts, one room (SpecInfer, Miao et al. 2024; Medusa, Cai et al. 2024; EAGLE-2,
Li et al. 2024): candidates for several continuations verified in one forward under a tree
attention mask, the longest accepted path kept. Each file sits on the layer of what it does
(docs/architecture.md, Layers):

- :mod:`.torch_forward`, :mod:`.llama_forward` (backends): a tree block's forward on each
  backend (a tree mask and tree positions on torch; branch sequence ids on llama.cpp) and
  keeping the accepted path's cache.
- :mod:`.drafting` (drafters): the node budget a drafter is given (``TreeDrafting``,
  ``set_tree_options``) and a draft model's dynamic tree (EAGLE-2, ``grow_tree``).
- :mod:`.plan` (control): the prefix of a probability-ordered tree that pays under the
  measured T(n) (``plan_tree``) and the calibration of the drafter's probabilities.
- :mod:`.step` (engine): one generation's tree verified and its path committed.

The acceptance rule itself, ``verify_tree``, lives with the other rules in
:mod:`specdecode.verify`; the contract's helpers (``tree_depths``) in
:mod:`specdecode.backends.base`.
"""
