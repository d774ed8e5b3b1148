"""The engine's public API: thread-safe, non-blocking submission into one engine thread.

Callers on any thread enqueue commands; the engine thread drains them between forward steps, so
`EngineCore` never needs a lock. Results come back as `concurrent.futures.Future`s (asyncio code
wraps them with `asyncio.wrap_future`) and per-token callbacks, both invoked on the engine thread:
listeners must only hand the value over, never block.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Final, TypeVar

import torch

from shared.errors import ChunkTooLarge, InvalidMessage, MicroturnError, TokenOutOfRange
from shared.protocol.codec import config_from_map, response_format_from_map
from shared.protocol.fields import is_valid_text
from shared.protocol.kv_copy import KVFormat
from shared.protocol.link_codec import to_wire
from shared.protocol.messages import OpenConfig
from shared.protocol.response_format import ResponseFormat
from worker.attention import BackendRefused
from worker.attention.kv_dtype import AUTO, KVForm, choose_kv_form
from worker.dtypes import torch_dtype
from worker.engine.config import EngineConfig
from worker.engine.core import CloseListener, EngineCore, EngineStats
from worker.engine.grammar import Grammars
from worker.engine.memory.kv_transfer import KVExport, model_fingerprint
from worker.engine.memory.sizing import device_pages, host_pages
from worker.engine.memory.window import resolve_prefix, session_limit
from worker.engine.model_runner import ModelRunner
from worker.engine.rewind import RewindTarget, Rewound
from worker.engine.session_rules import SessionRules
from worker.engine.turn import TokenListener, Turn, TurnResult
from worker.model.loader import LoadedModel, load_model
from worker.tokenizer.incremental import EMPTY_TAIL, IncrementalTokenizer, TextTail
from worker.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Text longer than this many characters per allowed token could not fit a chunk: refused before
# tokenizing (which is the cost being bounded). The exact token count is checked on commit.
MAX_CHARS_PER_TOKEN = 32


# What `EngineConfig` and `Engine.from_config` raise for settings this machine or model cannot serve
# (a refused value, a device torch has not, a missing model, a weight form with no kernel for the
# file's types, an attention backend that failed its check): the commands that start an engine say
# the reason and exit `EXIT_REFUSED` (shared/settings.py) on these, with no traceback.
START_REFUSALS: Final = (ValueError, FileNotFoundError)


def _usable_device(name: str) -> torch.device:
    """`--device` as torch's device, refused (ValueError, before anything loads) where this torch
    cannot run it: a name torch does not know, or CUDA with no device (a CPU build of torch
    otherwise fails deep in the load, naming its own libraries)."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; use cpu")
    return device


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        device = torch.device(config.device)
        dtype = torch_dtype(config.dtype)
        kv_form = choose_kv_form(
            config.kv_dtype,
            device=device,
            dtype=dtype,
            weight_form=loaded.weights.form,
            attention=config.attention,
            page_size=config.page_size,
        )

        def runner_for(form: KVForm) -> ModelRunner:
            return ModelRunner(
                loaded,
                device=device,
                dtype=dtype,
                kv_form=form,
                num_pages=device_pages(config, loaded.config, device, form.dtype),
                page_size=config.page_size,
                attention=config.attention,
                single_thread_max_tokens=config.cpu_single_thread_max_tokens,
            )

        try:
            runner = runner_for(kv_form)
        except BackendRefused as refused:
            # `auto` chose int8 rows because the cpu kernel runs here; where it then fails its start-up
            # check, only the torch reference is left, which reads float pools: float16, as before the
            # int8 forms existed (an explicit --kv-dtype int8 or int8-keys stops the worker instead).
            if config.kv_dtype != AUTO or not kv_form.int8_keys:
                raise
            logger.warning("--kv-dtype auto: %s; the KV pool holds float16 instead", refused)
            kv_form = KVForm(torch.float16)
            runner = runner_for(kv_form)
        eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer and loaded.tokenizer.eos_token_ids else ()
        self._core = EngineCore(
            config,
            runner,
            loaded.tokenizer,
            eos_token_ids=eos or loaded.config.eos_token_ids,
            host_pages=host_pages(
                config, loaded.config, kv_form.dtype, pending_bytes=runner.kv_pool.pending_bytes
            ),
        )
        pool = runner.kv_pool
        # What this worker's KV pages mean: another worker takes them only when its own is equal.
        self.kv_format = KVFormat(
            model=model_fingerprint(loaded.config, loaded.weights, type(runner.model.row_ops).__name__),
            dtype=kv_form.name,
            page_size=pool.page_size,
            layout=pool.layout,
            page_bytes=pool.page_bytes,
        )
        self._inbox: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="microturn-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str, **options: Any) -> Engine:
        """An engine for `model`; `options` are `EngineConfig` fields (the rest: the worker's defaults)."""
        return cls.from_config(EngineConfig(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        device = _usable_device(config.device)

        def build() -> Engine:
            loaded = load_model(
                config.model,
                device=device,
                dtype=torch_dtype(config.dtype),
                seed=config.seed,
                weights=config.weights,
            )
            return cls(config, loaded)

        return _on_own_thread(build)

    @property
    def attention_backend(self) -> str:
        return self._core.runner.attention_name

    @property
    def weight_bytes_per_step(self) -> int:
        """What one forward step reads of the weights (see `ModelWeights.bytes_read_per_step`)."""
        return self._core.runner.model.weights.bytes_read_per_step()

    @property
    def text(self) -> IncrementalTokenizer | None:
        """The exact incremental tokenizer admission runs (None: the model has no tokenizer)."""
        return self._core.text

    @property
    def context_limit(self) -> int:
        return self._core.context_limit

    def session_rules(self, config: OpenConfig) -> SessionRules:
        """The rules this engine runs a session of `config` by (its system prompt resolved, its
        window's limit, its tokenizer), for a worker that replays its turns (a restore, a copy).
        Raises the typed error an open with `config` would."""
        resolved, prefix = resolve_prefix(config, self.text)
        return SessionRules(resolved, session_limit(resolved, self.context_limit), self.text, tuple(prefix))

    @property
    def grammars(self) -> Grammars:
        """The worker's compiled structured-output grammars (worker/engine/grammar.py)."""
        return self._core.grammars

    def compile_format(self, response_format: ResponseFormat | dict[str, object]) -> Future[Any]:
        """Compile a `response_format` ahead of its first turn (checked as a client's is); the
        future resolves to its grammar, or to `InvalidMessage` when the library rejects it."""
        grammar = self._grammar(response_format)
        assert grammar is not None
        return grammar

    # ---- sessions -----------------------------------------------------------------------------

    def open_session_async(
        self,
        *,
        session_id: str | None = None,
        history: Sequence[int] = (),
        accepted_seq: int | None = None,
        text_tail: TextTail = EMPTY_TAIL,
        config: OpenConfig | None = None,
        adopt: bool = False,
        turn_ends: Sequence[tuple[int, int, int, TextTail]] = (),
        **options: Any,
    ) -> tuple[str, Future[str]]:
        """Open a session with `config`, or with `options` given by hand (tests, the bench, the console).

        `config` has been validated where it entered (the client codec, or the session record read
        back from Redis); hand-given `options` enter here, so the same rules check them. `adopt`
        takes over a warm copy of the session (`warm_async`) whose tokens begin `history`.
        `turn_ends`: (seq, outputs_start, end) of the turns `history` holds, which a rewind may go
        back to (worker/engine/turn_ends.py; a restore reads them from the log).
        """
        if config is None:
            config = config_from_map(options, "session options")
        elif options:
            raise TypeError("give either a config or options, not both")
        if config.stop_token_ids is not None:  # within the model's vocabulary, not just uint32
            config = replace(config, stop_token_ids=tuple(self._check_tokens(config.stop_token_ids)))
        history_tokens = self._check_tokens(history)
        sid = session_id or uuid.uuid4().hex
        grammar = self._grammar(config.response_format)

        def open_it() -> str:
            self._core.open_session(
                sid,
                config,
                history_tokens,
                accepted_seq,
                text_tail,
                adopt=adopt,
                grammar=grammar,
                turn_ends=turn_ends,
            )
            return sid

        if grammar is None:
            return sid, self._call(open_it)
        # The session's default grammar is compiled before it opens, so a rejected one refuses
        # the open (nothing was made) and no turn of the session waits for it.
        opened: Future[str] = Future()
        opened.set_running_or_notify_cancel()

        def compiled(done: Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                opened.set_exception(error)
                return
            inner = self._call(open_it)
            inner.add_done_callback(lambda f: _chain(f, opened))

        grammar.add_done_callback(compiled)
        return sid, opened

    def warm_async(
        self,
        session_id: str,
        *,
        config: OpenConfig,
        history: Sequence[int],
        accepted_seq: int | None = None,
        text_tail: TextTail = EMPTY_TAIL,
        extend: bool = False,
    ) -> Future[TurnResult]:
        """Open a copy of a session and compute its history's KV in the background class of the
        schedule (client turns first, then `max_warm_piece_tokens` a step; scheduler.py): the
        future resolves when the copy is current up to `history`. With `extend`, an idle copy
        already here whose tokens begin `history` keeps its KV and only the rest is prefilled (a
        copy catching up on the turns served since it was asked for; any other is replaced). A
        later `open_session_async(adopt=True)` with a longer history takes it over the same way
        and makes it the live session (a make-before-break handover)."""
        history_tokens = self._check_tokens(history)
        future: Future[TurnResult] = Future()
        future.set_running_or_notify_cancel()

        grammar = self._grammar(config.response_format)

        def warm_it() -> None:
            self._core.open_session(
                session_id, config, history_tokens, accepted_seq, text_tail, adopt=extend, grammar=grammar
            )
            turn = Turn(
                seq=-1 if accepted_seq is None else accepted_seq,
                input_tokens=[],
                max_output_tokens=0,
                logprobs=False,
                future=future,
                on_token=None,
                submitted_at=time.monotonic(),
            )
            self._core.warm(session_id, turn)

        self._enqueue(warm_it, future)
        return future

    def export_kv(self, session_id: str) -> Future[KVExport]:
        """A copy of the session's KV as whole pages (worker/engine/memory/kv_transfer.py), for the
        worker a drain moves it to; the session is served on meanwhile."""

        def export() -> KVExport:
            return self._core.kv.export_kv(self._core._get(session_id), self._core.runner.kv_pool)

        return self._call(export)

    def import_copy(
        self,
        session_id: str,
        *,
        config: OpenConfig,
        history: Sequence[int],
        accepted_seq: int | None,
        text_tail: TextTail,
        kv_tokens: Sequence[int],
        kv: torch.Tensor,
    ) -> Future[int]:
        """Open a copy of another worker's session (as `warm_async` does) holding the KV that came
        from there: `kv` (page-major, `kv_format`'s pages) covers `kv_tokens`, of which the prefix
        that `history` begins with is kept; the future gives its length. A later
        `warm_async(extend=True)` prefills only the rest. `CapacityExhausted` when no tier has room."""
        history_tokens = self._check_tokens(history)

        def import_it() -> int:
            core = self._core
            core.open_session(session_id, config, history_tokens, accepted_seq, text_tail)
            session = core.sessions[session_id]
            kept = 0
            for ours, theirs in zip(session.tokens, kv_tokens, strict=False):
                if ours != theirs:
                    break
                kept += 1
            try:
                core.kv.import_kv(session, kv, kept, core.runner.kv_pool)
            except (MicroturnError, ValueError):
                del core.sessions[session_id]  # no page, no turn yet: nothing else to undo
                raise
            return kept

        return self._call(import_it)

    def open_session(
        self,
        *,
        session_id: str | None = None,
        history: Sequence[int] = (),
        text_tail: TextTail = EMPTY_TAIL,
        config: OpenConfig | None = None,
        **options: Any,
    ) -> str:
        """Open a session (optionally rebuilt from a token history and the text its old worker held
        back, `text_tail`) and return its id."""
        _sid, future = self.open_session_async(
            session_id=session_id, history=history, text_tail=text_tail, config=config, **options
        )
        return future.result()

    def submit(
        self,
        session_id: str,
        *,
        tokens: Sequence[int] | None = None,
        text: str | None = None,
        seq: int | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        flush: bool = False,
        on_token: TokenListener | None = None,
        response_format: ResponseFormat | dict[str, object] | None = None,
    ) -> Future[TurnResult]:
        """Queue one chunk; never blocks. Typed errors come back through the future.

        Stateless checks (token range, chunk size) raise here at once; the checks that need the
        session (seq, backpressure, context) run on the engine thread, before anything is appended.
        Text is tokenized there too, against the session's held-back text tail: a text chunk
        commits only the tokens no later text can change, unless it asks for output or `flush`es
        (see worker/tokenizer/incremental.py); `TurnResult.inputs` says what it committed.
        `response_format` constrains the turn's output (worker/engine/grammar.py; None: the
        session's default); its grammar compiles off this thread and the turn waits for it.
        """
        chunk = self._chunk_tokens(tokens, text)
        if not isinstance(flush, bool):
            raise InvalidMessage("flush must be a boolean")
        if max_output_tokens is not None and not 0 <= max_output_tokens <= self.config.max_output_tokens:
            raise InvalidMessage(f"max_output_tokens must be within 0..{self.config.max_output_tokens}")
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
            raise InvalidMessage("seq must be an integer")
        grammar = self._grammar(response_format)
        future: Future[TurnResult] = Future()
        future.set_running_or_notify_cancel()  # a turn in flight cannot be withdrawn; use cancel()

        def accept() -> None:
            session = self._core.sessions.get(session_id)
            session_config = session.config if session is not None else OpenConfig()
            turn = Turn(
                seq=seq if seq is not None else self._core.next_seq(session_id),
                input_tokens=chunk,
                max_output_tokens=session_config.max_output_tokens
                if max_output_tokens is None
                else max_output_tokens,
                logprobs=session_config.logprobs if logprobs is None else logprobs,
                future=future,
                on_token=on_token,
                submitted_at=time.monotonic(),
                text=text,
                flush=flush,
                grammar=grammar,
            )
            self._core.submit(session_id, turn)

        self._enqueue(accept, future)
        return future

    def run_turn(self, session_id: str, *, timeout: float | None = None, **chunk: Any) -> TurnResult:
        """Submit one chunk and wait for its result (see `submit` for the arguments)."""
        return self.submit(session_id, **chunk).result(timeout)

    def cancel(self, session_id: str, seq: int | None = None) -> Future[None]:
        """Stop the turn `seq` (or every turn of the session): its result has finish='cancelled'."""
        return self._call(lambda: self._core.cancel(session_id, seq))

    def rewind(self, session_id: str, target: RewindTarget) -> Future[Rewound]:
        """Take the session's history back (worker/engine/rewind.py); resolves to its new length
        and held-back text.
        Its running and queued turns end `cancelled` first; bad targets fail with `InvalidMessage`
        having changed nothing."""
        return self._call(lambda: self._core.rewind(session_id, target))

    def close_session(self, session_id: str, reason: str = "closed") -> None:
        self._call(lambda: self._core.close(session_id, reason)).result()

    def close_session_async(self, session_id: str, reason: str = "closed") -> Future[None]:
        return self._call(lambda: self._core.close(session_id, reason))

    def add_close_listener(self, listener: CloseListener) -> None:
        """`listener(session_id, reason)` runs on the engine thread whenever a session ends."""
        self._call(lambda: self._core.close_listeners.append(listener)).result()

    def name_prefix(self, name: str, tokens: Sequence[int]) -> Future[None]:
        """Sessions open with the prefix `name` (shared/store/prefix_label.py), whose tokens are
        `tokens`: while its pages are cached, `stats()` names it among the held prefixes."""
        prefix = list(tokens)
        return self._call(lambda: self._core.kv.name_prefix(name, prefix))

    def stats(self) -> EngineStats:
        return self._call(self._core.stats).result()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join()
        self._core.runner.close()
        self._core.grammars.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------

    def _grammar(self, fmt: ResponseFormat | dict[str, object] | None) -> Future[Any] | None:
        """The grammar of a format (checked again by the codec's rules: one given by hand enters
        here), compiling or compiled; its end wakes the engine thread, where a turn waits for it."""
        if fmt is None:
            return None
        checked = response_format_from_map(to_wire(fmt) if isinstance(fmt, ResponseFormat) else fmt)
        grammar = self._core.grammars.request(checked)
        if not grammar.done():
            grammar.add_done_callback(lambda _done: self._wakeup.set())
        return grammar

    def _chunk_tokens(self, tokens: Sequence[int] | None, text: str | None) -> list[int]:
        """A token chunk's checked tokens; [] for text, which the engine thread tokenizes."""
        if (tokens is None) == (text is None):
            raise InvalidMessage("a chunk carries exactly one of `tokens` or `text`")
        if text is not None:
            if not isinstance(text, str) or not is_valid_text(text):
                raise InvalidMessage("text must be a string of valid Unicode (no lone surrogates)")
            if self.tokenizer is None:
                raise InvalidMessage("this model has no tokenizer: send tokens")
            if len(text) > self.config.max_chunk_tokens * MAX_CHARS_PER_TOKEN:
                raise ChunkTooLarge(f"text of {len(text)} characters is too long for one chunk")
            return []
        assert tokens is not None
        chunk = self._check_tokens(tokens)
        if len(chunk) > self.config.max_chunk_tokens:
            raise ChunkTooLarge(
                f"chunk of {len(chunk)} tokens exceeds the limit of {self.config.max_chunk_tokens}"
            )
        return chunk

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
            raise InvalidMessage("tokens must be a list of integers")
        vocab = self.model_config.vocab_size
        for token in tokens:
            if not isinstance(token, int) or isinstance(token, bool):
                raise InvalidMessage("tokens must be a list of integers")
            if not 0 <= token < vocab:
                raise TokenOutOfRange(f"token {token} is outside the vocabulary [0, {vocab})")
        return list(tokens)

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            future.set_result(fn())

        self._enqueue(run, future)
        return future

    def _enqueue(self, command: Callable[[], None], future: Future[Any]) -> None:
        if self._stopping:
            raise RuntimeError("the engine is shut down")

        def guarded() -> None:
            try:
                command()
            except MicroturnError as error:
                future.set_exception(error)
            except Exception as error:
                logger.exception("engine command failed")
                future.set_exception(error)

        self._inbox.append(guarded)
        self._wakeup.set()

    def _run(self) -> None:
        core = self._core
        next_expiry = 0.0
        while not self._stopping:
            while self._inbox:
                self._inbox.popleft()()
            now = time.monotonic()
            if now >= next_expiry:
                soonest = core.expire_idle()
                # Checking every few tens of ms bounds the lateness of an expiry without a per-step scan.
                next_expiry = now + min(max(soonest if soonest is not None else 1.0, 0.02), 1.0)
            try:
                ran = core.step()
            except Exception:
                logger.exception("engine step crashed; the loop carries on")
                ran = False
            if not ran and not self._inbox:
                self._wakeup.wait(max(next_expiry - time.monotonic(), 0.001))
                self._wakeup.clear()
        while self._inbox:
            self._inbox.popleft()()
        # Nothing is left hanging: every open session ends, resolving its turns as cancelled.
        for session_id in list(core.sessions):
            core.close(session_id, "closed")
        logger.info("engine thread stopped")


def _on_own_thread(build: Callable[[], T]) -> T:
    """`build()` on a thread of its own, which ends with it.

    Why: on the CPU, libgomp (the OpenMP runtime behind torch's intra-op threads and the C kernels)
    keeps a pool of worker threads for every thread that ever ran a parallel region, for as long as
    that thread lives; once the process holds more of them than there are cores, it makes waiting
    workers sleep at once instead of spinning, so every parallel region of the engine thread then
    pays a wake-up. Loaded by the caller's thread on 2 threads, SmolLM2's decode step on 2 threads
    took 36-58 ms, against 18-21 when the loading thread had ended (2 cores, 2026-11-27). Loading on
    a thread that ends leaves the engine thread's pool the only one.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="microturn-load") as loader:
        return loader.submit(build).result()


def _chain(source: Future[T], target: Future[T]) -> None:
    """Resolve `target` as `source` resolved."""
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
