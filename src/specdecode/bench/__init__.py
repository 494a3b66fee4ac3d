"""``specdecode bench``: speculative against plain decoding, side by side, per category.

For every prompt (JSON Lines: ``category``, ``prompt`` or ``messages``, optional
``max_tokens``, ``id`` and ``json_schema``, which constrains every generation of the
prompt and makes the peers skip it), plain decoding and each configuration run back to
back in one process on the same loaded target, with the same sampling settings and
max_tokens, after a warm-up. Reported per category and overall: decode tokens/s
(medians), speedup (ratio of medians), acceptance rate, mean accepted length, per-position acceptance,
parity (exact / near-tie / divergent, from :func:`specdecode.parity.parity_report`), and
the process's peak resident memory (MB). Peers: for a llama.cpp target, llama-cpp-python's
own prompt-lookup decoding (``LlamaPromptLookupDecoding``) on the same GGUF; for a torch
target, transformers' ``generate(prompt_lookup_num_tokens=10)`` and, when a configuration
uses a draft model on the torch backend, ``generate(assistant_model=...)`` with that draft.

Decode tokens/s here is (tokens - 1) / (seconds from the first token to the last) for
every runner alike, so prefill never enters the comparison.

With greedy sampling each configuration is also set beside its oracle (:mod:`.oracle`):
the plain outputs replayed with the target's measured cost curve T(n), each step taking
the lookup draft and K (up to 32) that commit the most tokens per second given the
outcome; reported as ``oracle_speedup`` and ``oracle_fraction`` (measured speedup over it).

Modules: :mod:`.suite` (prompts, configurations), :mod:`.runner` (:class:`BenchConfig`,
:func:`run_bench`, the library entry point), :mod:`.peers`, :mod:`.oracle`, :mod:`.report`
(summary, Markdown, plots, table) and :mod:`.cli` (the ``bench`` subcommand).

Example::

    from specdecode.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig(target="smollm2-135m-instruct", configs=("ngram:3",), per_category=1))
    print(result["summary"]["ngram:3"]["overall"]["speedup"])
"""

from .cli import add_bench_parser, cmd_bench, config_from_args
from .oracle import OracleResult, OracleStep, lookup_drafters, oracle_replay, oracle_speedup
from .peers import PromptLookupPeer, TransformersPeer, decode_rate, torch_draft_model
from .report import markdown, plots, print_table, summarize, write_outputs
from .runner import BenchConfig, peak_rss_mb, run_bench
from .suite import CATEGORIES, BenchPrompt, load_prompts, parse_config, select_prompts

__all__ = [
    "BenchConfig", "run_bench", "peak_rss_mb",
    "CATEGORIES", "BenchPrompt", "load_prompts", "parse_config", "select_prompts",
    "OracleResult", "OracleStep", "lookup_drafters", "oracle_replay", "oracle_speedup",
    "PromptLookupPeer", "TransformersPeer", "decode_rate", "torch_draft_model",
    "summarize", "markdown", "plots", "print_table", "write_outputs",
    "add_bench_parser", "cmd_bench", "config_from_args",
]
