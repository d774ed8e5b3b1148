"""The engine's state machine: sessions, admission, one step, postprocess. Runs on the engine thread only.

Every public method either raises a typed error having changed nothing, or applies its change in
full. Turn lifecycle: `submit` validates and queues it; `_activate` reserves the pages for its
whole turn (input plus outputs), appends its input and makes it the session's active turn; steps
feed its tokens and sample; `_finish` resolves its future. Consecutive queued no-output chunks are
folded into the next activation, so a session that fell behind catches up in one append.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import (
    CapacityExhausted,
    InternalError,
    InvalidMessage,
    MicroturnError,
    SessionNotFound,
)
from shared.protocol.messages import FinishReason, OpenConfig
from shared.store.log_format import Cut
from worker.engine.admission import admit
from worker.engine.config import EngineConfig
from worker.engine.grammar import Grammars
from worker.engine.memory.manager import CAPACITY_RETRY_MS, KVManager, MemoryStats
from worker.engine.memory.prefix_cache import prefix_cache
from worker.engine.memory.window import cut_before, opening_history, session_limit
from worker.engine.model_runner import ForwardRow, ModelRunner, SampledToken
from worker.engine.rewind import RewindTarget, Rewound, ToTurn, rewind_length
from worker.engine.scheduler import ScheduledBatch, Scheduler
from worker.engine.session import Session
from worker.engine.turn import Turn
from worker.tokenizer.incremental import EMPTY_TAIL, IncrementalTokenizer, TextTail
from worker.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:  # annotations only: worker/engine/grammar.py imports xgrammar at the first grammar
    from xgrammar import CompiledGrammar

logger = logging.getLogger(__name__)

CloseListener = Callable[[str, str], None]


@dataclass(frozen=True)
class EngineStats:
    """What the engine reports about itself (`Engine.stats()`, the worker's `/metrics` and `/v1/stats`)."""

    sessions: int
    active_sessions: int
    queued_turns: int
    pages_total: int
    pages_used: int
    pages_free: int
    page_size: int
    kv_tokens_total: int
    kv_tokens_free: int
    steps: int
    turns_completed: int
    tokens_forwarded: int
    # KV dropped under pressure (the host tier was full too, or off): `memory.drops`.
    kv_evictions: int
    # The attention backend the model runner chose at start (`torch` or `flashinfer`).
    attention_backend: str
    # Both KV tiers: pages, offloads and restores (count, bytes, seconds), recomputes.
    memory: MemoryStats


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        *,
        eos_token_ids: tuple[int, ...],
        host_pages: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.text = IncrementalTokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.vocab_size = runner.config.vocab_size
        self.page_size = runner.page_size
        self.sessions: dict[str, Session] = {}
        # The one owner of KV memory: both tiers, windows, eviction, the prefix cache (worker/engine/memory/).
        self.kv = KVManager(runner.kv_pool, host_pages, self.sessions, prefix_cache(config, self.page_size))
        # Structured output: compiled grammars, shared by every session (worker/engine/grammar.py).
        self.grammars = Grammars(tokenizer, runner.config.vocab_size)
        self.scheduler = Scheduler(
            max_batch_tokens=config.max_batch_tokens,
            max_batch_rows=config.max_batch_rows,
            max_append_piece=config.max_append_piece_tokens,
            max_background_piece=config.max_warm_piece_tokens,
            piggyback=runner.device.type != "cpu",
        )
        # The longest sequence a session may reach: the model's context, and never more than the pool.
        self.context_limit = min(
            runner.config.max_position_embeddings, self.kv.device.num_pages * self.page_size
        )
        self.running: dict[str, Session] = {}  # sessions with an active turn, in activation order
        self.waiting: dict[str, Session] = {}  # sessions with pending turns and no active one
        self.close_listeners: list[CloseListener] = []
        self.steps = 0
        self.turns_completed = 0
        self.tokens_forwarded = 0

    # ---- intake -------------------------------------------------------------------------------

    def open_session(
        self,
        session_id: str,
        config: OpenConfig,
        history: list[int],
        accepted_seq: int | None = None,
        text_tail: TextTail = EMPTY_TAIL,
        *,
        adopt: bool = False,
        grammar: Future[CompiledGrammar] | None = None,
        turn_ends: Sequence[tuple[int, int, int, TextTail]] = (),
    ) -> None:
        """Open a session with `history`. With `adopt`, a session of that id already here (a copy
        warmed before a handover, `warm`) is taken over when its tokens begin `history` and its
        config is the same: it keeps its KV, as far as its warm-up got, and only the rest of
        `history` is prefilled; any other copy is discarded first."""
        existing = self.sessions.get(session_id)
        if existing is not None and adopt:
            context_limit = session_limit(config, self.context_limit)
            window = opening_history(history, config, context_limit)
            if self._adopt(existing, config, window, accepted_seq, text_tail):
                _seed_ends(existing, turn_ends, len(history))
                return
            self._remove(existing)
        if session_id in self.sessions:
            raise InvalidMessage(f"session {session_id} already exists")
        if len(self.sessions) >= self.config.max_sessions:
            raise CapacityExhausted(
                f"worker carries its maximum of {self.config.max_sessions} sessions",
                retry_after_ms=CAPACITY_RETRY_MS,
            )
        context_limit = session_limit(config, self.context_limit)
        given = len(history)
        history = opening_history(history, config, context_limit)
        session = self.sessions[session_id] = Session(
            session_id,
            config,
            history=history,
            now=self.clock(),
            seed=config.seed,
            context_limit=context_limit,
            accepted_seq=accepted_seq,
            tail=text_tail,
            grammar=grammar,
        )
        _seed_ends(session, turn_ends, given)

    def warm(self, session_id: str, turn: Turn) -> None:
        """Compute the KV of the session's whole history now, in the background class of the
        schedule (worker/engine/scheduler.py): `turn` (no input, no output) resolves when it is in.
        A warm copy is what a draining worker's session is rebuilt into before the switch."""
        session = self._get(session_id)
        if session.is_busy:
            raise InvalidMessage(f"session {session_id} is busy: only an idle session is warmed")
        turn.background = True
        session.pending.append(turn)
        self.waiting[session_id] = session

    def submit(self, session_id: str, turn: Turn) -> None:
        """Validate, tokenize and queue `turn`; raises having changed nothing, or accepts it whole."""
        session = self._get(session_id)
        if turn.grammar is None:
            turn.grammar = session.grammar
        # A grammar already known bad refuses the chunk now; one still compiling is checked at
        # activation (`_activate`). Inline, not `Turn.grammar_error`: the chunk's path stays short.
        grammar = turn.grammar
        failed = grammar.exception() if grammar is not None and grammar.done() else None
        if failed is not None:
            raise failed if isinstance(failed, MicroturnError) else InternalError("grammar compile failed")
        tokens, tail = admit(session, turn, self.text, self.config)
        turn.before = (session.accepted_seq, session.tail)
        turn.input_tokens = tokens
        turn.tail_after = tail
        session.accepted_seq = turn.seq
        session.tail = tail
        session.last_activity = self.clock()
        session.pending.append(turn)
        if session.active is None:
            self.waiting[session_id] = session
            self.kv.prefetch(session)

    def next_seq(self, session_id: str) -> int:
        accepted = self._get(session_id).accepted_seq
        return 0 if accepted is None else accepted + 1

    def cancel(self, session_id: str, seq: int | None) -> None:
        session = self._get(session_id)
        for turn in session.turns:
            if seq is None or turn.seq == seq:
                turn.cancelled = True
        active = session.active
        # A turn between two decode steps stops now; one still appending stops once its input is in.
        if active is not None and active.cancelled and session.uncached <= 1 and active.output_tokens:
            self._finish(session, "cancelled")

    def rewind(self, session_id: str, target: RewindTarget) -> Rewound:
        """Take the session's history back to where `target` says (worker/engine/rewind.py) and
        return its new length; raises `InvalidMessage` having changed nothing.

        Its running and queued turns are cancelled first (their results say `cancelled`; a queued
        one appended nothing), its held-back text is dropped (a rewind ends on a token boundary),
        and the KV past the new end goes back to the pool with no forward pass (`KVManager.truncate`).
        The session's held-back text is dropped (the rewind ends on a token boundary), but for a
        rewind to a turn, which takes it back to the text held right after that turn."""
        session = self._get(session_id)
        length = rewind_length(session, target)
        self.running.pop(session_id, None)
        self.waiting.pop(session_id, None)
        active, session.active = session.active, None
        if active is not None:
            for turn in [*active.absorbed, active]:
                turn.cancelled = True
                self._resolve(session, turn, "cancelled")
        for turn in session.pending:
            turn.cancelled = True
            turn.input_tokens = []  # it never entered the sequence
            self._resolve(session, turn, "cancelled")
        session.pending.clear()
        self.kv.truncate(session, length)
        del session.tokens[length:]
        tail = session.ends.tail(target.seq) if isinstance(target, ToTurn) else EMPTY_TAIL
        session.ends.truncate(length)
        session.tail = tail
        session.last_activity = self.clock()
        return Rewound(length, tail)

    def close(self, session_id: str, reason: str) -> None:
        session = self._get(session_id)
        self._remove(session)
        logger.debug("session %s closed (%s)", session_id, reason)
        for listener in self.close_listeners:
            try:
                listener(session_id, reason)
            except Exception:
                logger.exception("close listener failed for session %s", session_id)

    def expire_idle(self) -> float | None:
        """Close sessions idle past their timeout; returns seconds until the next one could expire."""
        now = self.clock()
        soonest: float | None = None
        for session in list(self.sessions.values()):
            timeout = session.config.idle_timeout_s
            if timeout is None or session.is_busy:
                continue
            left = session.last_activity + timeout - now
            if left <= 0:
                self.close(session.session_id, "idle_timeout")
            elif soonest is None or left < soonest:
                soonest = left
        return soonest

    def stats(self) -> EngineStats:
        memory = self.kv.stats()
        free = memory.device_pages_total - memory.device_pages_used
        return EngineStats(
            sessions=len(self.sessions),
            active_sessions=len(self.running),
            queued_turns=sum(len(s.pending) for s in self.sessions.values()),
            pages_total=memory.device_pages_total,
            pages_used=memory.device_pages_used,
            pages_free=free,
            page_size=self.page_size,
            kv_tokens_total=memory.device_pages_total * self.page_size,
            kv_tokens_free=free * self.page_size,
            steps=self.steps,
            turns_completed=self.turns_completed,
            tokens_forwarded=self.tokens_forwarded,
            kv_evictions=memory.drops,
            attention_backend=self.runner.attention_name,
            memory=memory,
        )

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One step, as nano-vllm's `LLMEngine.step`: schedule -> run -> postprocess; False if idle."""
        batch = self._schedule()
        if batch is None:
            return False
        try:
            sampled = self._run(batch)
        except Exception:
            logger.exception("forward step failed; failing the %d turns in it", len(batch.rows))
            self._fail_batch(batch)
            return True
        self._postprocess(batch, sampled)
        return True

    def _schedule(self) -> ScheduledBatch | None:
        """Activate the waiting turns, then pick what this step feeds (None: nothing to do)."""
        for session in list(self.waiting.values()):
            if any(turn.grammar_pending for turn in session.pending):
                continue  # its grammar is compiling; the compile's end wakes the engine
            del self.waiting[session.session_id]
            self._activate(session)
        return self.scheduler.schedule(self.running.values())

    def _run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        """One ragged forward over the batch's rows; each row that samples gets its token."""
        rows = [
            ForwardRow(
                token_ids=row.session.tokens[row.start : row.start + row.count],
                start=row.start,
                pages=row.session.pages,
                sampling=row.session.sampling_params() if row.sample else None,
                generator=row.session.generator if row.sample else None,
                grammar=row.session.active.matcher if row.sample and row.session.active else None,
            )
            for row in batch.rows
        ]
        sampled = self.runner.step(rows)
        self.steps += 1
        self.tokens_forwarded += batch.num_tokens
        return sampled

    def _postprocess(self, batch: ScheduledBatch, sampled: list[SampledToken | None]) -> None:
        """The step's results into its turns: the fed tokens are cached, each sampled token is
        appended and told to its listener, and a turn that stops, is long enough or was cancelled
        finishes."""
        for row, result in zip(batch.rows, sampled, strict=True):
            session = row.session
            session.num_cached += row.count
            turn = session.active
            assert turn is not None
            if result is not None:
                session.tokens.append(result.token)
                turn.output_tokens.append(result.token)
                if result.logprob is not None:
                    turn.output_logprobs.append(result.logprob)
                turn.notify(session.session_id, result.token, result.logprob)
                if turn.matcher is not None and not turn.matcher.accept_token(result.token):
                    # Never expected: the token was sampled under this matcher's own mask.
                    logger.error("session %s: token %d outside its grammar", session.session_id, result.token)
                if result.token in self._stop_ids(session):
                    self._finish(session, "stop")
                elif turn.matcher is not None and turn.matcher.is_terminated():
                    self._finish(session, "stop")  # the grammar is complete
                elif len(turn.output_tokens) >= turn.max_output_tokens:
                    self._finish(session, "length")
                elif turn.cancelled:
                    self._finish(session, "cancelled")
            elif session.uncached == 0:
                self._finish(session, "cancelled" if turn.cancelled else "length")

    # ---- internals ----------------------------------------------------------------------------

    def _activate(self, session: Session) -> None:
        turns, cut = self._fold(session)
        owner = turns[-1]
        owner.absorbed = turns[:-1]
        inputs = [t for turn in turns for t in turn.input_tokens]
        outputs = owner.max_output_tokens if owner.wants_output else 0
        failed = next((turn.grammar_error for turn in turns if turn.grammar_error is not None), None)
        if failed is not None:
            reason = failed if isinstance(failed, MicroturnError) else InternalError("grammar compile failed")
            self._refuse(session, turns, reason)
            return
        length_before = len(session.tokens)
        try:
            self.kv.prepare(session, cut, inputs, outputs)
        except CapacityExhausted as error:
            self._refuse(session, turns, error)
            return
        if cut is not None:
            session.ends.after_cut(cut, length_before)
        if owner.wants_output and owner.grammar is not None:
            owner.matcher = self.grammars.matcher(owner.grammar, self._stop_ids(session))
        turns[0].cut = cut
        now = self.clock()
        for turn in turns:
            turn.started_at = now
        end = len(session.tokens)
        for turn in owner.absorbed:  # each folded chunk's own end: where a rewind to it lands
            end += len(turn.input_tokens)
            turn.input_end = end
        session.tokens.extend(inputs)
        session.active = owner
        if outputs and session.uncached == 0:
            # Logits need one fed position: re-feed the last token (its KV slot is rewritten as-is).
            session.num_cached -= 1
        if session.uncached == 0:
            self._finish(session, "cancelled" if owner.cancelled else "length")
        else:
            self.running[session.session_id] = session

    def _refuse(self, session: Session, turns: list[Turn], error: MicroturnError) -> None:
        """Refuse `turns` (taken from the queue for one append) after they were accepted: later
        chunks were sent assuming these land, so refuse them too rather than reorder input, and
        forget all of them (seq and text included), so each may be sent again as it was."""
        assert turns[0].before is not None
        session.accepted_seq, session.tail = turns[0].before
        for turn in [*turns, *session.pending]:
            self._reject(turn, error)
        session.pending.clear()

    def _adopt(
        self,
        session: Session,
        config: OpenConfig,
        history: list[int],
        accepted_seq: int | None,
        text_tail: TextTail,
    ) -> bool:
        if not all(turn.background for turn in session.turns) or session.config != config:
            return False
        if history[: len(session.tokens)] != session.tokens:
            return False
        # Still warming (a drain's deadline came first): keep the KV computed so far (the first
        # `num_cached` tokens) and stop the warm-up; the next append prefills only the rest.
        self._withdraw(session)
        session.tokens = list(history)
        session.accepted_seq = accepted_seq
        session.tail = text_tail
        session.last_activity = self.clock()
        return True

    def _remove(self, session: Session) -> None:
        """The session leaves the engine: its turns end cancelled and its pages, in both tiers, are
        free. `close` tells the listeners; a warm copy that cannot be adopted leaves quietly (it was
        never the live session, and the listeners would end the live one)."""
        del self.sessions[session.session_id]
        self._withdraw(session)
        self.kv.release(session)

    def _withdraw(self, session: Session) -> None:
        """End every turn of the session (active and queued) as cancelled; its KV stays."""
        self.running.pop(session.session_id, None)
        self.waiting.pop(session.session_id, None)
        for turn in session.turns:
            turn.cancelled = True
            self._resolve(session, turn, "cancelled")
        session.active = None
        session.pending.clear()

    def _fold(self, session: Session) -> tuple[list[Turn], Cut | None]:
        """The turns one append takes from the queue, and the cut before it (None: none).

        Queued no-output chunks fold into the next append, but the window rule is per turn: a fold
        stops before a turn that would need a cut of its own, so the window is the same however
        the chunks were batched (and a restore replaying them one by one rebuilds it)."""
        config, limit = session.config, session.context_limit
        first = session.pending.popleft()
        cut = cut_before(len(session.tokens), first.grows_by, config, limit)
        length = (len(session.tokens) if cut is None else cut.keep + cut.recent) + len(first.input_tokens)
        turns = [first]
        while not turns[-1].wants_output and session.pending:
            following = session.pending[0]
            if cut_before(length, following.grows_by, config, limit) is not None:
                break
            turns.append(session.pending.popleft())
            length += len(following.input_tokens)
        return turns, cut

    def _finish(self, session: Session, reason: FinishReason) -> None:
        owner = session.active
        assert owner is not None
        session.active = None
        self.running.pop(session.session_id, None)
        for turn in owner.absorbed:
            self._resolve(session, turn, "cancelled" if turn.cancelled else "length")
        self._resolve(session, owner, reason)
        # Give back pages reserved for outputs the turn did not produce (early stop or cancel).
        self.kv.trim(session)
        if self.config.no_session:
            # The same path as a drop under memory pressure: the next turn recomputes the history.
            self.kv.forget(session)
        session.last_activity = self.clock()
        if session.pending:
            self.waiting[session.session_id] = session

    def _resolve(self, session: Session, turn: Turn, reason: FinishReason) -> None:
        self.turns_completed += 1
        text = self.tokenizer.decode(turn.output_tokens) if self.tokenizer is not None else None
        length = len(session.tokens)
        result = turn.result(session.session_id, reason, now=self.clock(), text=text, length=length)
        if turn.input_end is not None:  # folded into a later chunk's append: its own end
            session.ends.record(turn.seq, turn.input_end, turn.input_end, turn.tail_after)
        elif turn.started_at is not None:  # its input entered the sequence: a rewind may go back to its end
            session.ends.record(turn.seq, length - len(turn.output_tokens), length, turn.tail_after)
        if not turn.future.done():
            turn.future.set_result(result)

    def _reject(self, turn: Turn, error: MicroturnError) -> None:
        if not turn.future.done():
            turn.future.set_exception(error)

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        for row in batch.rows:
            session = row.session
            turn = session.active
            if turn is None:
                continue
            error = InternalError("the forward step failed; the turn was not applied")
            for failed in [*turn.absorbed, turn, *session.pending]:
                self._reject(failed, error)
            session.pending.clear()
            session.active = None
            self.running.pop(session.session_id, None)
            # The KV of this step's tokens may be half written: recompute the whole history next time.
            self.kv.forget(session)

    def _stop_ids(self, session: Session) -> tuple[int, ...]:
        configured = session.config.stop_token_ids
        return self.eos_token_ids if configured is None else configured

    def _get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"no session {session_id} on this worker") from None


def _seed_ends(session: Session, turn_ends: Sequence[tuple[int, int, int, TextTail]], given: int) -> None:
    """A reopened session remembers where its logged turns end, unless opening cut its history
    (then their positions are gone, as after any cut)."""
    if len(session.tokens) != given:
        return
    for seq, outputs_start, end, tail in turn_ends:
        if end <= given:
            session.ends.record(seq, outputs_start, end, tail)
