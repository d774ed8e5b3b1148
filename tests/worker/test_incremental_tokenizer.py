"""Property tests: text cut anywhere commits exactly the tokens of the whole text.

Over both tokenizer kinds we load (a tokenizer.json through `Tokenizer.from_file`, and the one built
from GGUF metadata) and both styles (byte-level BPE, SentencePiece-style Metaspace with
`prepend_scheme="first"`). Texts mix words, whitespace runs, digits, CJK, emoji with joiners,
combining marks and special tokens, cut at random places; some cuts are flush points.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from worker.tokenizer.gguf import _LLAMA3_SPLIT, _QWEN2_SPLIT, _split_pre, tokenizer_from_gguf
from worker.tokenizer.incremental import EMPTY_TAIL, IncrementalTokenizer, TextTail
from worker.tokenizer.tokenizer import Tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]"]
PIECES = [
    "a", "b", "hello", "Hello", "world", "the", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n",
    "0", "1", "23", "456", "7890", ".", ",", "!", "?", "'s", "'t", "don", "-", "_", "<", "|", ">", "im",
    "你", "好", "世界", "。", "👨", "\u200d", "👩", "👧", "🇫🇷", "e", "\u0301", "\u0308", "é", "ñ",
    *SPECIALS, "<|im", "_start|>", "<|im_e", "nd|>", "[IN", "ST]", "<", "s>",
]  # fmt: skip
CORPUS = [
    "Hello world, the capital of France is Paris. Don't stop; it's 1234 or 56.78!",
    "你好世界。我们 的 世界 很 大。 👨\u200d👩\u200d👧 family 🇫🇷 café naïve e\u0301 ñ",
    "  indented\n\tcode = x_1 + y_23 -> <tag> | pipe\r\n\n\nend   spaces   here",
] * 20

texts = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)


def _trained(pre: pre_tokenizers.PreTokenizer, decoder: decoders.Decoder, byte_level: bool) -> Backend:
    backend = Backend(models.BPE(unk_token=None if byte_level else "<unk>"))
    backend.pre_tokenizer = pre
    backend.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else sorted(set("".join(CORPUS + PIECES)))
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *SPECIALS], initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


def _from_json(backend: Backend, tmp: Path) -> Tokenizer:
    """Through tokenizer.json, the file the HF directory loader reads."""
    path = tmp / "tokenizer.json"
    backend.save(str(path))
    return Tokenizer.from_file(path)


@pytest.fixture(
    scope="module",
    params=["sentencepiece-json", "bytelevel-json", "qwen2-gguf-pre", "llama3-gguf-pre", "tiny"],
)
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "sentencepiece-json":
        # Llama-2 / Mistral style: spaces become "▁", and only the text's very start gets one prepended.
        metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        return _from_json(_trained(metaspace, decoders.Metaspace(prepend_scheme="first"), False), tmp)
    if request.param == "bytelevel-json":
        # Llama-3 style: digits and words split by a regex, then byte-level BPE.
        pre = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        return _from_json(_trained(pre, decoders.ByteLevel(), True), tmp)
    if request.param.endswith("-gguf-pre"):
        # The split regexes (and Qwen2's NFC normalizer) the GGUF builder maps `tokenizer.ggml.pre` to.
        qwen2 = request.param.startswith("qwen2")
        backend = _trained(_split_pre(_QWEN2_SPLIT if qwen2 else _LLAMA3_SPLIT)(), decoders.ByteLevel(), True)
        if qwen2:
            backend.normalizer = normalizers.NFC()
        return _from_json(backend, tmp)
    return Tokenizer.byte_level(512, special_tokens=SPECIALS)


def _stream(
    inc: IncrementalTokenizer, text: str, cuts: list[int], flushes: set[int]
) -> tuple[list[int], TextTail]:
    tokens: list[int] = []
    state = EMPTY_TAIL
    bounds = [*sorted(set(cuts)), len(text)]
    start = 0
    for end in bounds:
        committed, state = inc.feed(state, text[start:end], flush=end in flushes)
        tokens += committed
        start = end
    return tokens, state


def _expected(tokenizer: Tokenizer, text: str, flushes: set[int]) -> list[int]:
    tokens: list[int] = []
    start = 0
    for end in [*sorted(flushes), len(text)]:
        tokens += tokenizer.encode(text[start:end])
        start = end
    return tokens


@st.composite
def cut_texts(draw: st.DrawFn) -> tuple[str, list[int], set[int]]:
    text = draw(texts)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    flushes = set(draw(st.lists(st.sampled_from(cuts), max_size=3))) if cuts else set()
    return text, cuts, flushes


CHECKS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def check_cut_anywhere(tokenizer: Tokenizer, case: tuple[str, list[int], set[int]]) -> None:
    text, cuts, flushes = case
    inc = IncrementalTokenizer(tokenizer)
    tokens, state = _stream(inc, text, cuts, flushes | {len(text)})
    assert tokens == _expected(tokenizer, text, flushes)
    assert state == EMPTY_TAIL


@CHECKS
@given(case=cut_texts())
def test_cut_anywhere_commits_the_whole_texts_tokens(
    tokenizer: Tokenizer, case: tuple[str, list[int], set[int]]
) -> None:
    check_cut_anywhere(tokenizer, case)


@CHECKS
@given(text=texts, data=st.data())
def test_every_single_character_piece(tokenizer: Tokenizer, text: str, data: st.DataObject) -> None:
    """The hardest cut: one character per piece; without a flush, committed tokens are a prefix."""
    inc = IncrementalTokenizer(tokenizer)
    whole = tokenizer.encode(text)
    committed, state = _stream(inc, text, list(range(len(text))), set())
    assert whole[: len(committed)] == committed
    rest, final = inc.feed(state, "", flush=True)
    assert committed + rest == whole and final == EMPTY_TAIL


def test_tail_is_short_and_history_is_never_re_encoded(tokenizer: Tokenizer) -> None:
    """After a long text the state is one word, not the text: a piece's cost does not grow."""
    inc = IncrementalTokenizer(tokenizer)
    state = EMPTY_TAIL
    text = "the capital of France is Paris, 1234 你好 👨\u200d👩 café. " * 200
    tokens: list[int] = []
    for i in range(0, len(text), 7):
        committed, state = inc.feed(state, text[i : i + 7], flush=False)
        tokens += committed
        assert len(state.text) < 40 and len(state.context) < 40
    rest, _ = inc.feed(state, "", flush=True)
    assert tokens + rest == tokenizer.encode(text)


def test_chatml_in_nine_character_pieces(tokenizer: Tokenizer) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    inc = IncrementalTokenizer(tokenizer)
    cuts = list(range(9, len(prompt), 9))
    tokens, _ = _stream(inc, prompt, cuts, {len(prompt)})
    assert tokens == tokenizer.encode(prompt)
    assert tokens.count(tokenizer.token_id("<|im_start|>") or -1) == 2  # never cut apart


def test_metaspace_prefix_only_at_the_start(tmp_path: Path) -> None:
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer = _from_json(_trained(pre, decoders.Metaspace(prepend_scheme="first"), False), tmp_path)
    inc = IncrementalTokenizer(tokenizer)
    state = EMPTY_TAIL
    tokens: list[int] = []
    for piece in ["Hello", ",", "world", " the", "re"]:
        committed, state = inc.feed(state, piece, flush=False)
        tokens += committed
    tokens += inc.feed(state, "", flush=True)[0]
    assert tokens == tokenizer.encode("Hello,world there")
    assert tokenizer.backend.encode("world", add_special_tokens=False).tokens[0].startswith("▁")


@pytest.fixture(scope="module")
def smollm2(smollm2_reader: gguf.GGUFReader) -> Tokenizer:
    """Built from the GGUF's reader (shared by the worker tests: tests/worker/conftest.py)."""
    return tokenizer_from_gguf(smollm2_reader)


@pytest.mark.slow
@CHECKS
@given(case=cut_texts())
def test_gguf_smollm2_cut_anywhere(smollm2: Tokenizer, case: tuple[str, list[int], set[int]]) -> None:
    check_cut_anywhere(smollm2, case)


@pytest.mark.slow
def test_gguf_smollm2_chatml_pieces(smollm2: Tokenizer) -> None:
    """The issue's case: encoded piece by piece the prompt grows; streamed, it is the whole prompt's."""
    prompt = smollm2.chat_prompt("What is the capital of France?")
    whole = smollm2.encode(prompt)
    inc = IncrementalTokenizer(smollm2)
    at_spaces = [i + 1 for i, ch in enumerate(prompt) if ch == " "]  # "What ", "is ", ...
    for cuts in (list(range(9, len(prompt), 9)), at_spaces):
        bounds = [0, *cuts, len(prompt)]
        naive = [t for a, b in itertools.pairwise(bounds) for t in smollm2.encode(prompt[a:b])]
        assert len(naive) > len(whole)
        assert _stream(inc, prompt, cuts, {len(prompt)})[0] == whole
