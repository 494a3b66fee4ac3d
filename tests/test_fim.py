"""Fill-in-the-middle prompts from the model's own tokens (:mod:`specdecode.backends.fim`): read on
both backends, laid out as llama.cpp's server lays them out, lossless under speculation, refused by
name where the model has none; ``suffix`` on ``/v1/completions`` through the openai SDK; an
editor's next keystroke reuses the cached prefix and says so."""

from __future__ import annotations

import openai
import pytest

from specdecode.api import Decoder
from specdecode.backends.fim import FIM_TOKEN_TEXTS, FimInput, FimTokens, check_extra, fim_prompt_ids
from specdecode.errors import SpecDecodeError
from specdecode.server import create_app

from test_server import ServerThread

QWEN = "qwen2.5-coder-0.5b-instruct"
PREFIX = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
SUFFIX = "\n    return a\n\n\nprint(fibonacci(10))\n"


@pytest.fixture(scope="module")
def qwen():
    dec = Decoder(target=QWEN, draft="ngram", n_ctx=2048, n_threads=2, progress=False)
    yield dec
    dec.close()


def text_ids(backend, s: str) -> list[int]:
    return backend.tokenize(s, add_special=False, parse_special=False)


def test_qwen_fim_tokens_are_read_from_the_gguf_and_end_the_middle(qwen):
    t = qwen.target.fim_tokens
    names = {role: qwen.target.token_text(getattr(t, role)).decode() for role in ("pre", "suf", "mid", "pad", "rep",
                                                                                   "sep")}
    assert names == {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
                     "rep": "<|repo_name|>", "sep": "<|file_sep|>"}
    assert {t.pad, t.rep, t.sep} <= qwen.target.eog_ids


def test_the_prompt_is_llama_cpps_repo_level_layout(qwen):
    b, t = qwen.target, qwen.target.fim_tokens
    extra = (("utils.py", "def add(a, b):\n    return a + b\n"), ("main.py", "print(add(1, 2))\n"))
    ids = fim_prompt_ids(b, FimInput(PREFIX, SUFFIX, extra))
    want = [t.rep, *text_ids(b, "myproject\n"),
            t.sep, *text_ids(b, "utils.py\n"), *text_ids(b, extra[0][1]),
            t.sep, *text_ids(b, "main.py\n"), *text_ids(b, extra[1][1]),
            t.sep, *text_ids(b, "filename\n"),
            t.pre, *text_ids(b, PREFIX), t.suf, *text_ids(b, SUFFIX), t.mid]
    assert ids == want
    # The Decoder's prompt is the same, and a marker's text in the code stays text.
    assert qwen.prompt_ids(PREFIX, suffix=SUFFIX, extra=list(extra)) == want
    forged = qwen.prompt_ids("x = '<|fim_middle|>'\n", suffix="")
    assert forged.count(t.mid) == 1 and forged[-1] == t.mid


class _Vocab:
    """A backend whose vocabulary is a word list (one token per word, split on spaces)."""

    name = "toy"

    def __init__(self, words, bos=None):
        self.words = list(words)
        self.bos = bos

    def tokenize(self, text, add_special=True, parse_special=False):
        ids = [self.words.index(w) for w in text.split(" ") if w]
        return ([self.bos] if add_special and self.bos is not None else []) + ids


def test_without_a_file_separator_files_are_snippets_and_bos_goes_before_the_prefix():
    words = ["<s>", "P", "S", "M", "a", "b", "\n\n---", "snippet", "---\n\n", "f", "x"]
    toy = _Vocab(words, bos=0)
    toy.fim_tokens = FimTokens(pre=1, suf=2, mid=3)
    ids = fim_prompt_ids(toy, FimInput("a", "b", (("f.py", "x"),)))
    # "\n\n--- snippet ---\n\n" splits on its spaces into the toy's three words
    assert ids == [6, 7, 8, 10, 0, 1, 4, 2, 5, 3]


def test_fim_tokens_by_text_need_prefix_suffix_and_middle():
    starcoder = {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4, "<filename>": 5}
    t = FimTokens.from_texts(starcoder.get)
    assert (t.pre, t.suf, t.mid, t.pad, t.rep, t.sep) == (1, 3, 2, 4, None, 5)
    assert t.end_ids == {4, 5}
    assert FimTokens.from_texts({"<fim_prefix>": 1, "<fim_suffix>": 3}.get) is None  # no middle: no FIM
    assert all(texts for texts in FIM_TOKEN_TEXTS.values())


def test_torch_backend_reads_fim_tokens_from_its_tokenizer():
    torch = pytest.importorskip("torch")
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from specdecode.backends.torch import TorchBackend

    specials = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                              additional_special_tokens=specials[1:])
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    backend = TorchBackend(transformers.Qwen2ForCausalLM(config).eval(), hf, n_ctx=128, name="tiny-coder")
    t = backend.fim_tokens
    assert [hf.convert_ids_to_tokens(i) for i in (t.pre, t.suf, t.mid, t.pad, t.rep, t.sep)] == \
        ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    assert {t.pad, t.rep, t.sep} <= backend.eog_ids
    ids = fim_prompt_ids(backend, FimInput("def f(x):\n", "    return x\n"))
    assert ids[-1] == t.mid and ids.count(t.pre) == ids.count(t.suf) == 1 and ids[0] == t.rep
    # llama.cpp's layout token for token, the /infill prompt field and budget included
    from specdecode.backends.fim import FimBudget
    fim = FimInput("def f(x):\n" * 40, "    return x\n" * 80, (("a.py", "x = 1\n" * 50),), fit=True, prompt="    ret")
    want = llama_cpp_infill(lambda s: backend.tokenize(s, add_special=False, parse_special=False), t, None,
                            fim.prefix, fim.suffix, fim.extra, fim.prompt, 2048, -1, 4096)
    assert fim_prompt_ids(backend, fim, budget=FimBudget.for_context(4096, 16)) == want


def test_a_model_without_fim_tokens_is_refused_by_name(smollm):
    assert smollm.fim_tokens is None
    with pytest.raises(SpecDecodeError) as e:
        fim_prompt_ids(smollm, FimInput("def f(", ")"))
    assert e.value.param == "suffix" and smollm.name in str(e.value) and "fill-in-the-middle" in str(e.value)


@pytest.mark.parametrize("extra,param", [("x.py", "extra"), ([("x.py",)], "extra[0]"), ([{"filename": "a"}], "extra[0]"),
                                         ([("a", "b"), ("c", 3)], "extra[1]")])
def test_malformed_files_are_named(extra, param):
    with pytest.raises(SpecDecodeError) as e:
        check_extra(extra)
    assert e.value.param == param


def test_fim_is_lossless_under_speculation_and_the_next_keystroke_reuses_the_cache(qwen):
    spec, plain, report = qwen.compare(PREFIX, suffix=SUFFIX, max_tokens=24)
    assert report["parity"]["status"] in ("exact", "near-tie"), report
    assert spec.stats.prompt_tokens == len(qwen.prompt_ids(PREFIX, suffix=SUFFIX))
    # The editor sends the file again, one line longer (suffix unchanged): only the tokens after
    # the common prefix are evaluated again.
    first = qwen.generate(PREFIX, suffix=SUFFIX, max_tokens=4)
    again = qwen.generate(PREFIX + "    for _ in range(n):\n", suffix=SUFFIX, max_tokens=4)
    common = 0
    a, b = qwen.prompt_ids(PREFIX, suffix=SUFFIX), qwen.prompt_ids(PREFIX + "    for _ in range(n):\n", suffix=SUFFIX)
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert first.stats.prompt_tokens == len(a) and again.stats.prompt_tokens == len(b)
    assert again.stats.prompt_cached == common > 0


@pytest.fixture(scope="module")
def qwen_server(qwen):
    with ServerThread(create_app(qwen, max_queue=4)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_openai_sdk_suffix_gives_the_middle_as_the_decoder_does(qwen, qwen_server):
    want = qwen.generate(PREFIX, suffix=SUFFIX, max_tokens=16, plain=True).text
    r = qwen_server.completions.create(model=QWEN, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0)
    assert r.choices[0].text == want
    assert r.model_extra["speculation"]["prompt_tokens"] == len(qwen.prompt_ids(PREFIX, suffix=SUFFIX))
    pieces = qwen_server.completions.create(model=QWEN, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"speculative": {"draft": "ngram"}})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want
    # The second request held the first's prompt in a slot's cache: all but its last token.
    again = qwen_server.completions.create(model=QWEN, prompt=PREFIX, suffix=SUFFIX, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_suffix_on_a_model_without_fim_tokens_is_a_400_naming_both(smollm):
    # a Decoder of its own model: closing a Decoder closes its target (the session's stays open)
    dec = Decoder(target="smollm2-135m-instruct", draft="none", n_ctx=512, progress=False)
    with ServerThread(create_app(dec, max_queue=2)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=dec.target_name, prompt="def f(", suffix="):\n    pass\n", max_tokens=4)
        err = e.value.body
        assert err["param"] == "suffix" and dec.target.name in err["message"], err
        # An empty suffix (the cursor at the end of the file) is a plain completion there.
        r = client.completions.create(model=dec.target_name, prompt="def f(", suffix="", max_tokens=2, temperature=0)
        assert r.choices[0].text == dec.generate("def f(", max_tokens=2).text
    dec.close()


def test_auto_never_drafts_with_the_target_itself(qwen, smollm):
    """Issue 46, item 7: the 0.5B as the target with --draft auto loaded the 0.5B as its own draft
    model ("costs 35.45 of a target step")."""
    from specdecode.assembly.loading import is_default_draft, make_controller

    assert is_default_draft(qwen.target) and not is_default_draft(smollm)
    controller = make_controller("auto", qwen.target, kmax=4, n_ctx=512, progress=False)
    try:
        drafted_by = [s.drafter for s in controller.sources]
        assert not any(d.draft_backends() for d in drafted_by), [type(d).__name__ for d in drafted_by]
    finally:
        controller.close()


def test_llama_cpps_infill_budget_trims_instead_of_refusing(qwen):
    """llama.vim's defaults give a 7,742-token prompt; llama.cpp's /infill trims it to fit."""
    from specdecode.backends.fim import FimBudget

    b, t = qwen.target, qwen.target.fim_tokens
    prefix, suffix = "x = 1\n" * 3000, "y = 2\n" * 1000
    files = tuple((f"f{i}.py", f"z{i} = {i}\n" * 300) for i in range(8))
    budget = FimBudget.for_context(4096, 128)
    assert (budget.n_batch, budget.n_predict, budget.reserve) == (2048, -1, 128)  # llama-server's -b and -n
    ids = fim_prompt_ids(b, FimInput(prefix, suffix, files), budget=budget)
    whole = fim_prompt_ids(b, FimInput(prefix, suffix, files))
    assert len(whole) > 4096 >= len(ids) + 128
    mid = ids.index(t.pre)
    assert len(ids) - mid == 1 + 1536 + 1 + 510 + 1  # pre, the prefix's last 3/4 n_batch, suf, 510, mid
    assert ids[mid + 1:mid + 1537] == text_ids(b, prefix)[-1536:]
    # llama.cpp's budget keeps the files' last 4096 - 2048 + 2 tokens, 3 too many for this context:
    # the oldest go until the middle's 128 fit
    assert mid == 4096 - 128 - (len(ids) - mid)
    assert ids[:mid] == whole[:whole.index(t.pre)][-mid:]


@pytest.mark.parametrize("n_predict", [-1, 0])
def test_the_budget_trims_with_n_predict_minus_one_or_zero(qwen, n_predict):
    """Issue 61: with n_predict -1 (its default) or 0, a prompt over the budget was refused ("the
    prompt has 4097 tokens but the context holds 4096") where n_predict 1 trimmed it."""
    from specdecode.backends.fim import FimBudget

    b = qwen.target
    files = tuple((f"f{i}.py", f"z{i} = {i}\n" * 300) for i in range(8))
    fim = FimInput("x = 1\n" * 3000, "y = 2\n" * 1000, files)
    assert len(fim_prompt_ids(b, fim)) > 4096
    ids = fim_prompt_ids(b, fim, budget=FimBudget.for_context(4096, n_predict))
    assert 4096 - 8 <= len(ids) <= 4096 - 1  # trimmed, and one token left for the middle


def llama_cpp_infill(tokenize, t, bos, prefix, suffix, extra, prompt, n_batch, n_predict, n_ctx):
    """A line-by-line transcription of llama.cpp's ``format_prompt_infill``
    (tools/server/server-common.cpp, the llama.cpp that llama-cpp-python 0.3.36 vendors), the
    reference the layout is held to. tokenize(text) -> ids without BOS or special parsing."""
    extra_tokens = [t.rep, *tokenize("myproject\n")] if t.rep is not None else []
    for filename, text in extra:
        extra_tokens += [t.sep, *tokenize(filename + "\n")] if t.sep is not None else \
            tokenize("\n\n--- snippet ---\n\n")
        extra_tokens += tokenize(text)
    if t.sep is not None:
        extra_tokens += [t.sep, *tokenize("filename\n")]
    tokens_prefix, tokens_suffix, tokens_prompt = tokenize(prefix), tokenize(suffix), tokenize(prompt)
    n_prefix_take = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(tokens_suffix), max(0, (n_batch // 4) - (2 + len(tokens_prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    tokens_prefix = tokens_prefix[len(tokens_prefix) - n_prefix_take:]
    tokens_suffix = tokens_suffix[:n_suffix_take]
    embd_inp = [t.pre, *tokens_prefix, *tokens_prompt]
    if bos is not None:
        embd_inp.insert(0, bos)
    embd_inp = extra_tokens[len(extra_tokens) - n_extra_take:] + embd_inp
    return embd_inp + [t.suf, *tokens_suffix] + [t.mid]


def test_infill_prompt_is_llama_cpps_token_for_token_with_the_prompt_field(qwen):
    """/infill's ``prompt`` (llama.vim: the current line up to the cursor) is tokenized on its own
    after the prefix's tokens, and shortens the suffix's budget; the files keep llama-server's
    n_ctx - 2048 + 2 newest tokens (its -n of -1)."""
    from specdecode.backends.fim import FimBudget

    b, t = qwen.target, qwen.target.fim_tokens
    line = "    a, b = b, a +"  # tokenized alone: not what "...\n    a, b = b, a +" gives as one text
    files = tuple((f"f{i}.py", f"z{i} = {i}\n" * 120) for i in range(8))
    suffix = "y = 2\n" * 400
    for n_ctx in (4096, 6144):
        budget = FimBudget.for_context(n_ctx, 64)
        ids = fim_prompt_ids(b, FimInput(PREFIX, suffix, files, fit=True, prompt=line), budget=budget)
        want = llama_cpp_infill(lambda s: text_ids(b, s), t, None, PREFIX, suffix, files, line, 2048, -1, n_ctx)
        assert ids == want and len(ids) + 64 <= n_ctx
    typed = text_ids(b, line)
    start = ids.index(t.pre) + 1
    assert ids[start:ids.index(t.suf)] == text_ids(b, PREFIX) + typed
    assert ids.index(t.mid) - ids.index(t.suf) - 1 == 2048 // 4 - 2 - len(typed)
    # Through the Decoder, as the server asks for it
    assert qwen.prompt_ids(PREFIX, suffix=suffix, extra=list(files), fim_budget=FimBudget.for_context(6144, 64),
                           fim_prompt=line) == ids
