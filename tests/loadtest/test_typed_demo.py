"""The typed-demo benchmark (issue #32, point 5): the page's typing logic without sockets, then the
whole bench at a tiny size on a real stack.

No timing is asserted (timings are the benchmark's to print). What is checked: the composer cuts
pieces exactly as gateway/static/index.html does (words only once whitespace follows them, the user
turn opened once a message, pieces at most MAX_PIECE_CHARS cut before a space, nothing while a reply
runs, the glue after it); a message's chunks are the message, on the page's ticks, the same every
run; and the bench's report counts what it sent and every figure it promises (on one form:
`--compare` only repeats the run, a stack per form).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import psutil
import pytest

from loadtest.typed_demo import MESSAGES, Chunk, Composer, PageScript, main, parse, plan_message, script

PAGE = PageScript.read()


def test_the_page_script_is_read_from_the_page() -> None:
    assert PAGE.tick_ms == 200 and PAGE.reply_tokens == 128 and PAGE.max_piece_chars == 200
    assert PAGE.open_config == {
        "max_output_tokens": 0,
        "stream": True,
        "temperature": 0,
        "context_policy": "truncate",
        "keep_prefix_tokens": 21,
    }
    assert PAGE.user_open == "<|im_start|>user\n" and PAGE.end == "<|im_end|>"
    assert PAGE.assistant_open == "<|im_end|>\n<|im_start|>assistant\n"


def test_words_go_out_once_finished_and_the_rest_with_the_reply() -> None:
    composer = Composer(PAGE, reply_tokens=7)
    assert composer.tick("Hel") is None
    assert composer.tick("Hello") is None  # a word is finished only by the whitespace after it
    assert composer.tick("  Hello ") == Chunk("input", PAGE.user_open + "Hello", 0)
    assert composer.tick("  Hello wo") is None
    # Up to the last whitespace after a word; the space before a word stays on it.
    assert composer.tick("  Hello world,  how") == Chunk("input", " world,", 0)
    reply = composer.send_message("  Hello world,  how are ")
    assert reply == Chunk("reply", "  how are" + PAGE.assistant_open, 7)
    # Nothing while the reply runs, whatever is typed meanwhile.
    assert composer.tick("Next one ") is None
    assert composer.send_message("Next one") is None
    assert composer.reply_done(closed_by_model=False) == Chunk("glue", PAGE.end + "\n", 0)
    # The next message opens its own user turn, its leading whitespace dropped.
    assert composer.tick("  Next one") == Chunk("input", PAGE.user_open + "Next", 0)
    assert composer.send_message("  Next one ") == Chunk("reply", " one" + PAGE.assistant_open, 7)
    assert composer.reply_done(closed_by_model=True) == Chunk("glue", "\n", 0)


def test_a_pasted_text_goes_out_in_pieces_cut_before_a_space() -> None:
    composer = Composer(PAGE, reply_tokens=1)
    pasted = "abcd " * 90  # 450 characters, committed whole at the first tick
    pieces = [composer.tick(pasted) for _ in range(4)]
    assert pieces[3] is None
    texts = [piece.text for piece in pieces if piece is not None]
    assert texts[0] == PAGE.user_open + pasted[:199]  # the last space at or before 200 is at 199
    assert texts[1:] == [pasted[199:399], pasted[399:449]]
    # With no space to cut before, the cut is at MAX_PIECE_CHARS.
    composer = Composer(PAGE, reply_tokens=1)
    assert composer.send_message("x" * 450) == Chunk("input", PAGE.user_open + "x" * 200, 0)
    assert composer.tick("") == Chunk("input", "x" * 200, 0)
    assert composer.tick("") == Chunk("reply", "x" * 50 + PAGE.assistant_open, 1)


@pytest.mark.parametrize("wpm", [60.0, 2000.0])
def test_a_message_is_sent_as_the_same_chunks_on_the_pages_ticks(wpm: float) -> None:
    tick_s = PAGE.tick_ms / 1000
    composer = Composer(PAGE, reply_tokens=5)
    for index, text in enumerate(MESSAGES):
        plan = plan_message(composer, text, wpm, seed=index)
        assert plan == plan_message(Composer(PAGE, 5), text, wpm, seed=index)  # fixed for a seed
        assert [timed.chunk.kind for timed in plan] == ["input"] * (len(plan) - 1) + ["reply"]
        sent = "".join(timed.chunk.text for timed in plan)
        assert sent == PAGE.user_open + text + PAGE.assistant_open
        assert all(len(timed.chunk.text) <= len(PAGE.user_open) + PAGE.max_piece_chars for timed in plan[:-1])
        times = [timed.at_s for timed in plan]
        assert times == sorted(set(times))  # at most one chunk a tick
        assert all(abs(at / tick_s - round(at / tick_s)) < 1e-9 for at in times[:-1])
        assert composer.reply_done(closed_by_model=True).kind == "glue"


def test_slower_typing_sends_more_and_smaller_chunks() -> None:
    slow, fast = (len(plan_message(Composer(PAGE, 5), MESSAGES[0], wpm, seed=0)) for wpm in (60, 600))
    assert slow > fast > 1


def test_compare_runs_the_forms_in_order_and_bad_options_are_refused() -> None:
    assert parse(["--compare", "float,auto"])[0] == ("float", "auto")
    assert parse(["--weights", "int8"])[0] == ("int8",)
    for argv in (["--compare", "float,fp8"], ["--messages", "0"], ["--words", "0"], ["--wpm", "0"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            parse(argv)


def test_the_report_counts_what_the_page_sent(tmp_path: Path) -> None:
    json_path = tmp_path / "typed.json"
    argv = ["--model", "tiny", "--weights", "float", "--messages", "2", "--words", "3"]
    argv += ["--reply-tokens", "3", "--wpm", "300", "--json", str(json_path)]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == [], [p.cmdline() for p in left]

    report = json.loads(json_path.read_text())
    composer = Composer(PAGE, 3)
    planned = []
    for index, text in enumerate(script(2, 3)):
        planned += plan_message(composer, text, 300, seed=index)
        composer.reply_done(closed_by_model=True)
    inputs = sum(1 for timed in planned if timed.chunk.kind == "input")
    assert inputs >= 2
    assert report["machine"]["threads"] > 0 and report["machine"]["cpu"]
    assert [run["weights"] for run in report["runs"]] == ["float"]
    for run in report["runs"]:
        assert run["chunks"] == {"system": 1, "input": inputs, "reply": 2, "glue": 2}
        assert run["input_chars"] == sum(len(t.chunk.text) for t in planned if t.chunk.kind == "input")
        assert run["errors"] == [] and run["unanswered"] == 0
        assert run["input_ms"]["count"] == inputs
        for name in ("input_ms", "reply_first_token_ms", "reply_done_ms"):
            assert set(run[name]) == {"count", "p50", "p99", "max"}
            assert 0 < run[name]["p50"] <= run[name]["p99"] <= run[name]["max"]
        assert run["reply_first_token_ms"]["count"] == run["reply_done_ms"]["count"] == 2
        assert len(run["reply_output_tokens"]) == 2
        assert all(1 <= n <= 3 for n in run["reply_output_tokens"])
        host = run["host"]
        assert host["loadavg_1m_before"] >= 0 and host["loadavg_1m_after"] >= 0
        assert isinstance(host["quiet"], bool) and host["other_cpu_share"] >= 0
    table = printed.getvalue()
    for label in ("input micro-turn p50 ms", "input micro-turn p99 ms", "reply first token p50 ms"):
        assert label in table
    assert "float" in table and "load average" in table and "machine:" in table
