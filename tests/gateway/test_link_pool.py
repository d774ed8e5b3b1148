"""Routing of worker frames in the link pool: by sid and link, takeover, stale frames, link loss.

No sockets: the pool's routing is plain bookkeeping, tested with recording listeners.
"""

from __future__ import annotations

from gateway.links import Link, LinkPool
from gateway.metrics import GatewayMetrics
from shared.errors import ErrorCode
from shared.protocol.link import LinkClosed, LinkDone, LinkError, ToGateway
from shared.protocol.messages import Error, OutputDone, Timing


class Recorder:
    def __init__(self) -> None:
        self.frames: list[ToGateway] = []
        self.lost: list[Link] = []
        self.taken_over = 0

    def on_frame(self, frame: ToGateway) -> None:
        self.frames.append(frame)

    def on_link_lost(self, link: Link) -> None:
        self.lost.append(link)

    def on_taken_over(self) -> None:
        self.taken_over += 1


def done(sid: str, seq: int = 1) -> LinkDone:
    return LinkDone(sid, OutputDone(seq, (1,), None, "length", Timing(0.0, 1.0)), 5)


def test_frames_reach_the_listener_bound_on_that_link_only() -> None:
    pool = LinkPool(GatewayMetrics())
    a, b = pool.link("ws://a:1"), pool.link("ws://b:1")
    assert pool.link("ws://a:1") is a  # one link per worker URL
    listener = Recorder()
    pool.bind("s1", listener, a)
    pool.dispatch(a, done("s1"))
    pool.dispatch(b, LinkClosed("s1", "idle_timeout"))  # the session moved off b: stale
    pool.dispatch(a, done("s2"))  # nobody here listens for s2
    pool.dispatch(a, LinkError("", Error(ErrorCode.INVALID_MESSAGE, "bad frame", fatal=False)))
    assert listener.frames == [done("s1")]


def test_rebinding_moves_the_session_and_another_listener_takes_it_over() -> None:
    pool = LinkPool(GatewayMetrics())
    a, b = pool.link("ws://a:1"), pool.link("ws://b:1")
    first, second = Recorder(), Recorder()
    pool.bind("s1", first, a)
    pool.bind("s1", first, b)  # the same socket restored elsewhere: no takeover
    assert first.taken_over == 0 and pool.bound_link("s1", first) is b
    pool.bind("s1", second, b)  # another socket resumed it
    assert first.taken_over == 1
    assert not pool.unbind("s1", first)  # the old socket's cleanup cannot unbind the new one
    pool.dispatch(b, done("s1"))
    assert second.frames == [done("s1")] and first.frames == []


def test_link_loss_tells_every_session_on_it_once_and_unbinds_them() -> None:
    pool = LinkPool(GatewayMetrics())
    a, b = pool.link("ws://a:1"), pool.link("ws://b:1")
    on_a = [Recorder() for _ in range(3)]
    on_b = Recorder()
    for i, listener in enumerate(on_a):
        pool.bind(f"a{i}", listener, a)
    pool.bind("b0", on_b, b)
    pool.link_lost(a)
    pool.link_lost(a)
    assert [listener.lost for listener in on_a] == [[a], [a], [a]]
    assert on_b.lost == [] and pool.sessions == 1
    pool.dispatch(a, done("a0"))
    assert on_a[0].frames == []
