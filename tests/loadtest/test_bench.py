"""The bench end to end on small numbers, and the transformers copy of our weights against the engine.

No timing is asserted: latencies depend on the machine. What is checked is that every mode ran the
turns it should, on the same history, with the same greedy outputs, and that the outputs (table,
JSON, PNG) are well formed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loadtest.bench import hf as hf_mode
from loadtest.bench.config import BenchConfig
from loadtest.bench.hf import HfSession, near_tie_bound, run_hf, trailing
from loadtest.bench.hf_model import to_hf_llama
from loadtest.bench.report import Checks
from loadtest.bench.results import ModeRun, summarize
from loadtest.bench.run import main
from loadtest.bench.text_mode import run_text, turn_texts
from loadtest.bench.workload import Workload, input_tokens, sampled_turns
from tests.worker.reference import write_checkpoint
from worker.engine import Engine
from worker.model.loader import load_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SESSIONS, TURNS = 2, 25


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, object], Path, str]:
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(
            [
                *("--sessions", str(SESSIONS), "--turns", str(TURNS), "--kv-tokens", "8192"),
                *("--modes", "streaming,reprefill,hf", "--json", str(json_path), "--plot", str(png_path)),
            ]
        )
    return code, json.loads(json_path.read_text()), png_path, buffer.getvalue()


def test_bench_exits_zero_and_prints_the_table(bench_run: tuple[int, dict[str, object], Path, str]) -> None:
    code, _, _, stdout = bench_run
    assert code == 0, stdout
    for mode in ("streaming", "reprefill", "hf"):
        assert any(line.startswith(mode) for line in stdout.splitlines()), f"no table row for {mode}"
    assert "peak RSS" in stdout and "CHECK FAILED" not in stdout


def test_json_shape(bench_run: tuple[int, dict[str, object], Path, str]) -> None:
    _, report, _, _ = bench_run
    assert isinstance(report, dict)
    assert report["config"]["sessions"] == SESSIONS and report["config"]["turns"] == TURNS  # type: ignore[index]
    modes = report["modes"]
    assert isinstance(modes, dict) and set(modes) == {"streaming", "reprefill", "hf"}
    for name, mode in modes.items():
        turn_ms = mode["turn_ms"]
        assert len(turn_ms) == TURNS and all(len(row) == SESSIONS for row in turn_ms), name
        for turn, row in enumerate(turn_ms):
            timed = turn in mode["timed_turns"]
            assert all((ms is not None and ms > 0) if timed else ms is None for ms in row), (name, turn)
        for key in ("avg_ms", "head10_ms", "last10_ms", "tail_head"):
            assert isinstance(mode[key], float) and mode[key] > 0, (name, key)
    assert modes["streaming"]["timed_turns"] == list(range(TURNS))
    assert modes["hf"]["timed_turns"] == list(range(TURNS))
    reprefill_turns = modes["reprefill"]["timed_turns"]
    assert {0, 10, 20} <= set(reprefill_turns)
    assert set(range(TURNS - 10, TURNS)) <= set(reprefill_turns)
    assert reprefill_turns == sorted({0, 10, 20, *range(TURNS - 10, TURNS)})
    # last10 is the mean of the last ten timed turns (each averaged over sessions).
    last = [sum(modes["reprefill"]["turn_ms"][t]) / SESSIONS for t in reprefill_turns[-10:]]
    assert modes["reprefill"]["last10_ms"] == pytest.approx(sum(last) / 10)


def test_modes_agree_on_outputs(bench_run: tuple[int, dict[str, object], Path, str]) -> None:
    _, report, _, _ = bench_run
    checks = report["checks"]
    assert isinstance(checks, dict)
    assert checks["reprefill_mismatches"] == 0
    assert checks["reprefill_turns_checked"] == SESSIONS * len(sampled_turns(TURNS))
    assert checks["hf_turns_checked"] == SESSIONS * TURNS
    assert checks["hf_mismatches"] == 0
    assert checks["hf_near_ties"] == 0 and checks["hf_beyond_near_ties"] == []
    assert checks["ok"] is True
    rss = report["rss"]
    assert isinstance(rss, dict) and rss["early_mib"] > 0 and rss["last_mib"] > 0 and rss["peak_mib"] > 0


def test_the_floor_is_the_weights_read_per_step(bench_run: tuple[int, dict[str, object], Path, str]) -> None:
    _, report, _, stdout = bench_run
    floor = report["floor"]
    assert isinstance(floor, dict)
    tiny = load_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    assert floor["weight_bytes_per_step"] == tiny.weights.bytes_read_per_step()
    assert floor["copy_gbps"] > 0
    assert floor["steps_per_turn"] == BenchConfig().output_tokens  # one append, then a decode per token
    # Sessions share steps, so the run takes at least a turn's steps per turn, never fewer.
    assert floor["steps_per_turn_taken"] >= floor["steps_per_turn"]
    assert floor["turn_ms"] == pytest.approx(floor["step_ms"] * floor["steps_per_turn"])
    streaming = report["modes"]["streaming"]  # type: ignore[index]
    assert floor["streaming_x"]["avg"] == pytest.approx(streaming["avg_ms"] / floor["turn_ms"])
    faster = report["faster_than_hf"]
    assert isinstance(faster, dict) and faster["turns"] == TURNS and 0 <= faster["streaming_faster"] <= TURNS
    assert "bandwidth floor:" in stdout and f"of the {TURNS} turns both timed" in stdout


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_step_reads_every_weight_but_an_untied_embedding(kind: str, tmp_path: Path) -> None:
    original = write_checkpoint(kind, tmp_path)  # untied: lm_head is its own matrix
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    read = sum(
        param.numel() * param.element_size()
        for name, param in original.named_parameters()
        if name != "model.embed_tokens.weight"
    )
    assert loaded.weights.bytes_read_per_step() == read
    embed = original.get_input_embeddings().weight
    assert loaded.weights.num_bytes() == read + embed.numel() * embed.element_size()


def test_plot_is_a_png(bench_run: tuple[int, dict[str, object], Path, str]) -> None:
    _, _, png_path, _ = bench_run
    data = png_path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_a_reprefill_disagreement_fails_the_bench(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streaming's record of turn 5 is corrupted; reprefill, sampled there, must notice and fail."""
    original = Workload.record

    def corrupt(self: Workload, session: int, turn: int, outputs: Iterable[int]) -> None:
        tokens = list(outputs)
        if turn == 5:
            tokens[0] = (tokens[0] + 1) % 512
        original(self, session, turn, tokens)

    monkeypatch.setattr(Workload, "record", corrupt)
    code = main(["--sessions", "1", "--turns", "12", "--modes", "streaming,reprefill", "--kv-tokens", "4096"])
    out = capsys.readouterr().out
    assert code == 1
    assert "CHECK FAILED: reprefill" in out and "bench FAILED" in out


def test_streaming_is_required_and_modes_are_validated() -> None:
    with pytest.raises(ValueError, match="streaming"):
        BenchConfig(modes=("reprefill",))
    with pytest.raises(ValueError, match="unknown"):
        BenchConfig(modes=("streaming", "vllm"))
    assert BenchConfig(modes=("hf", "streaming")).modes == ("streaming", "hf")


def test_workload_is_deterministic_and_in_range() -> None:
    a = input_tokens(3, 1, 7, 64, 512)
    assert a == input_tokens(3, 1, 7, 64, 512)
    assert a != input_tokens(3, 1, 8, 64, 512) and a != input_tokens(4, 1, 7, 64, 512)
    assert all(0 <= t < 512 for t in a)
    assert sampled_turns(300) == [*range(0, 290, 10), *range(290, 300)]
    assert sampled_turns(5) == [0, 1, 2, 3, 4]


def test_summary_excludes_turn_zero_and_uses_the_tail() -> None:
    run = ModeRun.empty("x", sessions=2, turns=30)
    for turn in range(30):
        run.turn_ms[turn] = [1000.0, 1000.0] if turn == 0 else [float(turn), float(turn) + 2]
    summary = summarize(run)
    assert summary.head10_ms == pytest.approx(sum(t + 1 for t in range(1, 11)) / 10)
    assert summary.last10_ms == pytest.approx(sum(t + 1 for t in range(20, 30)) / 10)
    assert summary.avg_ms == pytest.approx(sum(t + 1 for t in range(1, 30)) / 29)


# ---- the transformers copy of the weights ----------------------------------------------------------


def test_hf_copy_reproduces_the_engines_greedy_session() -> None:
    """Engine turns (with their logprobs) against the converted model: one whole-sequence forward,
    and the turn-by-turn cache loop the hf mode runs."""
    rng = random.Random(11)
    loaded = load_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    model = to_hf_llama(loaded)
    plan = [
        ([rng.randrange(512) for _ in range(rng.randint(3, 30))], rng.choice([1, 3, 6])) for _ in range(6)
    ]
    with Engine.load("tiny", kv_tokens=4096) as engine:
        sid = engine.open_session(stop_token_ids=(), logprobs=True)
        turns = [engine.run_turn(sid, tokens=chunk, max_output_tokens=k, timeout=60) for chunk, k in plan]
    sequence: list[int] = []
    outputs: list[tuple[int, int, float]] = []
    for (chunk, _), turn in zip(plan, turns, strict=True):
        sequence += chunk
        assert turn.logprobs is not None
        for token, logprob in zip(turn.tokens, turn.logprobs, strict=True):
            outputs.append((len(sequence), token, logprob))
            sequence.append(token)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), dim=-1)
        for position, token, logprob in outputs:
            assert int(logprobs[position - 1].argmax()) == token, (
                f"greedy token differs at position {position}"
            )
            assert float(logprobs[position - 1, token]) == pytest.approx(logprob, abs=1e-4)

        session = HfSession(model)
        pending: list[int] = []
        for (chunk, _), turn in zip(plan, turns, strict=True):
            assert session.turn(pending + chunk, turn.tokens) == (turn.tokens, 0.0)
            pending = [turn.tokens[-1]]

        # Forced onto the token its own logits like least, the session reports how far it trails:
        # far beyond what float32's rounding explains.
        session = HfSession(model)
        chunk = plan[0][0]
        worst = int(model(torch.tensor([chunk])).logits[0, -1].argmin())
        generated, trails = session.turn(chunk, (worst,))
        assert generated != (worst,)
        assert trails > 0.5 > near_tie_bound(torch.float32)


def test_a_near_tie_trails_by_the_dtypes_rounding_and_a_fault_by_more() -> None:
    row = torch.tensor([40.0, 39.5, -3.0, 12.0])  # a range of 43
    assert trailing(row, 0) == 0.0
    assert trailing(row, 1) == pytest.approx(0.5 / 43)
    assert trailing(row, 2) == pytest.approx(1.0)
    assert near_tie_bound(torch.bfloat16) == pytest.approx(16 * 2**-7)  # 0.125: 5.4 logits here
    assert trailing(row, 1) <= near_tie_bound(torch.bfloat16) < trailing(row, 3)
    assert trailing(row, 1) > near_tie_bound(torch.float32)  # float32 explains no such gap
    # A row that cannot tell a tie from a fault never excuses one.
    assert trailing(torch.zeros(5), 3) == math.inf  # a broken model ties every token
    assert trailing(torch.tensor([1.0, float("nan"), 0.5]), 2) == math.inf
    assert trailing(row, 4) == math.inf and trailing(row, -1) == math.inf


def test_hf_counts_a_differing_turn_as_a_near_tie_only_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded = load_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    config = BenchConfig(model="tiny", sessions=1, turns=3, input_tokens=5, output_tokens=2)
    workload = Workload(sessions=1, turns=3, input_count=5, output_count=2, vocab_size=512, seed=0)
    greedy = HfSession(to_hf_llama(loaded))
    pending: list[int] = []
    with torch.inference_mode():
        for turn in range(3):
            first = int(greedy.feed(pending + workload.inputs[0][turn]).argmax())
            last = int(greedy.feed([first]).argmax())
            outputs = (first, last)
            if turn == 2:  # the last token of the last turn: only that position then differs
                outputs = (first, (last + 1) % 512)
            workload.record(0, turn, outputs)
            pending = [outputs[-1]]
    run = run_hf(loaded, workload, config)
    assert (run.checked, run.mismatches, run.near_ties) == (3, [(0, 2)], [])
    monkeypatch.setattr(hf_mode, "near_tie_bound", lambda dtype: 2.0)  # every finite trail is a tie
    run = run_hf(loaded, workload, config)
    assert (run.mismatches, run.near_ties) == ([(0, 2)], [(0, 2)])


def test_hf_fails_only_on_turns_that_differ_beyond_a_near_tie() -> None:
    differing = tuple((0, turn) for turn in range(10))
    ties = Checks(
        0, (), hf_checked=20, hf_mismatches=differing, hf_mismatch_limit=0.05, hf_near_ties=differing
    )
    assert ties.hf_ok and ties.ok
    one_clear = replace(ties, hf_near_ties=differing[1:])  # 1 of 20 turns: within 5%
    assert one_clear.hf_ok
    two_clear = replace(ties, hf_near_ties=differing[2:])  # 2 of 20: beyond it
    assert not two_clear.hf_ok and not two_clear.ok


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_copy_equals_the_original_checkpoint(kind: str, tmp_path: Path) -> None:
    """Round trip through our loader and back: llama3 rope scaling and Qwen2's q/k/v biases survive."""
    original = write_checkpoint(kind, tmp_path, seed=3)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    copy = to_hf_llama(loaded)
    tokens = torch.tensor([random.Random(5).choices(range(loaded.config.vocab_size), k=90)])
    with torch.inference_mode():
        expected = original(tokens).logits
        actual = copy(tokens).logits
    assert torch.allclose(actual, expected, atol=1e-4), float((actual - expected).abs().max())


def test_text_mode_times_every_turn_and_commits_the_whole_text() -> None:
    config = BenchConfig(sessions=2, turns=12, modes=("streaming", "text"), kv_tokens=4096)
    with Engine.load("tiny", kv_tokens=4096) as engine:
        texts = turn_texts(engine, config)
        run = run_text(engine, config)
        assert engine.tokenizer is not None
        # What a session streams is the prose, unchanged; each turn about `input_tokens` tokens.
        assert all(len(engine.tokenizer.encode(t)) == config.input_tokens for t in texts[0])
    assert run.timed_turns == list(range(12)) and run.name == "text"
