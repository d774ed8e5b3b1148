"""Rebuild a `tokenizers` tokenizer from the vocabulary a GGUF file carries in its metadata.

A GGUF has no `tokenizer.json`: llama.cpp stores the tokens, merges, token types and special ids
under `tokenizer.ggml.*`, plus the name of the pre-tokenizer (`tokenizer.ggml.pre`) the vocabulary
was trained with. Only the name is stored, not the regex, so each supported name is mapped here to
the pre-tokenizer of the model's original `tokenizer.json`. Getting that wrong does not fail loudly;
it silently produces different (worse) token ids, which is why unknown names are rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from shared.chat_template import ChatTemplate
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's `llama_token_type`; only these two are matched whole in raw text.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The split regexes of the original tokenizer.json files (HF's Llama-3 and Qwen2 tokenizers).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: `\p{N}` then the GPT-2 regex; HF: Digits(individual) then ByteLevel's GPT-2 regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# `tokenizer.ggml.pre` -> (pre-tokenizer, NFC normaliser?, BPE ignore_merges?), as the HF originals set them.
_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool, bool]] = {
    "gpt-2": (_gpt2_pre, False, False),
    "smollm": (_digits_then_gpt2_pre, False, False),
    "starcoder": (_digits_then_gpt2_pre, False, False),
    "refact": (_digits_then_gpt2_pre, False, False),
    "llama-bpe": (_split_pre(_LLAMA3_SPLIT), False, True),
    "llama3": (_split_pre(_LLAMA3_SPLIT), False, True),
    "qwen2": (_split_pre(_QWEN2_SPLIT), True, False),
    "deepseek-r1-qwen": (_split_pre(_QWEN2_SPLIT), True, False),
}


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """The decoded value of a metadata key (str, number, bool or list), or None if absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def special_token_ids(reader: gguf.GGUFReader) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, eos ids): Llama-3 files also mark end-of-turn/end-of-message tokens, which end a reply too."""
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    return (None if bos is None else int(bos)), tuple(eos)


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    model_type = field_value(reader, "tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {model_type!r}: only byte-level BPE ('gpt2') is supported"
        )
    # No default: llama.cpp falls back to a generic split for a missing name, which mis-tokenizes silently.
    pre_name = field_value(reader, "tokenizer.ggml.pre")
    if pre_name not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre_name!r}; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    build_pre, nfc, ignore_merges = _PRE_TOKENIZERS[pre_name]

    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    merges_text: list[str] | None = field_value(reader, "tokenizer.ggml.merges")
    if not tokens or not merges_text:
        raise ValueError("GGUF byte-level tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")

    # Byte-level spelling never contains a plain space, so each merge splits at exactly one space.
    merges: list[tuple[str, str]] = []
    for merge in merges_text:
        left, space, right = merge.partition(" ")
        if not space:
            raise ValueError(f"malformed entry {merge!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"GGUF vocabulary has {len(tokens) - len(vocab)} duplicate token strings")

    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = build_pre()
    backend.decoder = decoders.ByteLevel()

    # Control and user-defined tokens are written in text as themselves (not byte-spelled) and must
    # match whole before pre-tokenisation; each keeps its vocabulary id because it is already in `vocab`.
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("added tokens did not map onto the GGUF vocabulary ids")

    bos, eos = special_token_ids(reader)
    logger.info(
        "GGUF tokenizer: %d tokens, %d merges, pre=%s, %d special, %d user-defined",
        len(tokens),
        len(merges),
        pre_name,
        len(special),
        len(user_defined),
    )
    source = field_value(reader, "tokenizer.chat_template")
    template = None
    if isinstance(source, str) and source:
        eos_text = tokens[eos[0]] if eos else ""
        template = ChatTemplate(source, tokens[bos] if bos is not None else "", eos_text)
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=bos, chat_template=template)
