"""The prompt suite of ``specdecode bench``: categories, prompt files, selection, and the
"DRAFT:K" configurations compared against plain decoding."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..backends.fim import check_extra
from ..drafters.kinds import names_with_arg
from ..errors import SpecDecodeError
from ..grammar import Grammar
from ..limits import MAX_NUM_SPECULATIVE_TOKENS, check_num_speculative_tokens

# The built-in suite's categories, in the order reports list them.
CATEGORIES = ("code_editing", "extraction", "qa_passages", "translation", "math", "chat", "multi_turn", "repeat",
              "json_schema", "predicted_edits", "agent", "edit_whole", "edit_search_replace", "edit_udiff",
              "agent_tool_result", "fim", "edit_large_2k", "edit_large_4k", "edit_large_8k", "agent_long_2k",
              "agent_long_4k", "agent_long_8k")
# Prompts of thousands of tokens (benchmarks/long_context_suite.py): minutes each on a small CPU, so run
# only when named (--categories); a run of the whole suite leaves them out.
LONG_CONTEXT_CATEGORIES = CATEGORIES[-6:]
DEFAULT_BENCH_MAX_TOKENS = 128  # tokens, for prompts without their own max_tokens


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: exactly one of ``prompt`` (raw text) or ``messages`` (chat) is set;
    with ``suffix`` set (a fill-in-the-middle prompt: :attr:`fim`), prompt is the code before the
    cursor, suffix the code after it and extra other files as (filename, text) pairs; max_tokens is the completion cap in tokens; grammar, when set, constrains every
    generation of the prompt (structured output, from the entry's ``json_schema``);
    prediction, when set, is the output the client expects (the original file of an edit):
    each configuration that can follow one also runs with it, as ``CONFIG+prediction``;
    tools, when set, are the OpenAI tool objects the chat template presents (messages only)."""

    id: str
    category: str
    prompt: str | None
    messages: list | None
    max_tokens: int
    grammar: Grammar | None = None
    prediction: str | None = None
    tools: list | None = None
    suffix: str | None = None
    extra: tuple[tuple[str, str], ...] = ()

    @property
    def fim(self) -> bool:
        """Whether the prompt is a fill-in-the-middle one (the model's FIM tokens lay it out)."""
        return self.suffix is not None


def load_prompts(path: str | Path | None, default_max_tokens: int = DEFAULT_BENCH_MAX_TOKENS) -> list[BenchPrompt]:
    """Read a JSON Lines prompt file (the built-in suite when path is None).

    Each line: ``category``, exactly one of ``prompt``, ``messages`` or ``prefix`` (with
    ``suffix``, "" at the end of a file, and optional ``extra``, other files as
    ``[{"filename", "text"}]``: a fill-in-the-middle prompt, the output the middle), optional
    ``max_tokens`` (tokens; default_max_tokens otherwise), ``id``, ``json_schema`` (a
    JSON schema object the output must match: :meth:`Grammar.json_schema`, named after the
    file and line; compiled only when generating), ``prediction`` (a string: the
    predicted output) and ``tools`` (with ``messages``: a list of OpenAI tool objects the
    chat template presents, as agents send them).
    Raises SpecDecodeError naming the file and line for malformed entries, and when the
    file is missing or holds no prompts.
    """
    if path is None:
        text = resources.files("specdecode").joinpath("data/bench_suite.jsonl").read_text(encoding="utf-8")
        where = "built-in suite"
    else:
        p = Path(path)
        if not p.is_file():
            raise SpecDecodeError(f"prompts file {p} does not exist")
        text = p.read_text(encoding="utf-8")
        where = str(p)
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{where}, line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("category"), str):
            raise SpecDecodeError(f"{where}, line {i}: expected an object with a string 'category'")
        has_p, has_m, has_f = "prompt" in obj, "messages" in obj, "prefix" in obj
        if has_p + has_m + has_f != 1:
            raise SpecDecodeError(f"{where}, line {i}: give exactly one of 'prompt', 'messages' or 'prefix'")
        if has_p and not isinstance(obj["prompt"], str):
            raise SpecDecodeError(f"{where}, line {i}: 'prompt' must be a string")
        suffix, extra = _fim_fields(obj, has_f, f"{where}, line {i}")
        if has_m and (not isinstance(obj["messages"], list) or not obj["messages"]):
            raise SpecDecodeError(f"{where}, line {i}: 'messages' must be a non-empty list")
        mt = obj.get("max_tokens", default_max_tokens)
        if not isinstance(mt, int) or mt < 1:
            raise SpecDecodeError(f"{where}, line {i}: max_tokens = {mt!r}, expected a positive integer")
        grammar = None
        if "json_schema" in obj:
            if not isinstance(obj["json_schema"], dict):
                raise SpecDecodeError(f"{where}, line {i}: 'json_schema' must be a JSON schema object, "
                                      f"got {type(obj['json_schema']).__name__}")
            grammar = Grammar.json_schema(obj["json_schema"], name=f"{where}, line {i}")
        if not isinstance(obj.get("prediction", ""), str):
            raise SpecDecodeError(f"{where}, line {i}: 'prediction' must be a string")
        tools = obj.get("tools")
        if tools is not None and (not has_m or not isinstance(tools, list)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise SpecDecodeError(f"{where}, line {i}: 'tools' must be a list of tool objects, with 'messages'")
        out.append(BenchPrompt(str(obj.get("id", f"{obj['category']}-{i}")), obj["category"],
                               obj["prefix"] if has_f else obj.get("prompt"), obj.get("messages"), mt, grammar,
                               obj.get("prediction") or None, tools or None, suffix, extra))
    if not out:
        raise SpecDecodeError(f"{where} holds no prompts")
    return out


def _fim_fields(obj: dict, has_prefix: bool, where: str) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """A line's (suffix, extra): (None, ()) without ``prefix``. Raises SpecDecodeError naming
    ``where`` for a prefix or suffix that is not a string, a malformed extra file, and suffix or
    extra without prefix."""
    if not has_prefix:
        if "suffix" in obj or "extra" in obj:
            raise SpecDecodeError(f"{where}: 'suffix' and 'extra' make a fill-in-the-middle prompt: give them "
                                  "with 'prefix' (the code before the cursor)")
        return None, ()
    suffix = obj.get("suffix", "")
    if not isinstance(obj["prefix"], str) or not isinstance(suffix, str):
        raise SpecDecodeError(f"{where}: 'prefix' and 'suffix' must be strings")
    try:
        return suffix, check_extra(obj.get("extra"))
    except SpecDecodeError as e:
        raise SpecDecodeError(f"{where}: {e}") from None


def rewrite_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a script that writes suite categories: ``--out``, where the suite goes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=Path("bench-out") / "bench_suite.jsonl",
                    help="where the rewritten suite goes (default: %(default)s)")
    return ap


def rewrite_suite(out: str | Path, categories: Sequence[str], new_entries: Callable[[list[dict]], list[dict]]) -> None:
    """Write the built-in suite to ``out`` (never into the package) with the prompts of
    ``categories`` replaced by new_entries(the other prompts' entries), those kept as written and
    the new ones after them: what the benchmarks/ scripts that write the suite's categories do."""
    suite = resources.files("specdecode").joinpath("data/bench_suite.jsonl").read_text(encoding="utf-8")
    lines = [line for line in suite.splitlines() if line.strip()]
    kept_lines = [line for line in lines if json.loads(line)["category"] not in categories]
    kept = [json.loads(line) for line in kept_lines]
    new = new_entries(kept)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in kept_lines + [json.dumps(r) for r in new]))
    print(f"{out}: {len(kept)} prompts kept, {len(new)} written in {', '.join(categories)}")


def select_prompts(prompts: Sequence[BenchPrompt], categories: Iterable[str] | None = None,
                   per_category: int | None = None) -> list[BenchPrompt]:
    """The prompts in ``categories`` (when None, all but the LONG_CONTEXT_CATEGORIES), at most
    ``per_category`` of each (all when None), in file order. Raises SpecDecodeError when none
    are left."""
    wanted = set(categories) if categories else None
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        if p.category not in wanted if wanted is not None else p.category in LONG_CONTEXT_CATEGORIES:
            continue
        seen[p.category] = seen.get(p.category, 0) + 1
        if per_category is None or seen[p.category] <= per_category:
            out.append(p)
    if not out:
        raise SpecDecodeError("no prompts left after --categories / --per-category")
    return out


def parse_config(text: str) -> tuple[str, int | str]:
    """'DRAFT:K' (K an integer 0..MAX_NUM_SPECULATIVE_TOKENS, or auto), or 'DRAFT' meaning
    DRAFT:auto; DRAFT may be a kind with an argument, heads:FILE (its K, if any, after it). Returns (draft, K).
    Raises SpecDecodeError (param ``--config``) otherwise."""
    if names_with_arg(text):  # NAME:ARG[:K]
        head, _, tail = text.rpartition(":")
        draft, k = (head, tail) if ":" in head and (tail == "auto" or tail.isdigit()) else (text, "")
    else:
        draft, _, k = text.partition(":")
    if not draft:
        raise SpecDecodeError(f"--config {text!r}: expected DRAFT[:K], e.g. ngram:4 or auto:auto", param="--config")
    if not k or k == "auto":
        return draft, "auto"
    try:
        kk = int(k)
    except ValueError:
        raise SpecDecodeError(f"--config {text!r}: K must be an integer 0..{MAX_NUM_SPECULATIVE_TOKENS} or auto",
                              param="--config") from None
    try:
        check_num_speculative_tokens(kk, name="K", allow_auto=False)
    except SpecDecodeError as e:
        # The message names the whole configuration; the parameter is the option itself.
        raise SpecDecodeError(f"--config {text!r}: {e}", param="--config") from None
    return draft, kk
