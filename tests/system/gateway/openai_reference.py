"""The reference an OpenAI-dialect conversation must equal, token for token: greedy generation over
the conversation rendered whole by the model's chat template, each reply kept exactly as it was
generated (its tokens, never re-tokenized from its text). The generator is each plan's `reference`:
transformers' own model of the same GGUF (`"transformers"`: the prefix cache's conversations, #33,
held to a model that shares nothing with the engine) or the engine alone, fed the whole
conversation in a fresh session (`"engine"`, the default).

Why a subprocess: it loads SmolLM2 with its own torch settings, away from the pytest process, and
runs while the stack starts. Why one for the run: every conversation the OpenAI tests hold is
computed on one load of the model (`PLANS`; the load costs far more than the few turns), once per
test run (the `openai_references` fixture). Run as `python -m tests.system.gateway.openai_reference
[TRANSFORMERS_DIR]` (the run's conversion of SmolLM2, tests/transformers_smollm2.py, which plans
held to transformers load) with JSON plans on stdin, {name: {"instructions": str | null, "turns": [str, ...],
"max_output_tokens": int, "reference": "engine" | "transformers" (optional)}}; prints
{name: {"replies": [[token ids], ...], "texts": [str, ...]}}.
A plan with tools (issue #36) adds "tools" (OpenAI function tools) and "choices" (each response's
tool_choice): the system message lists the tools, a turn may be {"output": str} (a call's output),
each reply is generated under the grammar its choice asks for (gateway/openai/tools.py; the engine
reference only), and its text is the reply as generated, a call's text included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tests.processes import REPO

if TYPE_CHECKING:  # the engine is imported in the subprocess only, never by the tests
    from worker.tokenizer.tokenizer import Tokenizer

# A generator: the whole conversation's tokens and a reply's limit -> the reply's tokens (with the
# EOS it stopped at, if it did).
Generate = Callable[[list[int], int, dict[str, Any] | None], list[int]]

INSTRUCTIONS: Final = "You are a helpful assistant. Answer briefly."
TURNS: Final = ["What is the capital of France?", "And of Italy?"]
STORY: Final = "Write a long story about a dragon who learns to bake bread."
# Long enough to fill several KV pages once the chat template renders it as the system message
# (test_openai_prefix.py: two conversations share its pages).
PREFIX_INSTRUCTIONS: Final = " ".join(
    f"Rule {i}: be brief, be exact, and name the country of every city you mention." for i in range(12)
)
# A function tool (test_openai_tools.py), its question and the output its call gets.
WEATHER_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# An out-of-band response over a question of its own only (test_openai_edits.py, #35): answered
# after the instructions, as if no conversation were there.
SIDE_QUESTION: Final = "In one word: is this a greeting?"
SIDE_TOKENS: Final = 4
WEATHER_QUESTION: Final = "What is the weather in Paris?"
WEATHER_OUTPUT: Final = '{"temperature_c": 21, "sky": "clear"}'
# The conversations of the OpenAI tests, by name, on the engine (one process for the run, the
# `openai_references` fixture): test_openai.py's two turns and its story, the same two turns with
# the shorter replies test_openai_sdks.py asks for, test_openai_edits.py's out-of-band question
# alone, and test_openai_tools.py's call (`required`), its output and the reply after it (`auto`).
PLANS: Final[dict[str, dict[str, Any]]] = {
    "turns": {"instructions": INSTRUCTIONS, "turns": TURNS, "max_output_tokens": 24},
    "story": {"instructions": None, "turns": [STORY], "max_output_tokens": 48},
    "sdk_turns": {"instructions": INSTRUCTIONS, "turns": TURNS, "max_output_tokens": 12},
    "side_question": {
        "instructions": INSTRUCTIONS,
        "turns": [SIDE_QUESTION],
        "max_output_tokens": SIDE_TOKENS,
    },
    "tool_turns": {
        "instructions": INSTRUCTIONS,
        "tools": [WEATHER_TOOL],
        "turns": [WEATHER_QUESTION, {"output": WEATHER_OUTPUT}],
        "choices": ["required", "auto"],
        "max_output_tokens": 40,
    },
}
# The same two turns with the long instructions test_openai_prefix.py shares between two
# conversations, held to transformers (its own process: transformers' GGUF load is about a minute
# on a busy machine, so it starts once the stack is up instead of competing with the workers' boot).
PREFIX_PLANS: Final[dict[str, dict[str, Any]]] = {
    "prefix_turns": {
        "instructions": PREFIX_INSTRUCTIONS,
        "turns": TURNS,
        "max_output_tokens": 24,
        "reference": "transformers",
    },
}


def compute_all(plans: dict[str, dict[str, Any]], transformers_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Every plan's reference, on one load of the model their `reference` names (one per process);
    transformers' model is the run's conversion in `transformers_dir` (tests/transformers_smollm2.py)."""
    (reference,) = {plan.get("reference", "engine") for plan in plans.values()}
    if reference == "transformers":
        assert transformers_dir is not None, "a transformers plan needs the run's conversion directory"
        return _by_transformers(plans, transformers_dir)
    return _by_engine(plans)


def _by_engine(plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    from worker.engine import Engine

    with Engine.load("smollm2-135m", kv_tokens=8192) as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None

        def generate(history: list[int], limit: int, grammar: dict[str, Any] | None) -> list[int]:
            # A fresh session fed the whole conversation at once: nothing cached from earlier turns.
            sid = engine.open_session(max_output_tokens=limit)
            result = engine.run_turn(
                sid, tokens=history, seq=1, max_output_tokens=limit, response_format=grammar, timeout=600
            )
            engine.close_session(sid)
            return list(result.tokens)

        return {name: compute(generate, tokenizer, plan) for name, plan in plans.items()}


def _by_transformers(plans: dict[str, dict[str, Any]], transformers_dir: Path) -> dict[str, dict[str, Any]]:
    """transformers' own model of the GGUF (its weights converted by transformers, not by the
    engine's loader); the prompt's tokens and the template are the GGUF's, as the worker reads them."""
    import gguf
    import torch

    from tests import transformers_smollm2
    from worker.model.presets import smollm2_gguf_path
    from worker.tokenizer.gguf import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf_path()))
    model = transformers_smollm2.model(transformers_dir)

    def generate(history: list[int], limit: int, grammar: dict[str, Any] | None) -> list[int]:
        assert grammar is None, "a plan with tools is held to the engine's reference"
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([history]),
                max_new_tokens=limit,
                do_sample=False,
                eos_token_id=list(tokenizer.eos_token_ids),
                pad_token_id=tokenizer.eos_token_ids[0],
            )
        return [int(t) for t in generated[0, len(history) :]]

    return {name: compute(generate, tokenizer, plan) for name, plan in plans.items()}


def compute(generate: Generate, tokenizer: Tokenizer, plan: dict[str, Any]) -> dict[str, Any]:
    from gateway.openai.tools import constraint, output_content, parse_tools, system_content

    limit = int(plan["max_output_tokens"])
    tools = parse_tools(plan.get("tools", []), "tools", None)
    messages: list[dict[str, str]] = []
    system = system_content(plan.get("instructions"), tools)
    if system:
        messages.append({"role": "system", "content": system})
    replies: list[list[int]] = []
    texts: list[str] = []
    assert tokenizer.chat_template is not None
    template = tokenizer.chat_template
    eos = set(tokenizer.eos_token_ids)
    history: list[int] = []  # the whole conversation's tokens so far, replies as generated
    rendered = ""  # what `history` holds, as the template renders it
    for turn, text in enumerate(plan["turns"], start=1):
        content = output_content(text["output"]) if isinstance(text, dict) else text
        messages.append({"role": "user", "content": content})
        fmt = constraint(tools, plan["choices"][turn - 1]) if tools else None
        grammar = None if fmt is None else {"type": "structural_tag", "tag": fmt.tag}
        prompt = template.render(messages, add_generation_prompt=True)
        assert prompt.startswith(rendered)
        history += tokenizer.encode(prompt[len(rendered) :])
        tokens = generate(history, limit, grammar)
        stopped = bool(tokens) and tokens[-1] in eos
        reply = tokenizer.decode(tokens[:-1] if stopped else tokens)
        replies.append(tokens)
        texts.append(reply)
        history += tokens
        messages.append({"role": "assistant", "content": reply})
        rendered = prompt + reply + (tokenizer.decode(tokens[-1:]) if stopped else "")
        assert template.render(messages).startswith(rendered), f"turn {turn}: the template moved the reply"
    return {"replies": replies, "texts": texts}


class PendingReferences:
    """The references of some plans, computing in a subprocess while the tests' stacks start."""

    def __init__(self, plans: dict[str, dict[str, Any]], transformers_dir: Path | None = None) -> None:
        """`transformers_dir`: the run's conversion of SmolLM2 (tests/transformers_smollm2.py), for
        plans held to transformers."""
        where = [] if transformers_dir is None else [str(transformers_dir)]
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.system.gateway.openai_reference", *where],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(plans))
        self.popen.stdin.close()
        self._results: dict[str, dict[str, Any]] | None = None

    def result(self, name: str) -> dict[str, Any]:
        """The reference of plan `name` (the subprocess's answer is read once, then remembered)."""
        if self._results is None:
            assert self.popen.stdout is not None
            out = self.popen.stdout.read()
            assert self.popen.wait(600) == 0, "the reference failed"
            self._results = json.loads(out)
        return self._results[name]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


if __name__ == "__main__":
    json.dump(compute_all(json.load(sys.stdin), Path(sys.argv[1]) if len(sys.argv) > 1 else None), sys.stdout)
