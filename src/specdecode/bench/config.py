"""What ``specdecode bench`` runs: :class:`BenchConfig`, checked before anything loads, and
the names its runs go by."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..assembly import registry
from ..errors import SpecDecodeError
from ..limits import (DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_GPU_LAYERS, DEFAULT_TREE_WIDTH, check_gpu_layers,
                      check_max_tree_nodes,
                      check_tree_width)
from ..sampling import SamplingParams
from ..drafters.kinds import uses_option
from .load import BackgroundLoad
from .suite import DEFAULT_BENCH_MAX_TOKENS, parse_config
from .vary import Vary, parse_vary

DEFAULT_CONFIGS = ("auto:auto",)
WARMUP_TOKENS = 8  # tokens each engine and peer generates once before timing
WITH_PREDICTION = "+prediction"  # a configuration's rows run with the prompt's prediction
WITH_TREES = "+trees"  # a configuration's rows run with trees of drafts (--max-tree-nodes N)


@dataclass(frozen=True)
class BenchConfig:
    """What ``specdecode bench`` runs.

    target: registry name, .gguf path or Hugging Face folder.
    prompts: JSON Lines prompt file (None: the built-in suite; format in :func:`load_prompts`).
    configs: "DRAFT:K" configurations compared with plain decoding (see :func:`parse_config`).
    categories: only prompts of these categories (None: all). per_category: at most this
        many prompts per category (None: all).
    max_tokens: completion cap in tokens for prompts without their own.
    sampling: the sampling settings of every run (parity is checked only when greedy).
    n_ctx: context window in tokens (None: the Decoder's default, the target's trained context
        within memory). n_threads: CPU threads (None: all cores).
    backend, draft_backend: "auto", "llama.cpp" or "torch"; dtype, device: for the torch
        backend; draft_vocab: see :class:`specdecode.drafters.ModelDrafter` (0 = all).
    gpu_layers, draft_gpu_layers: the target's and a GGUF draft model's layers on llama.cpp's
        GPU (:class:`specdecode.Decoder`).
    peer: also time the peers. progress: progress bars on stderr.
    background_load: run beside a CPU load of this fraction of the machine (0 < F <= 1;
        None: none).
    prediction: the predicted output of every prompt (None: each prompt's own, if any).
    max_tree_nodes: None (each engine's default), 0 (chains only), or N: every configuration
        runs with chains and, with drafters of its own, with trees of up to N nodes, as
        ``CONFIG+trees``, side by side (the target loaded to verify trees). tree_width:
        candidates per tree node.
    llama_server: also time llama.cpp's own llama-server on every prompt (:mod:`.llama_server`):
        its path, "" for the one built by benchmarks/build_llama_server.sh, or None (not run).
        llama_server_configs: which of its configurations (plain, spec-default, ngram-simple,
        draft); llama_server_draft: its draft model (None: the first a configuration names).
    vary: "SETTING=V1,V2[,...]" (:mod:`.vary`), or None: every run (plain and each
        configuration) at each value of one setting, side by side on the same prompts, the
        values interleaved prompt by prompt; rows and summaries are named "CONFIG [SETTING=V]"
        and the report adds one table of the values' rates and ratios. The peers do not run
        with it (the runs compare the setting's values).

    Raises SpecDecodeError naming the field when a value is out of range (before any
    model is loaded).
    """

    target: str = registry.DEFAULT_TARGET
    prompts: str | Path | None = None
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    categories: tuple[str, ...] | None = None
    per_category: int | None = None
    max_tokens: int = DEFAULT_BENCH_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(seed=0))
    n_ctx: int | None = None
    n_threads: int | None = None
    backend: str = "auto"
    draft_backend: str = "auto"
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    draft_vocab: int | str = 0
    gpu_layers: int | str = DEFAULT_GPU_LAYERS
    draft_gpu_layers: int | str = DEFAULT_GPU_LAYERS
    peer: bool = True
    progress: bool = True
    background_load: float | None = None
    prediction: str | None = None
    max_tree_nodes: int | None = None
    tree_width: int = DEFAULT_TREE_WIDTH
    vary: str | None = None
    llama_server: str | None = None
    llama_server_configs: tuple[str, ...] = ("plain", "spec-default", "ngram-simple", "draft")
    llama_server_draft: str | None = None

    def __post_init__(self) -> None:
        # Lists from callers become tuples, so configs stay immutable and comparable.
        object.__setattr__(self, "configs", tuple(self.configs))
        if self.categories is not None:
            object.__setattr__(self, "categories", tuple(self.categories))
        if not self.configs:
            raise SpecDecodeError("configs is empty: give at least one DRAFT:K", param="configs")
        for c in self.configs:
            parse_config(c)
        object.__setattr__(self, "gpu_layers", check_gpu_layers(self.gpu_layers))
        object.__setattr__(self, "draft_gpu_layers", check_gpu_layers(self.draft_gpu_layers, "draft_gpu_layers"))
        self.check_draft_options()
        if self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens = {self.max_tokens} is out of range: expected >= 1", param="max_tokens")
        check_max_tree_nodes(self.max_tree_nodes)
        check_tree_width(self.tree_width)
        if self.background_load is not None:
            BackgroundLoad(self.background_load)  # raises for a value out of range
        if self.per_category is not None and self.per_category < 1:
            raise SpecDecodeError(f"per_category = {self.per_category} is out of range: expected >= 1 or None",
                                  param="per_category")
        object.__setattr__(self, "llama_server_configs", tuple(self.llama_server_configs))
        from .llama_server import CONFIGS as SERVER_CONFIGS
        bad = [c for c in self.llama_server_configs if c not in SERVER_CONFIGS]
        if bad or not self.llama_server_configs:
            raise SpecDecodeError(f"llama_server_configs {list(self.llama_server_configs)!r}: expected some of "
                                  f"{', '.join(SERVER_CONFIGS)}", param="llama_server_configs")
        vary = self.parsed_vary()
        if vary is not None and vary.setting.name == "sampling_rule" and self.sampling.greedy:
            raise SpecDecodeError(f"--vary {self.vary}: the sampling rules differ only when sampling: give a "
                                  f"--temperature above 0", param="--vary")

    def draft_options(self, draft: str) -> dict[str, object]:
        """The draft options (draft_vocab, draft_backend) as given, for the configurations' drafter
        ``draft``: each one it uses, the others left at "not given" (a bench of a draft model
        beside prompt lookup applies ``--draft-backend`` to the model only)."""
        return {"draft_vocab": self.draft_vocab if uses_option(draft, "draft_vocab") else 0,
                "draft_backend": self.draft_backend if uses_option(draft, "draft_backend") else "auto",
                "draft_gpu_layers": self.draft_gpu_layers if uses_option(draft, "draft_gpu_layers") else "auto"}

    def check_draft_options(self) -> None:
        """A draft option given that no configuration's drafter uses is refused, naming it.
        Raises SpecDecodeError."""
        drafts = [d for d, _ in self.parsed_configs()]
        for name, value in (("draft_vocab", self.draft_vocab), ("draft_backend", self.draft_backend),
                            ("draft_gpu_layers", self.draft_gpu_layers)):
            if value and value != "auto" and not any(uses_option(d, name) for d in drafts):
                raise SpecDecodeError(f"{name} = {value!r} applies to a draft model; no configuration has one "
                                      f"(drafts {', '.join(map(repr, drafts))})", param=name)

    def parsed_configs(self) -> list[tuple[str, int | str]]:
        """configs as (draft, K) pairs."""
        return [parse_config(c) for c in self.configs]

    def parsed_vary(self) -> Vary | None:
        """vary as a :class:`specdecode.bench.vary.Vary` (None without one). Raises
        SpecDecodeError as :func:`specdecode.bench.vary.parse_vary`."""
        return parse_vary(self.vary) if self.vary is not None else None


def run_label(config: str, vary: str | None = None) -> str:
    """The name a run's summary and table go by: its configuration's row name ("ngram:3",
    "ngram:3+prediction"), and with ``--vary`` the value in brackets ("ngram:3 [flash_attn=off]")."""
    return f"{config} [{vary}]" if vary else config


def config_of(label: str) -> str:
    """The configuration's row name in a :func:`run_label` (the value in brackets dropped)."""
    return label.split(" [", 1)[0]
