"""Limits, defaults and choices shared by the Python API, the CLI, the server and the
benchmark. Each is defined here once; everything else imports it.

Units: tokens for lengths and counts.
"""

from __future__ import annotations

import numpy as np

from .errors import SpecDecodeError

# K, drafted tokens per step: the most a fixed K may ask for (vLLM's MAX_SPEC_LEN plays
# the same role). Every K in the engine, the CLI, the server and the bench is checked
# against this one value.
MAX_NUM_SPECULATIVE_TOKENS = 32
MAX_TREE_WIDTH = 8  # candidates per node of a tree of drafts (--tree-width)
DEFAULT_TREE_WIDTH = 3
# --max-tree-nodes: the nodes a tree of drafts may hold (0: chains only; the default, because
# on the development CPUs trees measured no faster than chains: README, Trees of candidates).
# The flag alone allows DEFAULT_TREE_NODES; under -k auto the controller then cuts each tree
# to the prefix that pays under the measured T(n).
MAX_TREE_NODES = 64
DEFAULT_TREE_NODES = 16
# The cost-aware controller (``-k auto``) chooses K in 0..AUTO_KMAX each step.
AUTO_KMAX = MAX_NUM_SPECULATIVE_TOKENS
# Its policy (control/controller.py):
# A drafter that did not have its whole last proposal accepted (a new copy, or a broken
# one) drafts at most this many tokens: a long match that turns out wrong then costs one
# verification of 9 tokens, not of 33 (on a CPU, T(33) is about 12 plain steps). Once a
# block is fully accepted the copy is confirmed and the next proposal may go to AUTO_KMAX.
# Replayed over the suite's held-out outputs with measured T(n), this raised code editing
# from 1.37x to 1.46x and left the other categories within 0.01x.
CONFIRM_BLOCK = 8
COST_EMA = 0.2  # weight of the newest observation of a drafter's cost per token
CATCH_UP_EMA = 0.5  # weight of the newest observed catch-up (few: a draft model catches up rarely)
NEW_TEXT_KEEP = 0.5  # of a match kind's evidence, the share a new generation keeps
# A draft model that has not seen the text must first catch up on it, a one-off cost. It is
# paid when the drafter's steady rate repays it within this many committed tokens.
CATCH_UP_HORIZON = 64
# Where the target's verification cost T(n) is measured (tokens per forward): every size up to
# AUTO_KMAX + 1, so that the controller plans with a measured T at every block it may verify.
# llama.cpp's CPU kernels are not smooth in n: CPU_REPACK's GEMMs take rows in groups of 4 and
# 8 and the rest one at a time, so on an AMD EPYC Zen 4 T(16) = 277 ms < T(15) = 340 ms and
# T(32) = 448 < T(28) = 481 (default target, after 64 tokens), which no interpolation between
# 12, 16, 24 and 32 can see.
COST_CURVE_NS = tuple(range(1, AUTO_KMAX + 2))
# Further forward sizes measured for a target that runs several generations in one batch
# (--parallel > 1): a batched step holds every generation's block (up to
# generations * (AUTO_KMAX + 1) tokens); past the last point T(n) is extrapolated linearly.
BATCH_COST_CURVE_NS = (48, 64, 96, 128)
# CPU threads a model may use (--threads, n_threads): ggml's own limit (GGML_MAX_N_THREADS in
# ggml.h); llama.cpp given more crashes (SIGSEGV at 100000, std::bad_alloc beyond).
MAX_THREADS = 512
# logprobs: the most likely tokens reported per emitted token (OpenAI's limit).
MAX_LOGPROBS = 20
# n, choices per server request. A request's choices run one after another in the one
# slot it holds (the server's --parallel slots serve different requests at once), so it
# holds that slot n times as long as one choice would, and while every slot is taken the
# requests queued behind wait. 8 covers what n is used for (a handful of samples to pick
# from or vote over) and keeps that wait within an order of magnitude of a plain request;
# the server also caps n * max_tokens at the context size.
MAX_N = 8
# --parallel: slots for concurrent generations in one batch. Each slot holds a KV cache of
# n_ctx tokens (llama.cpp allocates n_ctx * slots cells at load), and a batched step of
# MAX_PARALLEL generations drafting MAX_NUM_SPECULATIVE_TOKENS each stays within one
# llama_decode call of 512 tokens.
MAX_PARALLEL = 15
# Stop strings per generation, and characters per stop string. OpenAI allows 4; these are
# generous, and bound what a request can ask of the matcher (an automaton of at most
# MAX_STOP_STRINGS * MAX_STOP_CHARS * 4 bytes of states, built once per generation).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
# --cache-reuse N (llama.cpp's n_cache_reuse): the shortest cached chunk shifted into place, in
# tokens; the server's default for fill-in-the-middle is llama.cpp's FIM presets' (256). Above
# the largest context any model serves, a chunk could never be that long.
DEFAULT_CACHE_REUSE = 256
MAX_CACHE_REUSE = 1 << 20

BACKENDS = ("auto", "llama.cpp", "torch")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "auto")

# The context of a model that does not say what it was trained for, in tokens; any other
# model's default context is its trained one, within memory (backends/context.py).
DEFAULT_N_CTX = 4096
# How a sampled generation verifies drafts. "gumbel": the target's token at each position is
# the Gumbel-max choice with noise keyed by (seed, position), so a seed fixes the text at any
# K, with any drafter, alone or in a batch; "rejection": Leviathan et al.'s rejection rule
# (Algorithm 1), whose random draws depend on K and which accepts more of a draft model's
# sampled drafts; "auto": gumbel when a seed is given (the user asked for a fixed text),
# rejection otherwise (the higher acceptance).
SAMPLING_RULES = ("auto", "gumbel", "rejection")
DEFAULT_SAMPLING_RULE = "auto"
# Batch-invariant verification (GenerationOptions.batch_invariant): every verified row gets
# the logits a one-token step would give, so that K and the batch cannot change a token.
# "auto": on for seeded sampling under the gumbel rule (where the seed promises a text);
# "on": also for greedy and unseeded generations; "off": never.
BATCH_INVARIANCE = ("auto", "on", "off")
MIN_N_CTX = 16  # the smallest context window a backend accepts, in tokens
DEFAULT_MAX_TOKENS = 256
DEFAULT_DTYPE = "float32"
DEFAULT_DEVICE = "cpu"
# Layers of a GGUF model on the GPU of llama.cpp's build (--gpu-layers, --draft-gpu-layers; llama.cpp's
# n_gpu_layers): a number, "all", or "auto" (all where they fit the device's free memory, else as many
# as fit; the CPU on a CPU-only build): backends/llama_cpp/offload.py.
GPU_LAYERS_CHOICES = ("auto", "all")
DEFAULT_GPU_LAYERS = "auto"
MAX_GPU_LAYERS = 100_000  # more layers than any model has: a larger number is a typing slip


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_index(value: object) -> bool:
    """An integer id or size, numpy's integers included (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _shown(name: str, value: object) -> str:
    """How an error shows a value: "--logprobs 50" for a command-line option, else "logprobs = 50"."""
    return f"{name} {value}" if name.startswith("--") else f"{name} = {value!r}"


def check_num_speculative_tokens(value: object, name: str = "num_speculative_tokens",
                                 allow_auto: bool = True) -> int | str:
    """K as given by a user: an integer 0..MAX_NUM_SPECULATIVE_TOKENS, or "auto" where allowed.

    Returns the value. Raises SpecDecodeError (param ``name``) naming it otherwise.
    """
    if allow_auto and value == "auto":
        return "auto"
    if not is_int(value) or not (0 <= value <= MAX_NUM_SPECULATIVE_TOKENS):
        auto = " or 'auto'" if allow_auto else ""
        raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected an integer "
                              f"0..{MAX_NUM_SPECULATIVE_TOKENS}{auto}", param=name)
    return value


def check_parallel(value: object, name: str = "parallel") -> int:
    """Concurrent generation slots, an integer 1..MAX_PARALLEL. Raises SpecDecodeError."""
    if not is_int(value) or not (1 <= value <= MAX_PARALLEL):
        raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected an integer 1..{MAX_PARALLEL}",
                              param=name)
    return value


def check_gpu_layers(value: object, name: str = "gpu_layers") -> int | str:
    """Layers to offload as given by a user: an integer 0..MAX_GPU_LAYERS (one larger than the
    model's layers means all), "all" or "auto"; a string of digits (a command line's) is read as
    its number. Returns the value. Raises SpecDecodeError (param ``name``) naming it otherwise."""
    if isinstance(value, str) and value.strip().lower() in GPU_LAYERS_CHOICES:
        return value.strip().lower()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not is_int(value) or not (0 <= value <= MAX_GPU_LAYERS):
        raise SpecDecodeError(f"{_shown(name, value)} is not a choice: expected a number of layers "
                              f"0..{MAX_GPU_LAYERS}, 'all' or 'auto'", param=name)
    return value


# How a draft model with another tokenizer than the target's drafts (--draft-vocab): string-level
# exact match or token-level intersection (specdecode.drafters.cross_vocab).
DRAFT_VOCAB_METHODS = ("slem", "tli")


def check_draft_vocab(value: object, name: str = "draft_vocab") -> int | str:
    """How a draft model's vocabulary is used: an integer N >= 0 (a torch draft model of the
    target's tokenizer scores only ids < N; 0 = all), or "slem" / "tli" (a draft model of
    another tokenizer drafts by that method). Raises SpecDecodeError (param ``name``)."""
    if value in DRAFT_VOCAB_METHODS or is_int(value) and value >= 0:
        return value  # type: ignore[return-value]
    raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected an integer >= 0 (0 = all) or one of "
                          f"{', '.join(DRAFT_VOCAB_METHODS)}", param=name)


def check_tree_width(value: object, name: str = "tree_width") -> int:
    """Candidates per node of a tree of drafts (the top W of each head or of the draft
    model's distribution), an integer 1..MAX_TREE_WIDTH. Raises SpecDecodeError (param ``name``)."""
    if not is_int(value) or not (1 <= value <= MAX_TREE_WIDTH):
        raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected an integer 1..{MAX_TREE_WIDTH}",
                              param=name)
    return value


def check_max_tree_nodes(value: object, name: str = "max_tree_nodes") -> int | None:
    """None (the controller's default), or the nodes a tree of drafts may hold, an integer
    0..MAX_TREE_NODES (0: chains only). Raises SpecDecodeError (param ``name``)."""
    if value is not None and (not is_int(value) or not (0 <= value <= MAX_TREE_NODES)):
        raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected an integer 0..{MAX_TREE_NODES} "
                              f"(0: chains only)", param=name)
    return value


def check_logprobs(value: object, name: str = "logprobs") -> int | None:
    """None, or an integer 0..MAX_LOGPROBS. Raises SpecDecodeError (param ``name``)."""
    if value is not None and (not is_int(value) or not (0 <= value <= MAX_LOGPROBS)):
        raise SpecDecodeError(f"{_shown(name, value)} is out of range: expected 0 <= {name.lstrip('-')} <= {MAX_LOGPROBS}",
                              param=name)
    return value


def check_choice(value: object, choices: tuple[str, ...], name: str) -> str:
    """value must be one of choices. Raises SpecDecodeError (param ``name``)."""
    if value not in choices:
        raise SpecDecodeError(f"{name} {value!r} is not one of {', '.join(choices)}", param=name)
    return value  # type: ignore[return-value]


def check_text(value: str, name: str) -> str:
    """A string that encodes to UTF-8: no lone surrogate (as a JSON "\\ud800" escape, or
    the bytes of a command line or standard input that were not UTF-8, which Python keeps
    as surrogates). Raises SpecDecodeError (param ``name``) naming the first bad character."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        if 0xDC80 <= ord(bad) <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
            what = f"byte 0x{ord(bad) - 0xDC00:02x} is not UTF-8"
        else:
            what = f"a lone surrogate U+{ord(bad):04X} is not a character"
        raise SpecDecodeError(f"{name} is not valid text: {what} (at character {e.start})", param=name) from None
    return value


def check_token_ids(ids, n_vocab: int, name: str) -> list[int]:
    """prompt_ids as a list of ints in 0..n_vocab-1 (a list, tuple or 1-D integer array);
    SpecDecodeError (param prompt_ids) naming what is wrong otherwise."""
    if isinstance(ids, np.ndarray) and ids.ndim != 1 or not isinstance(ids, (list, tuple, np.ndarray)):
        hint = " (call .tolist())" if hasattr(ids, "tolist") else ""
        raise SpecDecodeError(f"prompt_ids must be a list of integer token ids, got {type(ids).__name__}{hint}",
                              param="prompt_ids")
    if not all(is_index(t) for t in ids):
        raise SpecDecodeError(f"prompt_ids must be integer token ids, got {list(ids)[:8]!r:.80}", param="prompt_ids")
    if not len(ids):
        raise SpecDecodeError("prompt_ids is empty: a generation starts from at least one id (a start or class "
                              "code)", param="prompt_ids")
    out = [int(t) for t in ids]
    bad = next((t for t in out if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise SpecDecodeError(f"prompt_ids: token id {bad} is outside the vocabulary of {name} (0..{n_vocab - 1})",
                              param="prompt_ids")
    return out
