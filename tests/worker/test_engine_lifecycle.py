"""Session lifecycle: pages come back, idle sessions expire, chunks coalesce, KV is dropped and rebuilt."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import Future

import pytest
import torch

from shared.protocol.messages import OpenConfig
from tests.processes import REPO
from tests.wait import wait_until
from worker.dtypes import torch_dtype
from worker.engine import Engine
from worker.engine.config import EngineConfig
from worker.engine.core import EngineCore
from worker.engine.model_runner import ModelRunner
from worker.engine.turn import Turn, TurnResult
from worker.model.loader import load_model


def test_pages_return_to_the_pool_on_close(tiny: Engine) -> None:
    sids = [tiny.open_session(stop_token_ids=()) for _ in range(3)]
    for i, sid in enumerate(sids):  # each its own tokens: nothing shared (tests/worker/test_prefix_cache.py)
        tiny.run_turn(sid, tokens=list(range(1 + 40 * i, 40 + 40 * i)), max_output_tokens=5, timeout=30)
    stats = tiny.stats()
    assert stats.sessions == 3 and stats.pages_used == 3 * 3  # 44 tokens -> 3 pages each
    for sid in sids:
        tiny.close_session(sid)
    stats = tiny.stats()
    assert stats.sessions == 0 and stats.pages_used == 0 and stats.pages_free == stats.pages_total


def test_idle_timeout_frees_pages_and_tells_listeners(tiny: Engine) -> None:
    closed: list[tuple[str, str]] = []
    tiny.add_close_listener(lambda sid, reason: closed.append((sid, reason)))
    idle = tiny.open_session(idle_timeout_s=0.3)
    kept = tiny.open_session()
    tiny.run_turn(idle, tokens=list(range(1, 20)), max_output_tokens=2, timeout=30)
    tiny.run_turn(kept, tokens=list(range(1, 20)), max_output_tokens=2, timeout=30)
    wait_until(lambda: closed == [(idle, "idle_timeout")], 10, "the idle session to close")
    stats = tiny.stats()
    assert stats.sessions == 1 and stats.pages_used == 2
    tiny.close_session(kept)
    assert tiny.stats().pages_used == 0


class ManualClock:
    """The engine core's clock, moved by the test: idle time is the subject, so the test names it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core_on(clock: ManualClock) -> EngineCore:
    """An engine core with no thread: the test calls its steps and its idle check itself."""
    config = EngineConfig(model="tiny", kv_tokens=1024, page_size=16)
    device, dtype = torch.device("cpu"), torch_dtype(config.dtype)
    loaded = load_model("tiny", device=device, dtype=dtype, seed=config.seed)
    runner = ModelRunner(
        loaded, device=device, dtype=dtype, num_pages=64, page_size=16, attention=config.attention
    )
    return EngineCore(config, runner, loaded.tokenizer, eos_token_ids=(), clock=clock)


def run_turn(core: EngineCore, sid: str, seq: int) -> None:
    done: Future[TurnResult] = Future()
    done.set_running_or_notify_cancel()
    turn = Turn(seq, [1, 2], 1, False, done, None, submitted_at=0.0)
    core.submit(sid, turn)
    while not done.done():
        core.step()
    assert done.result().seq == seq


def test_idle_timeout_counts_from_the_last_activity() -> None:
    clock = ManualClock()
    core = core_on(clock)
    closed: list[tuple[str, str]] = []
    core.close_listeners.append(lambda sid, reason: closed.append((sid, reason)))
    core.open_session("s", OpenConfig(idle_timeout_s=0.5), [])
    for seq in range(6):  # 6 x 0.3 s: longer than the timeout in total, never idle that long
        clock.now += 0.3
        assert core.expire_idle() == pytest.approx(0.2)  # 0.3 s of its 0.5 s gone
        run_turn(core, "s", seq)
    clock.now += 0.49
    core.expire_idle()
    assert closed == [] and list(core.sessions) == ["s"]
    clock.now += 0.02  # 0.51 s since its last turn
    assert core.expire_idle() is None
    assert closed == [("s", "idle_timeout")] and core.sessions == {}


def test_no_output_chunks_coalesce_into_one_append(tiny: Engine) -> None:
    sid = tiny.open_session(stop_token_ids=())
    started = threading.Event()
    busy = tiny.submit(sid, tokens=[7], max_output_tokens=30, on_token=lambda _d: started.set())
    assert started.wait(30)
    chunks = [[10 + i, 20 + i, 30 + i] for i in range(3)]
    quiet = [tiny.submit(sid, tokens=chunk, max_output_tokens=0) for chunk in chunks]
    last = tiny.submit(sid, tokens=[99], max_output_tokens=2)
    busy.result(30)
    steps_after_busy = tiny.stats().steps
    assert all(f.result(30).tokens == () and f.result(30).finish == "length" for f in quiet)
    merged = last.result(30)
    assert [f.result(30).inputs for f in quiet] == [tuple(c) for c in chunks] and merged.inputs == (99,)
    # One append for all four chunks plus one decode step, instead of four appends.
    assert tiny.stats().steps - steps_after_busy <= 2

    reference = tiny.open_session(stop_token_ids=())
    tiny.run_turn(reference, tokens=[7], max_output_tokens=30, timeout=30)
    whole = tiny.run_turn(
        reference, tokens=[t for c in chunks for t in c] + [99], max_output_tokens=2, timeout=30
    )
    assert merged.tokens == whole.tokens and merged.length == whole.length


def test_cancel_stops_generation_and_keeps_the_session_usable(tiny: Engine) -> None:
    sid = tiny.open_session(stop_token_ids=())
    first_token = threading.Event()
    turn = tiny.submit(sid, tokens=[1, 2, 3], max_output_tokens=500, on_token=lambda _d: first_token.set())
    assert first_token.wait(30)
    tiny.cancel(sid).result(30)
    result = turn.result(30)
    assert result.finish == "cancelled" and 1 <= len(result.tokens) < 500
    history = [1, 2, 3, *result.tokens]
    after = tiny.run_turn(sid, tokens=[4, 5], max_output_tokens=6, timeout=30)
    # A session rebuilt from the same history (the restore path) continues identically.
    rebuilt = tiny.open_session(stop_token_ids=(), history=history)
    assert tiny.run_turn(rebuilt, tokens=[4, 5], max_output_tokens=6, timeout=30).tokens == after.tokens


def test_stop_token_ends_the_turn_and_is_returned(tiny: Engine) -> None:
    probe = tiny.open_session(stop_token_ids=())
    free_run = tiny.run_turn(probe, tokens=[11, 12, 13], max_output_tokens=8, timeout=30).tokens
    stop = free_run[3]
    sid = tiny.open_session(stop_token_ids=(stop,))
    result = tiny.run_turn(sid, tokens=[11, 12, 13], max_output_tokens=8, timeout=30)
    assert result.finish == "stop"
    assert result.tokens == free_run[: free_run.index(stop) + 1]


def test_truncate_keeps_the_prefix_and_the_most_recent_tokens(tiny: Engine) -> None:
    """A retention ratio of 1.0 is the rule before ratios existed: every cut is to the limit."""
    options = {
        "stop_token_ids": (),
        "max_context_tokens": 64,
        "context_policy": "truncate",
        "keep_prefix_tokens": 8,
        "retention_ratio": 1.0,
    }
    sid = tiny.open_session(**options)
    history: list[int] = []
    for i in range(6):
        chunk = [(17 * i + j) % 250 + 1 for j in range(15)]
        result = tiny.run_turn(sid, tokens=chunk, max_output_tokens=3, timeout=30)
        history += chunk + list(result.tokens)
        assert result.length <= 64
    chunk = [200, 201, 202]
    window_before = history[:8] + history[len(history) - (64 - 8 - 3 - 3) :]
    result = tiny.run_turn(sid, tokens=chunk, max_output_tokens=3, timeout=30)
    reference = tiny.open_session(stop_token_ids=(), history=window_before)
    assert tiny.run_turn(reference, tokens=chunk, max_output_tokens=3, timeout=30).tokens == result.tokens


def test_idle_sessions_lose_their_kv_under_pressure_and_recompute_it() -> None:
    """With no host tier (`host_kv_tokens` 0) pressure drops KV, as before the tier existed."""
    with Engine.load("tiny", kv_tokens=128, page_size=16, host_kv_tokens=0) as engine:
        idle = engine.open_session(stop_token_ids=())
        engine.run_turn(idle, tokens=list(range(1, 60)), max_output_tokens=2, timeout=30)
        busy = engine.open_session(stop_token_ids=())
        engine.run_turn(busy, tokens=list(range(100, 180)), max_output_tokens=2, timeout=30)
        assert engine.stats().kv_evictions == 1
        assert engine.stats().memory.host_pages_total == 0
        resumed = engine.run_turn(idle, tokens=[5, 6, 7], max_output_tokens=4, timeout=30)
        with Engine.load("tiny", kv_tokens=1024) as roomy:
            sid = roomy.open_session(stop_token_ids=())
            roomy.run_turn(sid, tokens=list(range(1, 60)), max_output_tokens=2, timeout=30)
            assert (
                roomy.run_turn(sid, tokens=[5, 6, 7], max_output_tokens=4, timeout=30).tokens
                == resumed.tokens
            )
        assert engine.stats().memory.recomputes == 1


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.8, "seed": 3},
        {"temperature": 1.0, "top_k": 20, "seed": 5},
        {"temperature": 0.7, "top_p": 0.9, "seed": 9},
    ],
)
def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny: Engine, options: dict[str, object]) -> None:
    def session_tokens(noise: bool) -> list[tuple[int, ...]]:
        sid = tiny.open_session(stop_token_ids=(), **options)
        other = tiny.open_session(stop_token_ids=(), temperature=1.0, seed=123)
        results = []
        for i in range(3):
            if noise:
                tiny.submit(other, tokens=[i + 1] * (i + 2), max_output_tokens=5)
            results.append(
                tiny.run_turn(sid, tokens=[40 + i, 41 + i], max_output_tokens=6, timeout=30).tokens
            )
        return results

    alone, batched = session_tokens(False), session_tokens(True)
    assert alone == batched
    greedy = tiny.open_session(stop_token_ids=())
    greedy_tokens = [
        tiny.run_turn(greedy, tokens=[40 + i, 41 + i], max_output_tokens=6, timeout=30).tokens
        for i in range(3)
    ]
    assert alone != greedy_tokens  # sampling really sampled


def test_top_k_one_is_greedy(tiny: Engine) -> None:
    a = tiny.open_session(stop_token_ids=(), temperature=1.5, top_k=1, seed=1)
    b = tiny.open_session(stop_token_ids=())
    assert (
        tiny.run_turn(a, tokens=[3, 4], max_output_tokens=8).tokens
        == tiny.run_turn(b, tokens=[3, 4], max_output_tokens=8).tokens
    )


def test_text_chunks_are_tokenized_and_outputs_decoded(tiny: Engine) -> None:
    assert tiny.tokenizer is not None
    sid = tiny.open_session(stop_token_ids=())
    result = tiny.run_turn(sid, text="hello", max_output_tokens=3, timeout=30)
    assert result.length == len(tiny.tokenizer.encode("hello")) + 3
    assert result.text == tiny.tokenizer.decode(list(result.tokens))


def test_a_worker_that_never_meets_a_response_format_never_imports_the_grammar_library() -> None:
    """xgrammar imports transformers, about a second of CPU at every start (worker/engine/grammar.py):
    a worker of a small vocabulary (`tiny`'s byte-level tokenizer) starts as `microturn worker` does
    (the grammars prepared), serves a turn and closes without either, its grammar thread included."""
    code = (
        "import sys, threading, worker.server.main\n"
        "from worker.engine import Engine\n"
        "with Engine.load('tiny', kv_tokens=1024) as engine:\n"
        "    assert engine.tokenizer is not None\n"
        "    engine.grammars.prepare()\n"
        "    sid = engine.open_session(stop_token_ids=())\n"
        "    engine.run_turn(sid, tokens=[1, 2, 3], max_output_tokens=2, timeout=60)\n"
        "for thread in threading.enumerate():\n"
        "    if thread.name.startswith('microturn-grammar'):\n"
        "        thread.join()\n"
        "print(sorted({'xgrammar', 'transformers'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_the_engine_is_built_on_a_thread_that_ends_with_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller's thread must run no parallel region of the load: libgomp would keep its worker
    # threads for the caller's lifetime and, with more of them than cores, make the engine thread's
    # workers sleep between regions (Engine._on_own_thread's docstring: a 2-thread decode step
    # took twice as long).
    from worker.engine import engine as engine_module

    builders: list[threading.Thread] = []

    def recording_load(*args: object, **kwargs: object) -> object:
        builders.append(threading.current_thread())
        return load_model(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "load_model", recording_load)
    with Engine.load("tiny", kv_tokens=64) as engine:
        assert engine.run_turn(engine.open_session(), tokens=[1, 2], max_output_tokens=1).tokens
    assert len(builders) == 1 and builders[0] is not threading.current_thread()
    assert not builders[0].is_alive()
