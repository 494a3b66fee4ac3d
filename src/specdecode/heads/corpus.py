"""``specdecode heads corpus``: self-distillation data for draft heads.

Heads are used on the target's own answers, so they learn best from them: Medusa-2 (Cai et
al. 2024, Sec. 2.3.2) trains on conversations whose answers the model itself generated,
which keeps the hidden states and the labels on the distribution seen at drafting time.
Text the target would not have written (library source read cold) teaches the heads to
guess what the target predicts mid-way through someone else's text.

The prompts are made offline, here, from two sources that exist on every machine:
- code tasks on functions of the Python standard library (rename a parameter, add a
  docstring, add type hints, explain, simplify): answers that copy and edit code;
- instructions from templates and topic lists written below (explanations, short stories,
  messages and emails, advice, comparisons): answers in plain prose.
The target answers each one (greedily, or sampled with ``--temperature``; on any backend,
llama.cpp serving them in parallel slots), and each conversation is written with the target's own chat template, ending in
its end-of-turn token, one file per conversation kind, ready for ``heads train --corpus``.
"""

from __future__ import annotations

import ast
import contextlib
import sysconfig
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import SpecDecodeError
from ..files import atomic_folder
from ..output import GenerationResult

SYSTEMS = {"code": (None, "You are a careful coding assistant. Make only the requested change and return the "
                         "complete code.", "You are a senior Python developer."),
           "chat": (None, "You are a helpful assistant.", "You are a concise, friendly assistant.")}

CODE_TASKS = (
    "Rename the parameter `{param}` to `{new}` everywhere in this function. Change nothing else and return the "
    "complete function.",
    "Add a docstring to this function that describes its parameters and its return value. Leave the code "
    "unchanged and return the whole function.",
    "Add type hints to every parameter and to the return value of this function. Do not change anything else; "
    "return the complete function.",
    "Explain what this function does, step by step, in a few short paragraphs.",
    "Rewrite this function so that it is easier to read, without changing its behaviour. Return the complete "
    "function.",
    "Add a comment above each non-obvious line of this function. Return the whole function with the comments.",
)
NEW_NAMES = ("value", "items", "data", "source", "target", "options", "config", "result_list", "entry", "payload")

CHAT_TASKS = {
    "Explain {} to someone who has never heard of it, using an everyday analogy.": (
        "compound interest", "a compiler", "photosynthesis", "public-key cryptography", "inflation",
        "a database index", "vaccines", "recursion", "the greenhouse effect", "version control"),
    "Write a short story, about 120 words, about {}.": (
        "a lighthouse keeper who finds a message in a bottle", "a cat that learns to open doors",
        "the last bookshop in a city", "a gardener who grows a very strange plant", "two strangers on a night train",
        "a child's first day at a new school", "an old pianist who plays one more concert",
        "a fox that befriends a farmer"),
    "Write a short, polite message to {}.": (
        "my neighbour asking them to keep the noise down after 11 pm", "a colleague thanking them for covering my "
        "shift", "my manager asking for a day off next Friday", "a client saying the delivery will be two days late",
        "a friend apologising for missing their birthday party", "the school asking when term starts",
        "a hotel asking to change my booking to a later date", "my team announcing that I am moving to a new role"),
    "Give me practical tips for {}.": (
        "sleeping better when I work late", "saving money on groceries", "preparing for a job interview",
        "keeping houseplants alive", "reading more books in a busy year", "running my first 5 km race",
        "writing clearer emails at work", "staying focused while working from home"),
    "What is the difference between {}? Give a short example of each.": (
        "weather and climate", "a list and a tuple in Python", "stocks and bonds", "a virus and a bacterium",
        "TCP and UDP", "renting and leasing a car", "affect and effect", "a library and a framework"),
    "Summarise the main ideas of {} in a few sentences.": (
        "the theory of evolution", "supply and demand", "the water cycle", "object-oriented programming",
        "the scientific method", "the French Revolution", "plate tectonics", "agile software development"),
    "How do I {}? List the steps.": (
        "make a simple tomato sauce", "change a flat bicycle tyre", "set up a Python virtual environment",
        "plan a week of healthy meals", "write a good README for a project", "start learning to draw",
        "back up the photos on my phone", "organise a small team meeting"),
    "Write a four-line poem about {}.": (
        "autumn leaves", "a rainy Monday morning", "the sea at night", "an old wooden bridge", "coffee",
        "learning something new"),
    "Why {}? Explain it simply.": (
        "do we have leap years", "does ice float on water", "do cats purr", "does bread go stale",
        "do airplanes leave white trails in the sky", "does the moon change shape", "do onions make us cry",
        "is the ocean salty"),
    "I'm {}. What should I keep in mind?": (
        "moving to a new city for work", "adopting a dog for the first time", "giving my first public talk",
        "buying a used car", "starting to learn the guitar", "travelling abroad alone for the first time",
        "managing a team for the first time", "going back to university at forty"),
    "Write a short product description for {}.": (
        "a reusable water bottle", "a wireless keyboard", "a handmade ceramic mug", "a hiking backpack",
        "a desk lamp with adjustable colour", "a beginner's chess set"),
    "Describe a typical day in the life of {}.": (
        "a nurse on a night shift", "a beekeeper", "a software tester", "a baker", "a museum guide",
        "a long-distance truck driver"),
    "Give three arguments for and three against {}.": (
        "working a four-day week", "school uniforms", "electric scooters in cities", "learning Latin at school",
        "remote work", "banning cars from city centres"),
}


def _functions(rng: np.random.Generator, n: int, lo: int = 8, hi: int = 40) -> list[tuple[str, list[str]]]:
    """n standard-library functions (source, parameter names) of lo..hi lines, seeded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    found: list[tuple[str, list[str]]] = []
    for i in rng.permutation(len(files)):
        try:
            src = files[i].read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and lo <= (f.end_lineno or f.lineno) - f.lineno + 1 <= hi]
        if not funcs:
            continue
        f = funcs[int(rng.integers(len(funcs)))]
        seg = ast.get_source_segment(src, f, padded=True)
        if not seg or "\t" in seg:
            continue
        seg = textwrap.dedent(seg)
        params = [a.arg for a in f.args.args + f.args.kwonlyargs if a.arg not in ("self", "cls")]
        found.append((seg, params))
        if len(found) >= n:
            break
    return found


def make_prompts(n: int, seed: int = 0) -> list[tuple[str, list[dict]]]:
    """n conversations to answer, half code tasks and half instructions: (kind, messages)
    with kind "code" or "chat", in a seeded order. Raises SpecDecodeError when n < 1."""
    if not isinstance(n, int) or n < 1:
        raise SpecDecodeError(f"--prompts {n} is out of range: expected >= 1", param="--prompts")
    rng = np.random.default_rng(seed)
    n_code = n // 2
    out: list[tuple[str, list[dict]]] = []
    for src, params in _functions(rng, n_code):
        tasks = [t for t in CODE_TASKS if params or "{param}" not in t]
        task = tasks[int(rng.integers(len(tasks)))]
        text = task.format(param=params[0] if params else "", new=NEW_NAMES[int(rng.integers(len(NEW_NAMES)))])
        out.append(("code", _with_system(rng, "code", [{"role": "user", "content": f"{text}\n\n```python\n{src}\n```"}])))
    chats = [t.format(topic) for t, topics in CHAT_TASKS.items() for topic in topics]
    for i in rng.permutation(len(chats))[: n - len(out)]:
        out.append(("chat", _with_system(rng, "chat", [{"role": "user", "content": chats[i]}])))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _with_system(rng: np.random.Generator, kind: str, messages: list[dict]) -> list[dict]:
    system = SYSTEMS[kind][int(rng.integers(len(SYSTEMS[kind])))]
    return ([{"role": "system", "content": system}] if system else []) + messages


def end_of_turn_text(backend, prompt_text: str) -> str:
    """The text of the end-of-generation token the chat template closes turns with (the one
    that appears in a rendered prompt; else the first end-of-generation id's text)."""
    texts = sorted(backend.token_text(i).decode("utf-8", "replace") for i in backend.eog_ids)
    for t in texts:
        if t and t in prompt_text:
            return t
    return texts[0] if texts else ""


def answer_all(decoder, prompts: Sequence[tuple[str, list[dict]]], max_tokens: int,
               progress: Callable[[int], None] | None = None, temperature: float = 0.0,
               seed: int = 0) -> Iterator[tuple[str, str]]:
    """The target's answers (greedy, or sampled at temperature with seed + i for the i-th
    prompt), in the decoder's parallel slots (continuous batching):
    yields (kind, transcript) in completion order, the transcript being the rendered prompt,
    the answer and, when the answer ended by itself, the end-of-turn text."""
    target = decoder.target
    queue = list(enumerate(prompts))
    running: dict = {}
    while queue or running:
        while queue and len(running) < len(decoder.engine.slots):
            i, (kind, messages) = queue.pop(0)
            text = target.apply_chat_template(messages)
            g = decoder.begin(prompt_ids=target.tokenize(text, add_special=False, parse_special=True),
                              max_tokens=max_tokens, temperature=temperature, seed=seed + i)
            running[id(g)] = (g, kind, text)
        decoder.step([g for g, _, _ in running.values()])
        for key, (g, kind, text) in list(running.items()):
            if g.done:
                result = [x for x in decoder.end(g) if isinstance(x, GenerationResult)][0]
                del running[key]
                end = end_of_turn_text(target, text) if result.finish_reason == "stop" else ""
                if progress:
                    progress(len(result.token_ids))
                yield kind, text + result.text + end


def check_corpus_options(out: str | Path, max_tokens: int = 1, temperature: float = 0.0) -> Path:
    """out as a Path when it may be written (absent, or an empty folder); raises
    SpecDecodeError naming the first option at fault (max_tokens >= 1, temperature 0..2)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecDecodeError(f"--out {out} exists and is not an empty folder", param="--out")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens {max_tokens} is out of range: expected >= 1", param="--max-tokens")
    if not 0.0 <= temperature <= 2.0:
        raise SpecDecodeError(f"--temperature {temperature} is out of range: expected 0..2", param="--temperature")
    return out


def write_corpus(out: str | Path, transcripts: Iterator[tuple[str, str]]) -> dict:
    """Write the transcripts to out/<kind>.txt, atomically: into a temporary folder beside
    out, renamed to out only when all are written (out must not exist or be an empty
    folder). Returns {kind: conversations}. Raises SpecDecodeError when out is taken."""
    out = check_corpus_options(out)
    counts: dict[str, int] = {}
    with atomic_folder(out, replace_empty=True) as tmp, contextlib.ExitStack() as files:
        opened = {}  # the ExitStack closes every file, however the loop ends (before the rename)
        for kind, text in transcripts:
            if kind not in opened:
                opened[kind] = files.enter_context(open(tmp / f"{kind}.txt", "w", encoding="utf-8"))
            opened[kind].write(text + "\n")
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def build_corpus(decoder, out: str | Path, prompts: Sequence[tuple[str, list[dict]]], max_tokens: int,
                 seed: int = 0, progress: bool = True, temperature: float = 0.0) -> dict:
    """Have the decoder's target answer the prompts (:func:`make_prompts`; greedy at
    temperature 0, else sampled with seed + i: several corpora from the same templates then
    differ), and write the corpus folder. Returns a report: conversations per kind, answer
    tokens, seconds. Raises SpecDecodeError for the options :func:`check_corpus_options` checks."""
    from tqdm import tqdm

    check_corpus_options(out, max_tokens, temperature)
    t0 = time.perf_counter()
    tokens = [0]
    with tqdm(total=len(prompts), unit="answer", desc="target answers", disable=not progress) as bar:
        def done(n_tokens: int) -> None:
            tokens[0] += n_tokens
            bar.update()
            bar.set_postfix(tokens=tokens[0])
        counts = write_corpus(out, answer_all(decoder, prompts, max_tokens, done, temperature, seed))
    return {"conversations": counts, "answer_tokens": tokens[0], "seconds": round(time.perf_counter() - t0, 1),
            "out": str(out)}


# A self-distilled corpus (the default of ``heads train``) makes one conversation per this many
# tokens of the training budget: a rendered prompt with its answer holds about as many.
TOKENS_PER_CONVERSATION = 300
SELF_MAX_TOKENS = 256  # longest answer, in tokens


def self_corpus(target: str, tokens: int, seed: int = 0, n_threads: int | None = None, progress: bool = True,
                parallel: int = 8, root: Path | None = None) -> tuple[Path, dict | None]:
    """The target's own answers to :func:`make_prompts` conversations, enough for ``tokens``
    training tokens: built once per target, budget and seed into ``root`` (default: the
    model cache's ``corpus/``), then reused. Returns (the corpus folder, the build report or None when it
    was cached). Raises SpecDecodeError as the Decoder does (the target cannot load)."""
    import re

    from ..api import Decoder
    from ..assembly import registry

    n = max(8, -(-tokens // TOKENS_PER_CONVERSATION))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", str(target))[-60:]
    out = (root or registry.cache_dir() / "corpus") / f"{name}-{n}-seed{seed}"
    if out.is_dir() and any(out.iterdir()):
        return out, None
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(n, seed)
    with Decoder(target, draft="auto", n_threads=n_threads, parallel=parallel, progress=progress) as dec:
        report = build_corpus(dec, out, prompts, SELF_MAX_TOKENS, seed=seed, progress=progress)
    return out, report
