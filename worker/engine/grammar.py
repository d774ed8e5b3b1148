"""Structured output: `response_format` compiled by xgrammar, and a per-turn matcher masking its tokens.

The pattern of vLLM's and SGLang's xgrammar backends: one `GrammarCompiler` per worker over the
worker's own tokenizer (`tokenizer_info`), a bounded LRU cache of compiled grammars keyed by the
format's canonical text, one `GrammarMatcher` per constrained turn; each step fills the rows of a
batch bitmask for the constrained rows only and applies it to those rows' logits (sampling.py),
and the matcher accepts every sampled token (core.py's postprocess).

Where compiling runs, and why: on one background thread of its own (`Grammars.request` returns a
future at once). Not on the asyncio loop (a new schema can take tens of ms to compile, which would
stall every session's frames) and not on the engine thread (it would stall every session's
step). The chunk is accepted at once with the future; a turn whose grammar is still compiling
waits in its session's queue and the rest of the batch runs on. A cached format costs a dict
lookup. A session's default format is compiled once, before the session opens.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from tokenizers import decoders

from shared.errors import InvalidMessage
from shared.protocol.response_format import ResponseFormat
from worker.tokenizer.tokenizer import Tokenizer

# xgrammar is imported where a grammar is first built or used, never at the module's import: it
# imports transformers (about a second of CPU), which a worker that never meets a response_format
# would pay at every start. A worker whose vocabulary is large imports it at start all the same, on
# the grammar thread (`Grammars.prepare`); a small one (`tiny`'s) at its first grammar.
if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Distinct formats kept compiled per worker; the least recently used beyond it is dropped.
GRAMMAR_CACHE_SIZE = 64
# The smallest vocabulary whose compiler `prepare` builds ahead. The tokenizer info costs about 3 us
# a token with the GIL held (0.15 s for SmolLM2's 49 152 tokens): worth building before the first
# constrained chunk waits on it. Below this (a byte-level tokenizer of a few hundred tokens) it is
# instant on demand, and building it ahead would only import xgrammar and transformers, about a
# second of CPU at every start, for a grammar that may never come.
PREPARE_MIN_VOCAB = 4096


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the worker's tokenizer: each id's token text (as the tokenizer stores it;
    xgrammar decodes byte-level and byte-fallback forms itself), with special tokens (control
    tokens such as `<|im_end|>`) as empty strings so no grammar ever emits them as text, and the
    EOS ids as the stop tokens. `vocab_size` is the model's (the logits' width): ids past the
    tokenizer's vocabulary are masked out of every constrained row."""
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * tokenizer.vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        encoded[index] = token
    for index, added in backend.get_added_tokens_decoder().items():
        if added.special:
            encoded[index] = ""
    return xgr.TokenizerInfo(
        encoded,
        _vocab_type(backend.decoder),
        vocab_size=vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids),
        add_prefix_space=False,
    )


def _vocab_type(decoder: decoders.Decoder | None) -> xgr.VocabType:
    """How the vocabulary's token strings encode bytes, read off the tokenizer's decoder."""
    import xgrammar as xgr

    if isinstance(decoder, decoders.ByteLevel):
        return xgr.VocabType.BYTE_LEVEL
    if decoder is not None and "ByteFallback" in json.dumps(json.loads(decoder.__getstate__())):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def compile_format(compiler: xgr.GrammarCompiler, fmt: ResponseFormat) -> xgr.CompiledGrammar:
    """The compiled grammar of `fmt`; what xgrammar refuses is `InvalidMessage` with its message."""
    try:
        if fmt.type == "json_schema":
            return compiler.compile_json_schema(json.dumps(fmt.schema), any_whitespace=False)
        if fmt.type == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(fmt.tag))
        if fmt.type == "regex":
            assert fmt.pattern is not None
            return compiler.compile_regex(fmt.pattern)
        assert fmt.choices is not None
        # One EBNF string literal per choice (JSON's escapes are EBNF's).
        rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in fmt.choices)
        return compiler.compile_grammar(f"root ::= {rule}")
    except (RuntimeError, ValueError) as error:
        detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        # xgrammar prefixes its messages with a timestamp and a source location: keep the reason.
        reason = detail.split(": ", 1)[-1] if ".cc:" in detail else detail
        # A structural tag's refusal comes as a failed check: keep what it says after it.
        reason = reason.split(" is false: ", 1)[-1]
        raise InvalidMessage(f"response_format rejected by the grammar library: {reason}") from None


class Grammars:
    """The worker's compiled grammars: a thread-safe LRU of futures, compiled on one thread."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, capacity: int = GRAMMAR_CACHE_SIZE
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None
        # The last compile's milliseconds (what the benchmark reports), and how many ran.
        self.last_compile_ms = 0.0
        self.compiles = 0

    def prepare(self) -> Future[object] | None:
        """Build the compiler now, on the grammar thread (a worker calls it at start, and waits for
        the future before it serves): importing xgrammar (which imports transformers, ~0.7 s of CPU)
        and its tokenizer info (~0.15 s for SmolLM2's 49 152 tokens) hold the GIL, which would
        otherwise stall the asyncio loop and the engine thread at the first constrained chunk, or,
        left to run beside the first sessions, their first chunks. A vocabulary under
        `PREPARE_MIN_VOCAB` is left to its first grammar (None)."""
        if self._tokenizer is None or self._tokenizer.vocab_size < PREPARE_MIN_VOCAB:
            return None
        with self._lock:
            future: Future[object] = self._pool_started().submit(self._ensure_compiler)
        return future

    def request(self, fmt: ResponseFormat) -> Future[xgr.CompiledGrammar]:
        """The grammar of `fmt`: a done future when cached, else one that resolves once compiled
        (to `InvalidMessage` when the library rejects it; a rejected format is not kept)."""
        if self._tokenizer is None:
            raise InvalidMessage("this model has no tokenizer: response_format needs one")
        key = fmt.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool_started().submit(self._compile, fmt)
            self._cache[key] = future
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        return future

    def matcher(self, future: Future[xgr.CompiledGrammar], stop_ids: Sequence[int]) -> xgr.GrammarMatcher:
        """A fresh matcher for one turn (`future` done). The grammar ends with one of the session's
        stop tokens, as an unconstrained turn does; a session with none ends when it is complete."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(
            future.result(),
            override_stop_tokens=list(stop_ids) or None,
            terminate_without_stop_token=not stop_ids,
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _pool_started(self) -> ThreadPoolExecutor:
        """The one grammar thread (call under the lock)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="microturn-grammar")
        return self._pool

    def _ensure_compiler(self) -> xgr.GrammarCompiler:
        """The compiler (grammar thread only): built by `prepare`, or by the first compile."""
        import xgrammar as xgr

        if self._compiler is None:
            assert self._tokenizer is not None
            info = tokenizer_info(self._tokenizer, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, fmt: ResponseFormat) -> xgr.CompiledGrammar:
        compiler = self._ensure_compiler()
        started = time.perf_counter()
        compiled = compile_format(compiler, fmt)
        self.last_compile_ms = (time.perf_counter() - started) * 1000.0
        self.compiles += 1
        logger.info("compiled a %s response_format in %.1f ms", fmt.type, self.last_compile_ms)
        return compiled

    def _forget_failed(self, key: str, future: Future[xgr.CompiledGrammar]) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]


def apply_masks(logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
    """Mask the rows of `logits` [rows, vocab] that have a matcher to the tokens their grammar
    allows next (-inf elsewhere, the vocabulary's tail included); other rows are left untouched."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    import xgrammar as xgr  # loaded already: a matcher exists

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for row in rows:
        matcher = matchers[row]
        assert matcher is not None
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
