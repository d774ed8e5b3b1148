"""Structured output with real weights (SmolLM2-135M from the GGUF): `response_format` through the
engine, its output parsed, the same tokens as transformers under xgrammar's own logits processor
(a JSON schema, and a tool-call conversation under the OpenAI dialect's structural tags),
unconstrained rows batched with it unchanged, and bad formats refused having changed nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from gateway.openai.tools import (
    FunctionTool,
    NamedFunction,
    ToolChoice,
    constraint,
    output_content,
    system_content,
)
from shared.errors import InvalidMessage
from shared.protocol.response_format import MAX_SCHEMA_BYTES
from tests.worker.smollm2 import engine_on
from worker.engine import Engine
from worker.engine.turn import TurnResult
from worker.model.loader import LoadedModel

pytestmark = pytest.mark.slow

# Bounded everywhere (lengths, an integer range, no extra keys), so a greedy turn completes it.
CITY_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
CITY_FORMAT: dict[str, object] = {"type": "json_schema", "schema": CITY_SCHEMA}
QUESTION = "Describe the capital of France as JSON."


@pytest.fixture(scope="module")
def engine(smollm2_model: LoadedModel) -> Iterator[Engine]:
    # On the run's one SmolLM2 load (tests/worker/smollm2.py): the float weights, as `auto` picks on
    # the CPU, and as transformers runs them.
    with engine_on(smollm2_model, kv_tokens=8192) as engine:
        yield engine


@pytest.fixture(scope="module")
def transformers_model(hf_smollm2: Any, hf_smollm2_tokenizer: Any) -> tuple[Any, Any]:
    """SmolLM2 in transformers, from the same GGUF: (tokenizer, model), the run's shared loads
    (tests/worker/conftest.py)."""
    return hf_smollm2_tokenizer, hf_smollm2


def xgrammar_compiler(transformers_model: tuple[Any, Any]) -> Any:
    import xgrammar as xgr

    hf_tokenizer, model = transformers_model
    info = xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[hf_tokenizer.eos_token_id]
    )
    return xgr.GrammarCompiler(info)


def generate_under(
    transformers_model: tuple[Any, Any], compiled: Any, tokens: list[int], limit: int
) -> list[int]:
    """Greedy transformers decoding of `tokens` under xgrammar's own logits processor (none:
    `compiled` None)."""
    import xgrammar as xgr

    hf_tokenizer, model = transformers_model
    processors = [] if compiled is None else [xgr.contrib.hf.LogitsProcessor(compiled)]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([tokens]),
            max_new_tokens=limit,
            do_sample=False,
            eos_token_id=hf_tokenizer.eos_token_id,
            logits_processor=processors,
        )
    return list(generated[0, len(tokens) :].tolist())


def prompt(engine: Engine, question: str = QUESTION) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(engine.tokenizer.chat_prompt(question))


def body_text(engine: Engine, result: TurnResult) -> str:
    """The turn's text without its final stop token (the EOS the grammar ends with)."""
    assert engine.tokenizer is not None and result.finish == "stop"
    assert result.tokens[-1] in engine.tokenizer.eos_token_ids
    return engine.tokenizer.decode(result.tokens[:-1])


def test_a_json_schema_turn_parses_and_matches_the_schema(engine: Engine) -> None:
    sid = engine.open_session()
    result = engine.run_turn(
        sid, tokens=prompt(engine), max_output_tokens=80, response_format=CITY_FORMAT, timeout=300
    )
    value = json.loads(body_text(engine, result))
    assert set(value) == {"city", "country", "population_millions"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 16
    assert isinstance(value["population_millions"], int) and 0 <= value["population_millions"] <= 99


def test_choice_and_regex_turns_and_a_session_default_compiled_once(engine: Engine) -> None:
    choices = ["Paris", "Lyon", "Marseille"]
    sid = engine.open_session()
    picked = engine.run_turn(
        sid,
        tokens=prompt(engine, "Which city is the capital of France?"),
        max_output_tokens=10,
        response_format={"type": "choice", "choices": choices},
        timeout=300,
    )
    assert body_text(engine, picked) in choices
    sid = engine.open_session()
    year = engine.run_turn(
        sid,
        tokens=prompt(engine, "In which year did the French Revolution begin?"),
        max_output_tokens=10,
        response_format={"type": "regex", "pattern": "1[0-9]{3}"},
        timeout=300,
    )
    assert len(body_text(engine, year)) == 4 and body_text(engine, year).isdigit()

    grammars = engine._core.grammars
    default = {"type": "choice", "choices": ["yes", "no"]}
    sid = engine.open_session(response_format=default)
    compiles = grammars.compiles
    for question in ("Is Paris in France?", "Is Paris in Spain?"):
        text = "<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n"
        answer = engine.run_turn(sid, text=text, max_output_tokens=5, timeout=300)
        assert body_text(engine, answer) in ("yes", "no")
    # A turn of its own format replaces the default for that turn only.
    own = engine.run_turn(
        sid,
        text="<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
        max_output_tokens=5,
        response_format={"type": "choice", "choices": ["red", "blue"]},
        timeout=300,
    )
    assert body_text(engine, own) in ("red", "blue")
    assert grammars.compiles == compiles + 1  # the default was compiled before the open; `own` once


def test_bad_formats_are_refused_and_the_seq_is_not_consumed(engine: Engine) -> None:
    sid = engine.open_session()
    assert engine.run_turn(sid, tokens=[1, 2], seq=0, timeout=60).seq == 0
    huge = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    bad: list[tuple[dict[str, object], str]] = [
        ({"type": "json_schema", "schema": {"type": "nonsense"}}, "grammar library: Unsupported type"),
        ({"type": "regex", "pattern": "[a-"}, "grammar library: Regex parsing error"),
        (
            {"type": "structural_tag", "tag": {"type": "structural_tag", "format": {"type": "nope"}}},
            "grammar library: Invalid structural tag error: Format type not recognized",
        ),
        ({"type": "json_schema", "schema": huge}, "exceeds"),
        ({"type": "choice", "choices": []}, "choices"),
        ({"type": "grammar", "pattern": "x"}, "type"),
        ({"type": "regex", "pattern": "a", "schema": {}}, "unknown field"),
    ]
    for fmt, message in bad:
        with pytest.raises(InvalidMessage, match=message):
            engine.submit(sid, tokens=[3], seq=1, max_output_tokens=4, response_format=fmt).result(60)
    with pytest.raises(InvalidMessage, match="grammar library"):
        engine.open_session(response_format={"type": "regex", "pattern": "(("})
    # Nothing changed: seq 1 is still free and the session's sequence is as it was.
    after = engine.run_turn(sid, tokens=[3], seq=1, timeout=60)
    assert after.seq == 1 and after.length == 3


def test_the_same_tokens_as_transformers_under_xgrammar_and_unconstrained_rows_unchanged(
    engine: Engine, transformers_model: tuple[Any, Any]
) -> None:
    tokens = prompt(engine)
    other = prompt(engine, "What is the capital of Germany?")
    alone_sid = engine.open_session()
    alone = engine.run_turn(alone_sid, tokens=other, max_output_tokens=30, timeout=300)

    # The constrained turn and the unconstrained one in the same steps.
    constrained_sid, free_sid = engine.open_session(), engine.open_session()
    engine.run_turn(constrained_sid, tokens=tokens[:-1], timeout=300)
    engine.run_turn(free_sid, tokens=other[:-1], timeout=300)
    steps = engine.stats().steps
    pending: list[Future[TurnResult]] = [
        engine.submit(constrained_sid, tokens=tokens[-1:], max_output_tokens=80, response_format=CITY_FORMAT),
        engine.submit(free_sid, tokens=other[-1:], max_output_tokens=30),
    ]
    constrained, free = (future.result(300) for future in pending)
    assert engine.stats().steps - steps < len(constrained.tokens) + len(free.tokens)  # they shared steps
    assert free.tokens == alone.tokens
    assert constrained.finish == "stop"

    compiled = xgrammar_compiler(transformers_model).compile_json_schema(
        json.dumps(CITY_SCHEMA), any_whitespace=False
    )
    assert list(constrained.tokens) == generate_under(transformers_model, compiled, tokens, 80)


WEATHER = FunctionTool(
    "get_weather",
    "The current weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
CALL_HEAD = '<tool_call>\n{"name": "get_weather", "arguments": '


def test_a_tool_call_conversation_is_transformers_over_the_chat_template(
    engine: Engine, transformers_model: tuple[Any, Any]
) -> None:
    """A call under a named tool_choice, its output, then a reply under `auto`: the session's
    tokens equal transformers decoding the whole conversation, rendered by the model's chat
    template through transformers, under xgrammar's processor compiled from the same structural
    tag (the OpenAI dialect's, gateway/openai/tools.py)."""
    hf_tokenizer, _ = transformers_model
    compiler = xgrammar_compiler(transformers_model)
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    eos = set(tokenizer.eos_token_ids)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system_content("Answer briefly.", (WEATHER,)) or ""},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    sid = engine.open_session()
    history: list[int] = []  # the conversation's tokens, replies as generated
    rendered = ""  # what `history` holds, as the template renders it
    choices: list[ToolChoice] = [NamedFunction("get_weather"), "auto"]
    for turn, choice in enumerate(choices):
        prompt_text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert prompt_text.startswith(rendered)
        new = tokenizer.encode(prompt_text[len(rendered) :])
        history += new
        fmt = constraint((WEATHER,), choice)
        wire = None if fmt is None else {"type": "structural_tag", "tag": fmt.tag}
        result = engine.run_turn(sid, tokens=new, max_output_tokens=40, response_format=wire, timeout=300)
        compiled = None if fmt is None else compiler.compile_structural_tag(json.dumps(fmt.tag))
        assert list(result.tokens) == generate_under(transformers_model, compiled, history, 40), turn
        stopped = result.finish == "stop" and result.tokens[-1] in eos
        reply = tokenizer.decode(result.tokens[:-1] if stopped else result.tokens)
        print(f"[tools] turn {turn + 1} ({choice}): {reply!r}")
        if turn == 0:  # a well-formed call of the function, matching its schema
            assert stopped and reply.startswith(CALL_HEAD) and reply.endswith("}\n</tool_call>")
            assert set(json.loads(reply[len(CALL_HEAD) : -len("}\n</tool_call>")])) == {"city"}
        history += list(result.tokens)
        rendered = prompt_text + reply + (tokenizer.decode(result.tokens[-1:]) if stopped else "")
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": output_content('{"temperature_c": 21}')},
        ]
    engine.close_session(sid)


def test_prepare_builds_the_compiler_on_the_grammar_thread_and_says_when_it_is_done(engine: Engine) -> None:
    """A worker waits for this future before it serves (worker/server/main.py): built beside its
    first sessions, xgrammar's imports held the GIL and their first chunks waited 100-300 ms."""
    import xgrammar as xgr

    prepared = engine.grammars.prepare()
    assert prepared is not None  # SmolLM2's 49,152 tokens are past PREPARE_MIN_VOCAB
    compiler = prepared.result(timeout=120)
    assert isinstance(compiler, xgr.GrammarCompiler)
    again = engine.grammars.prepare()
    assert again is not None and again.result(timeout=120) is compiler  # built once
