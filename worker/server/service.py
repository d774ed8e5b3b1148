"""The worker's side of the link protocol (docs/link.md): frames in, engine calls, frames out.

Runs on the asyncio loop. Engine callbacks arrive on the engine thread and are handed over with
`call_soon_threadsafe`, which keeps each session's deltas and its done in order. Nothing here
blocks on the engine: submissions are queued, and their results come back as callbacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import redis.asyncio as redis

from shared.errors import InternalError, InvalidMessage, MicroturnError, SessionNotFound, WorkerUnavailable
from shared.protocol.link import (
    LinkAttach,
    LinkCancel,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDelta,
    LinkDetach,
    LinkDone,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    LinkRewind,
    LinkRewound,
    LinkWarm,
    ToWorker,
    link_error_from,
)
from shared.protocol.messages import (
    CloseReason,
    InputChunk,
    OutputDelta,
    OutputDone,
    SessionRewind,
    SessionRewound,
    Timing,
)
from shared.settings import WorkerSettings
from shared.store.log_format import NO_SEQ, encode_log_record
from shared.store.prefix_label import prefix_label
from shared.store.schema import KeySchema
from shared.store.values import now_ms
from worker.engine import Engine, TokenDelta, TurnResult
from worker.engine.rewind import KeepOutputs, KeepTokens, RewindTarget, Rewound, ToTurn
from worker.server.lifecycle import HELD_ELSEWHERE, Phase
from worker.server.metrics import WorkerMetrics
from worker.server.restore import RestorePlan, plan_restore
from worker.server.sessions import LinkPeer, WorkerSession, WorkerSessions
from worker.server.token_log import TokenLogWriter, read_log_bytes
from worker.server.warm import WARM_DISCARDED, WarmCopies
from worker.tokenizer.detokenize import IncrementalDecoder
from worker.tokenizer.incremental import EMPTY_TAIL

logger = logging.getLogger(__name__)

# A rewind that finds its session still opening, or Redis refusing its log record, tries again after this.
REWIND_RETRY_MS = 100


class WorkerService:
    def __init__(
        self,
        engine: Engine,
        settings: WorkerSettings,
        client: redis.Redis,
        schema: KeySchema,
        loop: asyncio.AbstractEventLoop,
        *,
        worker_id: str,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.redis = client
        self.schema = schema
        self.loop = loop
        self.worker_id = worker_id
        # The one owner of every session here (live ones, copies, those handed over) and of their
        # token logs (sessions.py).
        self.sessions = WorkerSessions(
            TokenLogWriter(
                client,
                schema,
                grace_s=settings.session_grace_s,
                worker_id=worker_id,
                keep_records=settings.log_keep_records,
            )
        )
        self.metrics = WorkerMetrics()
        self.draining = False
        # Copies of other workers' sessions, warmed here before their drain switches them over.
        self.warm = WarmCopies(self)
        engine.add_close_listener(self._engine_closed_threadsafe)

    # ---- frames from a link -------------------------------------------------------------------

    def dispatch(self, link: LinkPeer, frame: ToWorker) -> None:
        if isinstance(frame, LinkChunk):
            self._chunk(frame.sid, frame.chunk, link)
        elif isinstance(frame, LinkOpen):
            self._open(link, frame, list(frame.history), finished_seq=None)
        elif isinstance(frame, LinkAttach):
            self._attach(link, frame)
        elif isinstance(frame, LinkRestore):
            self._restore(link, frame)
        elif isinstance(frame, LinkCancel) and frame.keep_output_tokens is not None:
            self._rewind(frame.sid, KeepOutputs(frame.seq, frame.keep_output_tokens), link)
        elif isinstance(frame, LinkCancel):
            self._guard(frame.sid, None, lambda: self.engine.cancel(frame.sid, frame.seq))
        elif isinstance(frame, LinkRewind):
            self._rewind(frame.sid, _rewind_target(frame.rewind), link)
        elif isinstance(frame, LinkDetach):
            session = self.sessions.get(frame.sid)
            if session is not None:
                self.sessions.detach(session, link)
        elif isinstance(frame, LinkClose):
            self._close(link, frame.sid)
        elif isinstance(frame, LinkWarm):
            self.warm.request(link, frame)
        else:  # pragma: no cover - decode_link only yields the frames above
            raise InvalidMessage(f"unexpected frame {frame!r}")

    def link_gone(self, link: LinkPeer) -> None:
        self.warm.link_gone(link)
        detached = self.sessions.unbind_link(link)
        if detached:
            logger.info("a link closed; %d sessions wait detached for a resume", detached)

    # ---- open, attach, restore, close ---------------------------------------------------------

    def _open(
        self,
        link: LinkPeer,
        frame: LinkOpen | LinkRestore,
        history: list[int],
        *,
        finished_seq: int | None,
        log: bytes = b"",
        plan: RestorePlan | None = None,
    ) -> None:
        sid, config = frame.sid, frame.config
        try:  # a system prompt given as text: its tokens open a fresh session (a restore logged them)
            rules = self.engine.session_rules(config)
        except MicroturnError as error:
            self._send_error(link, sid, error, fatal=True)
            return
        fresh_prefix = list(rules.prefix) if plan is None and not history else []
        history = fresh_prefix or history
        if self.draining:
            self._send_error(link, sid, WorkerUnavailable("worker is draining"), fatal=True)
            return
        if self.sessions.get(sid) is not None:
            self._send_error(link, sid, InvalidMessage(f"session {sid} is already open here"), fatal=True)
            return
        durable = None if plan is None else plan.durable_seq
        # A restore takes over the copy warmed here for the old worker's drain (warm.py), if any.
        adopted = self.sessions.adopt(sid, log=log, durable_seq=durable) if plan is not None else None
        if adopted is not None:
            self.warm.adopted(sid)
        session = adopted or WorkerSession(sid)
        idle = config.idle_timeout_s or self.settings.idle_timeout_s  # the worker's default applies
        session.stream, session.idle_timeout_s, session.link = config.stream, idle, link
        session.length, session.finished_seq = len(history), finished_seq
        session.config = config
        session.token_sha256 = frame.token_sha256
        session.auth = frame.auth
        session.created_ms = frame.created_ms or now_ms()
        session.restore = plan
        session.prefix = fresh_prefix
        if plan is not None:
            session.waiting = list(plan.rerun)  # run first, in seq order, once the session is open
        if adopted is None:
            self.sessions.open(session, log=log, durable_seq=durable)
        try:
            _sid, future = self.engine.open_session_async(
                session_id=sid,
                history=history,
                accepted_seq=finished_seq,
                text_tail=EMPTY_TAIL if plan is None else plan.text_tail,
                config=replace(rules.config, idle_timeout_s=idle),
                adopt=adopted is not None,
                turn_ends=() if plan is None else plan.turn_ends,
            )
        except MicroturnError as error:
            self.sessions.close(sid)
            self._send_error(link, sid, error, fatal=True)
            return
        if config.keep_prefix_text is not None and rules.prefix:
            # Placement prefers a worker that names this prefix while its pages are cached here.
            self.engine.name_prefix(prefix_label(config.keep_prefix_text), rules.prefix)
        future.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._opened, session, f))

    def _opened(self, binding: WorkerSession, future: Future[str]) -> None:
        error = future.exception()
        if error is not None:
            self.sessions.close(binding.sid)
            self._send_error(binding.link, binding.sid, error, fatal=True)
            for chunk in binding.waiting:
                self._send_error(
                    binding.link, binding.sid, SessionNotFound("the session failed to open"), seq=chunk.seq
                )
            return
        if self.sessions.get(binding.sid) is not binding or binding.phase is not Phase.OPENING:
            return  # a drain handed it over (or it was closed) while it opened: told already
        self.sessions.opened(binding)
        plan, binding.restore = binding.restore, None
        if binding.prefix:  # a fresh session's system prompt: logged as tokens of no turn
            prefix, binding.prefix = tuple(binding.prefix), []
            self.sessions.log_turn(binding, NO_SEQ, prefix, (), tail=EMPTY_TAIL)
        if plan is not None:
            for turn in plan.forced:  # delivered turns the log lacked: now in the history
                inputs, outputs = tuple(turn.tokens[: turn.inputs]), tuple(turn.tokens[turn.inputs :])
                self.sessions.log_turn(binding, turn.seq, inputs, outputs, tail=turn.tail, cut=turn.cut)
        durable = self.sessions.durable_seq(binding)
        binding.send(LinkOpened(binding.sid, binding.length, binding.finished_seq, durable))
        if plan is not None:
            for answer in plan.answers:  # turns the log holds whose done the client never got
                tokenizer = self.engine.tokenizer
                text = tokenizer.decode(list(answer.done.tokens)) if tokenizer is not None else None
                done = replace(answer, done=replace(answer.done, text=text), durable_seq=durable)
                binding.replay.append(done)
                binding.send(done)
        waiting, binding.waiting = binding.waiting, []
        for chunk in waiting:
            self._chunk(binding.sid, chunk, binding.link)

    def _attach(self, link: LinkPeer, frame: LinkAttach) -> None:
        binding = self.sessions.get(frame.sid)
        if binding is None:
            self._send_error(
                link, frame.sid, SessionNotFound(f"no session {frame.sid} on this worker"), fatal=True
            )
            return
        self._bind(binding, link)
        if binding.phase is not Phase.OPENING:  # else `opened` goes to this link once it is open
            durable = self.sessions.durable_seq(binding)
            link.send(LinkOpened(binding.sid, binding.length, binding.finished_seq, durable))
            for done in binding.missed(frame.seen_seq):
                link.send(done)

    def _bind(self, binding: WorkerSession, link: LinkPeer) -> None:
        previous = self.sessions.bind(binding, link)
        if previous is not None and previous is not link:
            previous.send(LinkClosed(binding.sid, "taken_over"))

    def _restore(self, link: LinkPeer, frame: LinkRestore) -> None:
        existing = self.sessions.get(frame.sid)
        if existing is not None:  # the gateway thought this worker lost, but the session lives
            self._attach(link, LinkAttach(frame.sid, frame.seen_seq))
            return
        if frame.tokens is not None:
            self._rebuild(link, frame, encode_log_record(NO_SEQ, frame.tokens))
            return
        self.loop.create_task(self._restore_from_log(link, frame))

    async def _restore_from_log(self, link: LinkPeer, frame: LinkRestore) -> None:
        try:
            data = await read_log_bytes(self.redis, self.schema, frame.sid)
        except redis.RedisError as exc:
            logger.warning("reading the token log of %s failed: %s", frame.sid, exc)
            self._send_error(
                link, frame.sid, WorkerUnavailable("the token log could not be read"), fatal=True
            )
            return
        self._rebuild(link, frame, data)

    def _rebuild(self, link: LinkPeer, frame: LinkRestore, log: bytes) -> None:
        """Open the session from its log plus the gateway's undurable tail (worker/server/restore.py)."""
        try:
            rules = self.engine.session_rules(frame.config)  # the window's rule as the engine runs it
            plan = plan_restore(frame.sid, log, frame.tail, frame.seen_seq, rules=rules)
        except ValueError as exc:
            logger.error("session %s cannot be restored: %s", frame.sid, exc)
            corrupt = SessionNotFound("the session's token log is corrupt")
            self._send_error(link, frame.sid, corrupt, fatal=True)
            return
        except MicroturnError as error:
            self._send_error(link, frame.sid, error, fatal=True)
            return
        logger.info(
            "restoring session %s: %d tokens (log to seq %s), %d delivered turns forced, %d chunks re-run",
            frame.sid,
            len(plan.history),
            plan.durable_seq,
            len(plan.forced),
            len(plan.rerun),
        )
        self._open(link, frame, plan.history, finished_seq=plan.finished_seq, log=log, plan=plan)

    def _close(self, link: LinkPeer, sid: str) -> None:
        if self.warm.withdraw(link, sid):
            link.send(LinkClosed(sid, "closed"))
            return
        binding = self.sessions.close(sid)
        if binding is None:
            link.send(LinkClosed(sid, "closed"))
            return
        future = self.engine.close_session_async(sid, "closed")
        future.add_done_callback(lambda _f: self.loop.call_soon_threadsafe(self._closed, link, sid))

    def _closed(self, link: LinkPeer, sid: str) -> None:
        self.loop.create_task(self._forget_then_tell(link, sid, "closed"))

    async def _forget_then_tell(self, link: LinkPeer | None, sid: str, reason: CloseReason) -> None:
        """`closed` goes out only once the session's keys are gone: it means cleaned up."""
        await self.sessions.forget(sid)
        if link is not None:
            link.send(LinkClosed(sid, reason))

    def _engine_closed_threadsafe(self, sid: str, reason: str) -> None:
        if reason != "closed":  # an explicit close is answered by `_closed`
            self.loop.call_soon_threadsafe(self._engine_closed, sid, reason)

    def _engine_closed(self, sid: str, reason: str) -> None:
        if reason == WARM_DISCARDED:
            return  # a copy whose entry went first (warm.py `_end`): a newer copy of `sid` may be here
        if self.sessions.copy(sid) is not None:
            self.warm.forgotten(sid)  # a copy, never a live session here: no log, no keys
            return
        binding = self.sessions.close(sid)
        wire_reason: CloseReason = "idle_timeout" if reason == "idle_timeout" else "evicted"
        self.loop.create_task(self._forget_then_tell(binding.link if binding else None, sid, wire_reason))

    # ---- the hot path -------------------------------------------------------------------------

    def _chunk(self, sid: str, chunk: InputChunk, link: LinkPeer | None) -> None:
        entry = self.sessions.entry(sid)
        if entry is not None and entry.phase in HELD_ELSEWHERE:
            return  # the gateway has it in its tail: it runs on the session's next worker
        binding = self.sessions.get(sid)
        if binding is None:
            missing = SessionNotFound(f"no session {sid} on this worker")
            self._send_error(link, sid, missing, seq=chunk.seq, fatal=True)
            return
        if binding.phase is Phase.OPENING:
            binding.waiting.append(chunk)
            return
        decoder = IncrementalDecoder(self.engine.tokenizer) if binding.stream else None
        on_token = None
        if decoder is not None:

            def on_token(delta: TokenDelta) -> None:
                self.loop.call_soon_threadsafe(self._delta, binding, decoder, delta)

        def submit() -> None:
            future = self.engine.submit(
                sid,
                tokens=chunk.tokens,
                text=chunk.text,
                seq=chunk.seq,
                max_output_tokens=chunk.max_output_tokens,
                logprobs=chunk.logprobs,
                flush=bool(chunk.flush),
                on_token=on_token,
                response_format=chunk.response_format,
            )
            binding.in_flight += 1
            future.add_done_callback(
                lambda f: self.loop.call_soon_threadsafe(self._done, binding, chunk.seq, f)
            )

        self._guard(sid, chunk.seq, submit)

    def _delta(self, binding: WorkerSession, decoder: IncrementalDecoder, delta: TokenDelta) -> None:
        text = decoder.feed(delta.token)
        delta_message = OutputDelta(delta.seq, delta.index, delta.token, text, delta.logprob)
        binding.send(LinkDelta(binding.sid, delta_message))

    def _done(self, binding: WorkerSession, seq: int, future: Future[TurnResult]) -> None:
        binding.in_flight -= 1
        error = future.exception()
        if error is not None:
            self._send_error(binding.link, binding.sid, error, seq=seq)
            return
        result = future.result()
        done = LinkDone(
            sid=binding.sid,
            done=OutputDone(
                seq=result.seq,
                tokens=result.tokens,
                text=result.text,
                finish=result.finish,
                timing=Timing(result.queue_ms, result.compute_ms),
                logprobs=result.logprobs,
                committed_tokens=len(result.inputs),
            ),
            length=result.length,
            durable_seq=self.sessions.durable_seq(binding),
        )
        binding.record(done)
        binding.send(done)
        binding.turns_answered += 1
        self.metrics.turns += 1
        self.metrics.turn_latency.observe((result.queue_ms + result.compute_ms) / 1000.0)
        # Only once the reply is out: the log is for rebuilding, never on the client's critical path.
        # Not logged for a session that ended or was handed over meanwhile (it re-runs elsewhere).
        inputs, outputs = result.inputs, result.tokens
        self.sessions.log_turn(binding, result.seq, inputs, outputs, tail=result.tail, cut=result.cut)

    # ---- rewinds (issue #35) --------------------------------------------------------------------

    def _rewind(self, sid: str, target: RewindTarget, link: LinkPeer, *, seq: int | None = None) -> None:
        """Apply a rewind in the engine, write it to the token log, and answer `rewound` once Redis
        holds it: a session restored elsewhere from then on continues from the edited history."""
        entry = self.sessions.entry(sid)
        if entry is not None and entry.phase in HELD_ELSEWHERE:
            # Left unanswered, as a chunk is: the session moves, and its gateway sends the rewind
            # again to the next worker once it is restored there (gateway/session/edits.py).
            return
        binding = self.sessions.get(sid)
        if binding is None:
            self._send_error(link, sid, SessionNotFound(f"no session {sid} on this worker"), seq=seq)
            return
        if binding.phase is Phase.OPENING:
            opening = WorkerUnavailable("the session is still opening", retry_after_ms=REWIND_RETRY_MS)
            self._send_error(link, sid, opening, seq=seq)
            return
        future = self.engine.rewind(sid, target)
        future.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._rewound, binding, seq, f))

    def _rewound(self, binding: WorkerSession, seq: int | None, future: Future[Rewound]) -> None:
        """The engine applied it (after the `done`s of the turns it cancelled, which ran first)."""
        error = future.exception()
        if error is not None:
            self._send_error(binding.link, binding.sid, error, seq=seq)
            return
        if self.sessions.get(binding.sid) is not binding:
            return  # the session ended meanwhile
        rewound = future.result()
        binding.length = rewound.length
        if self.sessions.log_rewind(binding, rewound.length, rewound.tail):
            self.loop.create_task(self._answer_rewind(binding, rewound.length))

    async def _answer_rewind(self, binding: WorkerSession, length: int) -> None:
        """`rewound` goes out once the log in Redis holds the rewind (retried while Redis refuses)."""
        delay = REWIND_RETRY_MS / 1000
        while not await self.sessions.flush():
            if self.sessions.get(binding.sid) is not binding:
                return
            await asyncio.sleep(delay)
        self.sessions.touched.add(binding.sid)
        durable = self.sessions.durable_seq(binding)
        binding.send(LinkRewound(binding.sid, SessionRewound(length), durable))

    # ---- errors -------------------------------------------------------------------------------

    def _guard(self, sid: str, seq: int | None, action: Callable[[], object]) -> None:
        try:
            action()
        except MicroturnError as error:
            binding = self.sessions.get(sid)
            self._send_error(binding.link if binding else None, sid, error, seq=seq)

    def _send_error(
        self,
        link: LinkPeer | None,
        sid: str,
        error: BaseException,
        *,
        seq: int | None = None,
        fatal: bool | None = None,
    ) -> None:
        if not isinstance(error, MicroturnError):
            logger.error("internal error in session %s", sid, exc_info=error)
            error = InternalError("internal error")
        self.metrics.error(str(error.code))
        if link is not None:
            link.send(link_error_from(sid, error, seq, fatal=fatal))


def _rewind_target(rewind: SessionRewind) -> RewindTarget:
    """The engine's target for a client's `session.rewind` (the codec made sure exactly one is set)."""
    if rewind.to_seq is not None:
        return ToTurn(rewind.to_seq)
    return KeepTokens(rewind.keep_tokens or 0)
