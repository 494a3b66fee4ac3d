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

With ``--vary SETTING=V1,V2`` (:mod:`.vary`) every run goes at each value of one setting
(flash attention, the weights' buffers, strict mode, the sampling rule), the values'
runs interleaved prompt by prompt, and the report adds one table of their rates and ratios.

Modules: :mod:`.suite` (prompts, configurations), :mod:`.config` (:class:`BenchConfig`),
:mod:`.vary` (the settings ``--vary`` knows), :mod:`.runner` (:func:`run_bench`, the library
entry point) and :mod:`.runs` (one prompt's runs, in rotating order), :mod:`.peers`,
:mod:`.oracle`, :mod:`.report` (summary, Markdown, plots, table), :mod:`.tools` (what the
probe scripts of ``benchmarks/`` share) and :mod:`.cli` (the ``bench`` subcommand).

Example::

    from specdecode.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig(target="smollm2-135m-instruct", configs=("ngram:3",), per_category=1))
    print(result["summary"]["ngram:3"]["overall"]["speedup"])
"""

from .cli import add_bench_parser, cmd_bench, config_from_args
from .oracle import OracleResult, OracleStep, lookup_drafters, oracle_replay, oracle_speedup
from .peers import PromptLookupPeer, TransformersPeer, decode_rate, torch_draft_model
from .config import BenchConfig
from .report import markdown, plots, print_table, summarize, vary_table, write_outputs
from .runner import copy_limit, open_decoder, peak_rss_mb, run_bench
from .runs import history_as, history_keepers
from .suite import CATEGORIES, LONG_CONTEXT_CATEGORIES, BenchPrompt, load_prompts, parse_config, select_prompts
from .tools import cpu_name, free_port, serve_process
from .vary import SETTINGS, Vary, parse_vary

__all__ = [
    "BenchConfig", "run_bench", "open_decoder", "peak_rss_mb", "copy_limit", "history_as", "history_keepers",
    "SETTINGS", "Vary", "parse_vary", "cpu_name", "free_port", "serve_process",
    "CATEGORIES", "LONG_CONTEXT_CATEGORIES", "BenchPrompt", "load_prompts", "parse_config", "select_prompts",
    "OracleResult", "OracleStep", "lookup_drafters", "oracle_replay", "oracle_speedup",
    "PromptLookupPeer", "TransformersPeer", "decode_rate", "torch_draft_model",
    "summarize", "markdown", "plots", "print_table", "vary_table", "write_outputs",
    "add_bench_parser", "cmd_bench", "config_from_args",
]
