"""What a rewind costs in the engine (issue #35, point 6): four edits of a long session, each against
what the same result costs without a session's KV.

    python -m loadtest.rewind_bench [--model tiny|smollm2-135m] [--history 2048] [--rounds 5]
        [--scenarios rewind,delete,out_of_band,out_of_band_other]

- **Rewind of the last reply**: a session of `--history` tokens answers `--outputs` tokens, then
  takes them back (`KeepOutputs(seq, 0)`). Figures: tokens forwarded by the rewind (0: no forward
  pass) and its engine time (the rewind command timed on the engine thread, µs), plus the round
  trip through the engine's queue.
- **Delete k tokens from the end**: the history's last k tokens are an item of `--item` tokens and
  what followed it; deleting the item keeps the KV up to its first token and prefills the rest
  again (`KeepTokens`, then one append). Against a fresh session prefilling the edited history.
- **Out of band**: over the `--history` conversation, a side question of `--question` tokens gets
  `--outputs` tokens, then the conversation is rewound to where it was (nothing of it stays).
  Against a fresh session prefilling the conversation plus the question (what a stateless server
  pays). The next turn afterwards must equal the same turn on an untouched copy (asserted).
- **Out of band over other items**: the side input keeps only the conversation's first `--kept`
  tokens (then its question): the session is rewound there, answers, is rewound there again and
  prefills the rest of the conversation again (what the OpenAI dialect runs for an input that
  leaves conversation items out, gateway/openai/out_of_band.py). Figures: the answer (what the
  client waits for) and the restore, against a fresh session prefilling the kept part plus the
  question. The next turn afterwards must equal the untouched copy's (asserted).

The prefix cache is off: with it on, a baseline session would map the history's pages the edited
one computed, and a rewind into those shared pages re-feeds up to a page (docs/design.md section 7).
Rounds alternate edit and baseline; the figures are medians of the engine's `compute_ms` (the
turn's time in the engine) and exact counts of forwarded tokens (`EngineStats.tokens_forwarded`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from worker.engine import Engine
from worker.engine.rewind import KeepOutputs, KeepTokens


def _tokens(n: int, salt: int) -> list[int]:
    """Token ids every preset's vocabulary has (the `tiny` one has 512)."""
    return [(7919 * j + 104729 * salt) % 400 + 100 for j in range(n)]


def _turn(
    engine: Engine, sid: str, seq: int, tokens: list[int], outputs: int
) -> tuple[float, int, tuple[int, ...]]:
    """(compute ms, tokens forwarded, output tokens) of one turn."""
    before = engine.stats().tokens_forwarded
    result = engine.run_turn(sid, tokens=tokens, max_output_tokens=outputs, seq=seq, timeout=600)
    return result.compute_ms, engine.stats().tokens_forwarded - before, result.tokens


def _open(engine: Engine) -> str:
    return engine.open_session(stop_token_ids=())


def _rewind_engine_us(engine: Engine, sid: str, target: KeepOutputs | KeepTokens) -> tuple[float, float, int]:
    """(engine µs, round trip µs, tokens forwarded) of one rewind. The engine time is the rewind
    command itself, timed on the engine thread (a bench-only look inside the facade)."""
    core = engine._core
    spent: list[float] = []

    def timed() -> int:
        started = time.perf_counter()
        rewound = core.rewind(sid, target)
        spent.append((time.perf_counter() - started) * 1e6)
        return rewound.length

    before = engine.stats().tokens_forwarded
    started = time.perf_counter()
    engine._call(timed).result(60)
    round_trip = (time.perf_counter() - started) * 1e6
    return spent[0], round_trip, engine.stats().tokens_forwarded - before


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.rewind_bench", description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--outputs", type=int, default=16)
    parser.add_argument("--item", type=int, default=32, help="the deleted item's tokens")
    parser.add_argument("--after", type=int, default=64, help="tokens after the deleted item")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument(
        "--kept", type=int, default=1024, help="conversation tokens an other-items input keeps"
    )
    parser.add_argument("--scenarios", default="rewind,delete,out_of_band,out_of_band_other")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    report: dict[str, Any] = {"model": args.model, "history": args.history}
    history = _tokens(args.history, 1)
    limit = args.history + 512  # the baselines send the history as one chunk
    with Engine.load(
        args.model,
        kv_tokens=4 * limit,
        max_chunk_tokens=limit,
        max_pending_tokens=2 * limit,
        prefix_cache="off",  # the baselines prefill the history, as a server without the session does
    ) as engine:
        if "rewind" in scenarios:
            report["rewind_last_reply"] = _rewind_last_reply(engine, history, args.rounds, args.outputs)
        if "delete" in scenarios:
            report["delete_item"] = _delete_item(engine, history, args)
        if "out_of_band" in scenarios:
            report["out_of_band"] = _out_of_band(engine, history, args)
        if "out_of_band_other" in scenarios:
            report["out_of_band_other"] = _out_of_band_other(engine, history, args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


def _rewind_last_reply(engine: Engine, history: list[int], rounds: int, outputs: int) -> dict[str, Any]:
    """1. The last reply taken back."""
    sid = _open(engine)
    _turn(engine, sid, 0, history, 0)
    engine_us, trip_us, forwarded = [], [], []
    for r in range(rounds):
        _turn(engine, sid, 1 + r, [5], outputs)
        spent, trip, fed = _rewind_engine_us(engine, sid, KeepOutputs(1 + r, 0))
        engine_us.append(spent)
        trip_us.append(trip)
        forwarded.append(fed)
    engine.close_session(sid)
    return {
        "engine_us_median": statistics.median(engine_us),
        "engine_us": engine_us,
        "round_trip_us_median": statistics.median(trip_us),
        "tokens_forwarded": forwarded,
    }


def _delete_item(engine: Engine, history: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """2. An item k tokens from the end deleted, against the edited history prefilled whole."""
    item, after = _tokens(args.item, 2), _tokens(args.after, 3)
    base = history[: args.history - args.item - args.after]
    edit_ms, edit_fed, whole_ms, whole_fed = [], [], [], []
    for _ in range(args.rounds):
        sid = _open(engine)
        _turn(engine, sid, 0, [*base, *item, *after], 0)
        engine.rewind(sid, KeepTokens(len(base))).result(60)
        ms, fed, _ = _turn(engine, sid, 1, after, 1)
        edit_ms.append(ms)
        edit_fed.append(fed)
        engine.close_session(sid)
        sid = _open(engine)
        ms, fed, _ = _turn(engine, sid, 0, [*base, *after], 1)
        whole_ms.append(ms)
        whole_fed.append(fed)
        engine.close_session(sid)
    return {
        "k": args.item + args.after,
        "edit_ms_median": statistics.median(edit_ms),
        "edit_tokens_forwarded": edit_fed[0],
        "whole_ms_median": statistics.median(whole_ms),
        "whole_tokens_forwarded": whole_fed[0],
    }


def _out_of_band(engine: Engine, history: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """3. Out of band over the conversation, against the conversation + question prefilled whole."""
    question = _tokens(args.question, 4)
    sid, untouched = _open(engine), _open(engine)
    _turn(engine, sid, 0, history, 0)
    _turn(engine, untouched, 0, history, 0)
    oob_ms, oob_fed, cold_ms, cold_fed = [], [], [], []
    for r in range(args.rounds):
        ms, fed, _ = _turn(engine, sid, 1 + r, question, args.outputs)
        engine.rewind(sid, KeepTokens(len(history))).result(60)
        oob_ms.append(ms)
        oob_fed.append(fed)
        cold = _open(engine)
        ms, fed, _ = _turn(engine, cold, 0, [*history, *question], args.outputs)
        cold_ms.append(ms)
        cold_fed.append(fed)
        engine.close_session(cold)
    after_oob = _turn(engine, sid, 1 + args.rounds, [6, 7], 4)[2]
    assert after_oob == _turn(engine, untouched, 1, [6, 7], 4)[2], "the side answers left a trace"
    engine.close_session(sid)
    engine.close_session(untouched)
    return {
        "oob_ms_median": statistics.median(oob_ms),
        "oob_tokens_forwarded": oob_fed[0],
        "cold_ms_median": statistics.median(cold_ms),
        "cold_tokens_forwarded": cold_fed[0],
    }


def _out_of_band_other(engine: Engine, history: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """4. Out of band over the conversation's first `--kept` tokens and a question: rewind there,
    answer, rewind there again, prefill the rest again; against the kept part and the question
    prefilled whole in a fresh session."""
    question, kept = _tokens(args.question, 4), args.kept
    sid, untouched = _open(engine), _open(engine)
    _turn(engine, sid, 0, history, 0)
    _turn(engine, untouched, 0, history, 0)
    answer_ms, answer_fed, restore_ms, restore_fed, cold_ms, cold_fed = [], [], [], [], [], []
    seq = 0
    for _ in range(args.rounds):
        engine.rewind(sid, KeepTokens(kept)).result(60)
        ms, fed, _ = _turn(engine, sid, seq := seq + 1, question, args.outputs)
        answer_ms.append(ms)
        answer_fed.append(fed)
        engine.rewind(sid, KeepTokens(kept)).result(60)
        ms, fed, _ = _turn(engine, sid, seq := seq + 1, history[kept:], 0)
        restore_ms.append(ms)
        restore_fed.append(fed)
        cold = _open(engine)
        ms, fed, _ = _turn(engine, cold, 0, [*history[:kept], *question], args.outputs)
        cold_ms.append(ms)
        cold_fed.append(fed)
        engine.close_session(cold)
    after = _turn(engine, sid, seq + 1, [6, 7], 4)[2]
    assert after == _turn(engine, untouched, 1, [6, 7], 4)[2], "the side answers left a trace"
    engine.close_session(sid)
    engine.close_session(untouched)
    return {
        "kept": kept,
        "answer_ms_median": statistics.median(answer_ms),
        "answer_tokens_forwarded": answer_fed[0],
        "restore_ms_median": statistics.median(restore_ms),
        "restore_tokens_forwarded": restore_fed[0],
        "cold_ms_median": statistics.median(cold_ms),
        "cold_tokens_forwarded": cold_fed[0],
    }


if __name__ == "__main__":
    main()
