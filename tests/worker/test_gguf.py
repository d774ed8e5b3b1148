"""GGUF loading: the SmolLM2 file against transformers' own GGUF loader, and tiny files written here.

transformers' GGUF tokenizer ignores `tokenizer.ggml.pre == "smollm"`: it lacks the Digits
pre-tokenizer of SmolLM2's tokenizer.json, so whitespace directly before a digit tokenizes
differently there ("x   1": transformers gives x|ĠĠ|Ġ|1, SmolLM2 and llama.cpp give x|ĠĠĠ|1).
Those strings are checked against llama.cpp's own split regexes instead.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import regex
import torch

from worker.attention import AttentionMetadata, TorchAttention
from worker.attention.kv_pool import KVPool
from worker.model.embedding import FloatEmbedding
from worker.model.linear import FloatLinear
from worker.model.llama import LlamaModel
from worker.model.loader import LoadedModel
from worker.model.loader_gguf import config_from_gguf, llama3_scaling_from_divisors, load_gguf, unpermute_qk
from worker.model.rope import inverse_frequencies
from worker.model.weights import ModelWeights
from worker.tokenizer.gguf import field_value, tokenizer_from_gguf
from worker.tokenizer.tokenizer import Tokenizer

CPU = torch.device("cpu")

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: each regex splits every piece the previous one left.
_SMOLLM_REGEXES = (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")

PLAIN_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345",
    "abc 2024-06-01 x1y22 3.14159",
    "héllo wörld — naïve café 你好 🙂🚀 👩‍👩‍👧",
    "   leading spaces and trailing   ",
    "line one\nline two\n\n\tindented\r\nend\n",
    "don't I'm they'll we've",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
]
# Whitespace right before a digit: where transformers' GGUF tokenizer is wrong for SmolLM2.
DIGIT_TEXTS = ["x   1", "   12", "a  2b", "price:   42 dollars", "x\n 1", "year 2024", " 7"]


# The shared loads of tests/worker/conftest.py, under this module's names.
@pytest.fixture(scope="module")
def gguf_path(smollm2_path: Path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def reader(smollm2_reader: gguf.GGUFReader) -> gguf.GGUFReader:
    return smollm2_reader


@pytest.fixture(scope="module")
def ours(reader: gguf.GGUFReader) -> Tokenizer:
    return tokenizer_from_gguf(reader)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_smollm2_tokenizer: Any) -> Any:
    return hf_smollm2_tokenizer


@pytest.fixture(scope="module")
def loaded(gguf_path: Path, smollm2_model: LoadedModel) -> LoadedModel:
    return smollm2_model


def _llama_cpp_pieces(text: str) -> list[str]:
    pieces = [text]
    for pattern in _SMOLLM_REGEXES:
        split: list[str] = []
        for piece in pieces:
            # Text between matches stays a piece of its own, as in llama.cpp's unicode_regex_split.
            bounds = sorted({0, len(piece)} | {b for m in regex.finditer(pattern, piece) for b in m.span()})
            split += [piece[a:b] for a, b in itertools.pairwise(bounds) if b > a]
        pieces = split
    return pieces


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_tokenizer_matches_transformers(ours: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text


@pytest.mark.parametrize("text", PLAIN_TEXTS[:-1] + DIGIT_TEXTS)
def test_tokenizer_matches_llama_cpp_pre_tokenizer(ours: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    # Within one llama.cpp piece transformers' byte-level BPE is exact, so it encodes piece by piece.
    expected = [
        i for piece in _llama_cpp_pieces(text) for i in hf_tokenizer.encode(piece, add_special_tokens=False)
    ]
    ids = ours.encode(text)
    assert ids == expected
    assert ours.decode(ids) == text


def test_chatml_special_tokens_encode_whole(ours: Tokenizer, reader: gguf.GGUFReader) -> None:
    ids = ours.encode(ours.chat_prompt("What is the capital of France?"))
    assert (ours.token_id("<|im_start|>"), ours.token_id("<|im_end|>")) == (1, 2)
    im_start, im_end = 1, 2
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1 and ids[0] == im_start
    assert ours.decode(ids, skip_special_tokens=True) == "user\nWhat is the capital of France?\nassistant\n"
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    # `chat_prompt` writes ChatML because that is the template the GGUF ships.
    template = field_value(reader, "tokenizer.chat_template")
    assert template is not None and "<|im_start|>" in template


def test_smollm2_config(reader: gguf.GGUFReader) -> None:
    c = config_from_gguf(reader, {t.name: t for t in reader.tensors}, name="smollm2-135m")
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and not c.attention_bias
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


@pytest.mark.slow
def test_load_model_smollm2(reader: gguf.GGUFReader, loaded: LoadedModel) -> None:
    assert loaded.config == config_from_gguf(reader, {t.name: t for t in reader.tensors}, name="smollm2-135m")
    embed, lm_head = loaded.weights.embed, loaded.weights.lm_head
    assert isinstance(embed, FloatEmbedding) and isinstance(lm_head, FloatLinear)
    assert lm_head.weight is embed.table  # tied: one table
    assert embed.shape == (49152, 576) and embed.table.dtype == torch.float32
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 49152


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path, hf_smollm2: Any) -> Any:
    return hf_smollm2


def _our_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    c = loaded.config
    model = LlamaModel(c, loaded.weights, device=CPU, dtype=torch.float32)
    n, page = len(ids), 16
    pages = (n + page - 1) // page
    pool = KVPool(
        num_layers=c.num_layers, num_pages=pages, page_size=page, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, dtype=torch.float32, device=CPU, layout=TorchAttention.kv_layout,
    )  # fmt: skip
    attention = TorchAttention(pool, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    attention.plan(
        AttentionMetadata(
            qo_indptr=torch.tensor([0, n], dtype=torch.int32),
            kv_page_indptr=torch.tensor([0, pages], dtype=torch.int32),
            kv_page_indices=torch.arange(pages, dtype=torch.int32),
            kv_last_page_len=torch.tensor([n - (pages - 1) * page], dtype=torch.int32),
            positions=torch.arange(n),
            q_lens=(n,),
            kv_lens=(n,),
        )
    )
    return model.logits(model.forward(torch.tensor(ids), torch.arange(n), attention))


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "You are a concise geography tutor. Answer in one word."])
def test_logits_match_transformers(loaded: LoadedModel, hf_model: Any, system: str | None) -> None:
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(
        loaded.tokenizer.chat_prompt("What is the capital of France?", system=system)
    )
    ours = _our_logits(loaded, ids)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == reference.shape == (len(ids), 49152)
    assert (ours - reference).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, 3), 3), w)
    bias = w[:, 0].copy()
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(bias, 3), 3), bias)


def _llama_cpp_rope_factors(
    head_dim: int, theta: float, *, factor: float, low: float, high: float, old: int
) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid)).astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_scaling_recovered_from_rope_freqs(factor: float) -> None:
    divisors = _llama_cpp_rope_factors(128, 500000.0, factor=factor, low=1.0, high=4.0, old=8192).astype(
        np.float64
    )
    scaling = llama3_scaling_from_divisors(divisors, head_dim=128, theta=500000.0, original_context=8192)
    assert scaling is not None
    assert scaling.factor == pytest.approx(factor)
    assert scaling.low_freq_factor == pytest.approx(1.0, rel=1e-3)
    assert scaling.high_freq_factor == pytest.approx(4.0, rel=1e-3)
    rebuilt = inverse_frequencies(128, 500000.0, scaling)
    reference = inverse_frequencies(128, 500000.0, None) / torch.from_numpy(divisors)
    torch.testing.assert_close(rebuilt, reference, rtol=1e-5, atol=0.0)
    assert (
        llama3_scaling_from_divisors(np.ones(64), head_dim=128, theta=500000.0, original_context=8192) is None
    )
    with pytest.raises(ValueError, match="Llama-3"):
        llama3_scaling_from_divisors(
            np.linspace(1.0, 4.0, 64), head_dim=128, theta=500000.0, original_context=8192
        )


# A tiny model written as llama.cpp would write it: q/k permuted (llama only), embedding in Q8_0.
_H, _HEADS, _KV, _HD, _FF, _LAYERS = 64, 4, 2, 16, 128, 2
_SPECIALS = {"<|im_start|>": 3, "<think>": 4}  # token -> llama.cpp token type


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order: the first 256 tokens of a byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    unprintable = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(unprintable)}
    return [char_of[b] for b in range(256)]


def _tiny_state(arch: str, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    state = {"model.embed_tokens.weight": normal(vocab, _H), "model.norm.weight": normal(_H)}
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": normal(_H),
            p + "post_attention_layernorm.weight": normal(_H),
            p + "self_attn.q_proj.weight": normal(_HEADS * _HD, _H),
            p + "self_attn.k_proj.weight": normal(_KV * _HD, _H),
            p + "self_attn.v_proj.weight": normal(_KV * _HD, _H),
            p + "self_attn.o_proj.weight": normal(_H, _HEADS * _HD),
            p + "mlp.gate_proj.weight": normal(_FF, _H),
            p + "mlp.up_proj.weight": normal(_FF, _H),
            p + "mlp.down_proj.weight": normal(_H, _FF),
        }
        if arch == "qwen2":
            for part, rows in (("q", _HEADS), ("k", _KV), ("v", _KV)):
                state[p + f"self_attn.{part}_proj.bias"] = normal(rows * _HD)
    return state


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _write_tiny_gguf(
    path: Path, arch: str, state: dict[str, np.ndarray], tokenizer_model: str = "gpt2"
) -> None:
    tokens = [*_byte_tokens(), "Ġt", *_SPECIALS]
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(_H)
    writer.add_feed_forward_length(_FF)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + list(_SPECIALS.values()))
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(257)
    for name, values in state.items():
        if name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor("token_embd.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", values)
            continue
        _, _, layer, *module, kind = name.split(".")
        stored = values
        if arch == "llama" and module[-1] in ("q_proj", "k_proj"):
            stored = _llama_cpp_permute(values, _HEADS if module[-1] == "q_proj" else _KV)
        writer.add_tensor(f"blk.{layer}.{_GGUF_NAMES['.'.join(module)]}.{kind}", stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    vocab = 256 + 1 + len(_SPECIALS)
    state = _tiny_state(arch, vocab)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(path, arch, state)
    config, weights, tokenizer = load_gguf(path, device=CPU, dtype=torch.float32, name="tiny")

    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        _LAYERS,
        _HEADS,
        _KV,
        _HD,
    )
    assert config.vocab_size == vocab and config.tie_word_embeddings and config.eos_token_ids == (257,)
    assert config.attention_bias == (arch == "qwen2")
    embed = state["model.embed_tokens.weight"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    state["model.embed_tokens.weight"] = gguf.quants.dequantize(gguf.quants.quantize(embed, q8), q8)
    expected = ModelWeights.from_hf_state(
        config, {k: torch.from_numpy(v) for k, v in state.items()}, dtype=torch.float32, device=CPU
    )
    assert isinstance(weights.embed, FloatEmbedding) and isinstance(expected.embed, FloatEmbedding)
    assert torch.equal(weights.embed.table, expected.embed.table)
    assert torch.equal(weights.final_norm, expected.final_norm)
    for got, want in zip(weights.layers, expected.layers, strict=True):
        for field in ("input_norm", "post_attention_norm"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        for field in ("qkv", "o_proj", "gate_up", "down"):
            got_linear, want_linear = getattr(got, field), getattr(want, field)
            assert isinstance(got_linear, FloatLinear) and isinstance(want_linear, FloatLinear)
            assert torch.equal(got_linear.weight, want_linear.weight), field
            assert (got_linear.bias is None) == (want_linear.bias is None)
            assert got_linear.bias is None or torch.equal(got_linear.bias, want_linear.bias)

    ids = tokenizer.encode(" t<think>x<|im_start|>")
    assert ids == [256, 258, tokenizer.token_id("x"), 257]
    assert tokenizer.decode(ids) == " t<think>x<|im_start|>"


def test_unsupported_tokenizer_model_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_tiny_gguf(path, "llama", _tiny_state("llama", 259), tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        load_gguf(path, device=CPU, dtype=torch.float32, name="spm")
