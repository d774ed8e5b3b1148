"""The reference an OpenAI-dialect conversation must equal, token for token: greedy generation by
the engine alone over the conversation rendered whole by the model's chat template, each reply kept
exactly as it was generated (its tokens, never re-tokenized from its text).

Why a subprocess: it loads SmolLM2 with its own torch settings, away from the pytest process, and
runs while the stack starts. Run as `python -m tests.system.gateway.openai_reference` with a JSON
plan on stdin: {"instructions": str | null, "turns": [str, ...], "max_output_tokens": int}; prints
{"replies": [[token ids], ...], "texts": [str, ...]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.processes import REPO


def compute(plan: dict[str, Any]) -> dict[str, Any]:
    from worker.engine import Engine

    limit = int(plan["max_output_tokens"])
    messages: list[dict[str, str]] = []
    if plan.get("instructions"):
        messages.append({"role": "system", "content": plan["instructions"]})
    replies: list[list[int]] = []
    texts: list[str] = []
    with Engine.load("smollm2-135m", kv_tokens=8192) as engine:
        tokenizer = engine.tokenizer
        assert tokenizer is not None and tokenizer.chat_template is not None
        template = tokenizer.chat_template
        eos = set(tokenizer.eos_token_ids)
        history: list[int] = []  # the whole conversation's tokens so far, replies as generated
        rendered = ""  # what `history` holds, as the template renders it
        for turn, text in enumerate(plan["turns"], start=1):
            messages.append({"role": "user", "content": text})
            prompt = template.render(messages, add_generation_prompt=True)
            assert prompt.startswith(rendered)
            history += tokenizer.encode(prompt[len(rendered) :])
            # A fresh session fed the whole conversation at once: nothing cached from earlier turns.
            sid = engine.open_session(max_output_tokens=limit)
            result = engine.run_turn(sid, tokens=history, seq=1, max_output_tokens=limit, timeout=600)
            engine.close_session(sid)
            tokens = list(result.tokens)
            stopped = bool(tokens) and tokens[-1] in eos and result.finish == "stop"
            reply = tokenizer.decode(tokens[:-1] if stopped else tokens)
            replies.append(tokens)
            texts.append(reply)
            history += tokens
            messages.append({"role": "assistant", "content": reply})
            rendered = prompt + reply + (tokenizer.decode(tokens[-1:]) if stopped else "")
            assert template.render(messages).startswith(rendered), (
                f"turn {turn}: the template moved the reply"
            )
    return {"replies": replies, "texts": texts}


def start(plan: dict[str, Any]) -> subprocess.Popen[str]:
    """The reference of `plan`, computing in a subprocess while the test's stack starts."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.system.gateway.openai_reference"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(plan))
    proc.stdin.close()
    return proc


_RESULTS: dict[int, dict[str, Any]] = {}


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The reference's answer (read once, then remembered: several tests compare with it)."""
    if proc.pid not in _RESULTS:
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert proc.wait(600) == 0, "the reference failed"
        _RESULTS[proc.pid] = json.loads(out)
    return _RESULTS[proc.pid]


if __name__ == "__main__":
    json.dump(compute(json.load(sys.stdin)), sys.stdout)
