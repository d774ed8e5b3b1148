"""Text <-> token ids through the `tokenizers` library; special tokens written in text are recognised."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from shared.chat_template import ChatTemplate


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        # The model's own chat template (GGUF metadata or tokenizer_config.json); None when it has none.
        self.chat_template = chat_template

    @classmethod
    def from_file(
        cls, path: str | Path, *, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
    ) -> Tokenizer:
        return cls(
            tokenizers.Tokenizer.from_file(str(path)), eos_token_ids=eos_token_ids, bos_token_id=bos_token_id
        )

    @classmethod
    def byte_level(
        cls, vocab_size: int, special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    ) -> Tokenizer:
        """A merge-free byte-level BPE: 256 byte tokens, then the special tokens (random-weight presets)."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_tokens = sorted(alphabet, key=lambda ch: _BYTE_OF_CHAR[ch])
        vocab = {token: i for i, token in enumerate(byte_tokens)}
        if len(vocab) + len(special_tokens) > vocab_size:
            raise ValueError(f"vocab of {vocab_size} is too small for a byte-level tokenizer")
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        # Without merges the ids are the text's bytes whatever the split; GPT-2's word split only keeps
        # the incremental tokenizer's held-back tail (its last word) short.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(list(special_tokens))
        eos = backend.token_to_id(special_tokens[0])
        assert eos is not None
        return cls(backend, eos_token_ids=(int(eos),))

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """The ChatML prompt SmolLM2 and Qwen2 are tuned on, ending where the assistant's answer starts."""
        parts = []
        if system is not None:
            parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        parts.append(f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n")
        return "".join(parts)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, as the ByteLevel pre-tokenizer uses it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = _bytes_to_unicode()
