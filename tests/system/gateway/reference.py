"""Reference outputs for the gateway tests: each input stream run alone, directly on the engine.

Why a subprocess: the references (a couple of thousand tiny-model turns) are computed once per test
run, one session at a time (each forward step then holds that one session only: the single-session
reference the system must reproduce), with one torch thread, in parallel with the servers
starting up, and without touching the torch settings of the pytest process.

Streams are derived from a seed, so a test and the reference agree on the inputs without sharing
anything but the seed: `stream(seed, turns)` is the list of chunks of session `seed`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

TINY_VOCAB: Final = 512
CHUNK_TOKENS: Final = 4
OUTPUT_TOKENS: Final = 2
# The session config every reference-checked session opens with: greedy, no early stop.
SESSION_CONFIG: Final[dict[str, Any]] = {"max_output_tokens": OUTPUT_TOKENS, "stop_token_ids": []}


def stream(seed: int, turns: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(CHUNK_TOKENS)] for _ in range(turns)]


# Text streams: words of several kinds (digits, multibyte, special tokens) so the tokenizer holds
# text back at most cuts; pieces of 3 to 9 characters, cut wherever (mid-word, mid-special-token).
TEXT_WORDS: Final = (
    "the",
    "quick",
    "fox",
    "12345",
    "naïve",
    "café",
    "日本語",
    "<|im_start|>",
    "<|im_end|>",
    "ok,",
)


def text_stream(seed: int, turns: int) -> list[tuple[str, int]]:
    """(text, max_output_tokens) per chunk: about one chunk in three asks for output."""
    rng = random.Random(seed)
    text = ""
    while len(text) < 9 * turns:
        text += rng.choice(TEXT_WORDS) + rng.choice((" ", " ", "\n", ""))
    chunks, at = [], 0
    for _ in range(turns):
        size = rng.randint(3, 9)
        chunks.append((text[at : at + size], OUTPUT_TOKENS if rng.random() < 0.35 else 0))
        at += size
    return chunks


def compute(plan: dict[int, int], *, text: bool = False) -> dict[int, list[list[int]]]:
    """Outputs of every turn of every stream in `plan` (seed -> turns): token streams, or text
    streams (`text_stream`) when `text`."""
    from worker.engine import Engine

    out: dict[int, list[list[int]]] = {}
    with Engine.load("tiny", kv_tokens=8192) as engine:
        for seed, turns in plan.items():
            sid = engine.open_session(max_output_tokens=OUTPUT_TOKENS, stop_token_ids=())
            outputs = []
            if text:
                for seq, (piece, k) in enumerate(text_stream(seed, turns), start=1):
                    result = engine.run_turn(sid, text=piece, seq=seq, max_output_tokens=k, timeout=60)
                    outputs.append(list(result.tokens))
            for seq, chunk in enumerate([] if text else stream(seed, turns), start=1):
                outputs.append(list(engine.run_turn(sid, tokens=chunk, seq=seq, timeout=60).tokens))
            engine.close_session(sid)
            out[seed] = outputs
    return out


@dataclass
class PendingReferences:
    """A reference computation running in a subprocess; `get` waits for it."""

    popen: subprocess.Popen[bytes]
    workdir: Path
    plan: dict[int, int]
    _result: dict[int, list[list[int]]] | None = None

    def get(self, seed: int, turns: int) -> list[list[int]]:
        """The outputs of the first `turns` turns of stream `seed`."""
        if self._result is None:
            self.popen.wait(timeout=300)
            if self.popen.returncode != 0:
                log = (self.workdir / "reference.log").read_text(errors="replace")
                raise RuntimeError(f"reference computation failed:\n{log}")
            raw = json.loads((self.workdir / "reference.json").read_text())
            self._result = {int(k): v for k, v in raw.items()}
        if turns > self.plan.get(seed, 0):
            raise ValueError(f"no reference for {turns} turns of stream {seed}: extend the plan")
        return self._result[seed][:turns]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def start(plan: dict[int, int], workdir: Path, *, text: bool = False) -> PendingReferences:
    """Start computing the references of `plan` (seed -> turns; text streams when `text`) in the
    background."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    spec = ",".join(f"{seed}:{turns}" for seed, turns in plan.items())
    args = [sys.executable, "-m", "tests.system.gateway.reference", "--plan", spec, "--out", str(workdir)]
    args += ["--text"] if text else []
    repo = Path(__file__).resolve().parents[3]
    with open(workdir / "reference.log", "wb") as log:
        popen = subprocess.Popen(args, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    return PendingReferences(popen, workdir, dict(plan))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True, help="seed:turns,seed:turns,...")
    parser.add_argument("--out", required=True, help="directory for reference.json")
    parser.add_argument("--text", action="store_true", help="text streams (text_stream) instead of tokens")
    args = parser.parse_args()
    plan = {int(seed): int(turns) for seed, turns in (item.split(":") for item in args.plan.split(","))}
    (Path(args.out) / "reference.json").write_text(json.dumps(compute(plan, text=args.text)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
