"""Structured output's cost: a constrained micro-turn against an unconstrained one of the same length.

    python -m loadtest.grammar_bench [--model smollm2-135m] [--outputs 32] [--rounds 8]

Both turns decode `--outputs` tokens after the same prompt (prefilled first, untimed), on fresh
sessions with `stop_token_ids: []`, so neither stops early: the constrained one under a JSON schema
whose one string must be longer than the turn (`minLength`), so the grammar never completes and
its mask is a JSON string's, the common case. They alternate, constrained then unconstrained, for
`--rounds` rounds, and the figure is the ratio of their medians of the engine's `compute_ms`. The
mask's own cost per token is measured apart on the constrained turns' own tokens: a matcher fills
its bitmask row and the row is masked, as the step does (`worker/engine/grammar.py`). Compiles are
timed three times: a small schema on a cold engine (xgrammar's tokenizer info built first), a new
small schema once the compiler exists, and the benchmark's own (a long `minLength`); then the
OpenAI dialect's tool grammars for one function tool (gateway/openai/tools.py): `required` (one
call) and `auto` (text, or a call once `<tool_call>` is written), and the `auto` grammar's mask
per token over a reply of text and then a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import xgrammar as xgr

from gateway.openai.tools import FunctionTool, call_text, constraint
from worker.engine import Engine
from worker.engine.grammar import apply_masks

QUESTION = "Describe Paris in a long paragraph."
TOOL = FunctionTool(
    "get_weather",
    "The current weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def schema(min_length: int) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"summary": {"type": "string", "minLength": min_length}},
        "required": ["summary"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.grammar_bench", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--outputs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)

    fmt: dict[str, object] = {"type": "json_schema", "schema": schema(args.outputs * 16)}
    with Engine.load(args.model, kv_tokens=16384) as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        prompt = tokenizer.encode(tokenizer.chat_prompt(QUESTION))
        grammars = engine.grammars

        # The first format on a fresh engine (tokenizer info built first, as `prepare` would at a
        # worker's start), a new one of the same size after it, then the benchmark's own (a string
        # of `minLength` 16 x outputs: xgrammar unrolls the repetition, its compile grows with it).
        started = time.perf_counter()
        engine.compile_format({"type": "json_schema", "schema": schema(7)}).result()
        cold_ms = (time.perf_counter() - started) * 1000.0
        engine.compile_format({"type": "json_schema", "schema": schema(8)}).result()
        warm_ms = grammars.last_compile_ms
        engine.compile_format(fmt).result()
        long_ms = grammars.last_compile_ms
        tool_ms = {}
        for choice in ("required", "auto"):
            tool_format = constraint((TOOL,), choice)
            assert tool_format is not None
            engine.compile_format({"type": "structural_tag", "tag": tool_format.tag}).result()
            tool_ms[choice] = grammars.last_compile_ms

        def turn(constrained: bool) -> tuple[float, tuple[int, ...]]:
            sid = engine.open_session(stop_token_ids=[])
            engine.run_turn(sid, tokens=prompt[:-1], timeout=600)
            result = engine.run_turn(
                sid,
                tokens=prompt[-1:],
                max_output_tokens=args.outputs,
                response_format=fmt if constrained else None,
                timeout=600,
            )
            engine.close_session(sid)
            assert len(result.tokens) == args.outputs, result
            return result.compute_ms, result.tokens

        turn(True), turn(False)  # warm-up
        constrained_ms: list[float] = []
        free_ms: list[float] = []
        outputs: list[tuple[int, ...]] = []
        for _ in range(args.rounds):
            ms, tokens = turn(True)
            constrained_ms.append(ms)
            outputs.append(tokens)
            free_ms.append(turn(False)[0])

        compiled = engine.compile_format(fmt).result()
        width = engine.model_config.vocab_size
        logits = torch.zeros(1, width)
        mask_s = 0.0
        masked = 0
        for tokens in outputs:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            for token in tokens:
                started = time.perf_counter()
                apply_masks(logits, [matcher])
                mask_s += time.perf_counter() - started
                masked += 1
                assert matcher.accept_token(token)

        # The `auto` tool grammar's mask over a reply that writes text and then a call: the text
        # part is free text watched for `<tool_call>`, the call part a JSON schema's.
        tool_format = constraint((TOOL,), "auto")
        assert tool_format is not None
        tool_grammar = engine.compile_format({"type": "structural_tag", "tag": tool_format.tag}).result()
        reply = tokenizer.encode(
            "Let me check the weather for you. " + call_text("get_weather", '{"city": "Paris"}')
        )
        tool_mask_s = 0.0
        for _ in range(args.rounds):
            matcher = xgr.GrammarMatcher(tool_grammar, terminate_without_stop_token=True)
            for token in reply:
                started = time.perf_counter()
                apply_masks(logits, [matcher])
                tool_mask_s += time.perf_counter() - started
                assert matcher.accept_token(token)

    constrained = statistics.median(constrained_ms)
    free = statistics.median(free_ms)
    report = {
        "outputs_per_turn": args.outputs,
        "rounds": args.rounds,
        "constrained_turn_ms_median": round(constrained, 2),
        "unconstrained_turn_ms_median": round(free, 2),
        "ratio": round(constrained / free, 3),
        "mask_us_per_token": round(mask_s / masked * 1e6, 1),
        "first_compile_cold_worker_ms": round(cold_ms, 1),
        "new_schema_compile_ms": round(warm_ms, 2),
        "bench_schema_compile_ms": round(long_ms, 1),
        "tool_required_compile_ms": round(tool_ms["required"], 1),
        "tool_auto_compile_ms": round(tool_ms["auto"], 1),
        "tool_auto_mask_us_per_token": round(tool_mask_s / (len(reply) * args.rounds) * 1e6, 1),
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
