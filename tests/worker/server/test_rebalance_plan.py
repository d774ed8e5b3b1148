"""The rebalance's decision (worker/server/rebalance.py `plan_move`): whom to move to, and how many."""

from __future__ import annotations

from shared.store.registry import WorkerInfo
from shared.store.schema import STATE_DRAINING
from worker.server.rebalance import MOVES_PER_ROUND, RoundPlan, plan_move


def worker(
    worker_id: str, sessions: int, *, model: str = "tiny", max_sessions: int = 64, state: str = "ready"
) -> WorkerInfo:
    return WorkerInfo(worker_id, f"ws://{worker_id}", model, max_sessions, sessions, state=state)


def test_half_the_difference_goes_to_the_least_loaded_peer() -> None:
    own = worker("w0", 12)
    pool = [own, worker("w1", 6), worker("w2", 2), worker("w3", 2)]
    assert plan_move(own, pool, gap=2) == RoundPlan("w2", "ws://w2", 5)  # ties: the lowest id


def test_after_a_move_the_two_are_at_most_one_apart_so_nothing_moves_back() -> None:
    for own_sessions in range(0, 40):
        for peer_sessions in range(0, 40):
            own, peer = worker("w0", own_sessions), worker("w1", peer_sessions)
            move = plan_move(own, [own, peer], gap=2)
            if move is None:
                assert own_sessions - peer_sessions < 2
                continue
            moved = worker("w0", own_sessions - move.count), worker("w1", peer_sessions + move.count)
            assert 0 < move.count <= MOVES_PER_ROUND
            assert plan_move(moved[1], list(moved), gap=2) is None  # the target never sends them back
            if move.count < MOVES_PER_ROUND:
                assert abs(moved[0].sessions - moved[1].sessions) <= 1


def test_below_the_gap_nothing_moves() -> None:
    own = worker("w0", 5)
    assert plan_move(own, [own, worker("w1", 2)], gap=4) is None
    assert plan_move(own, [own, worker("w1", 1)], gap=4) == RoundPlan("w1", "ws://w1", 2)


def test_only_ready_peers_of_the_same_model_with_room_are_targets() -> None:
    own = worker("w0", 20)
    assert plan_move(own, [own], gap=2) is None
    others = [
        worker("w1", 0, state=STATE_DRAINING),
        worker("w2", 0, model="other"),
        worker("w3", 4, max_sessions=4),
    ]
    assert plan_move(own, [own, *others], gap=2) is None
    assert plan_move(own, [own, *others, worker("w4", 17, max_sessions=18)], gap=2) == RoundPlan(
        "w4", "ws://w4", 1
    )
