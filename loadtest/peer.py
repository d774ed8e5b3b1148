"""`microturn bench --peer llamacpp`: microturn's engine against llama.cpp on its own ground (#32).

    microturn bench --peer llamacpp [--weights auto] [--kv-dtype auto] [--turns 30] [--threads 2]

Same GGUF, same token ids, same threads, greedy: a 512-token prompt, then micro-turns of 32 tokens
in and 8 out. llama.cpp (through llama-cpp-python, the optional `peer` extra) keeps its state
between turns, so like a microturn session it evaluates only the new tokens. The two engines
take turns, turn by turn, so machine load falls on both alike, each in its own process
(`LlamaCppProcess`: one process would share one OpenMP runtime between them); it prints each
engine's median prompt and micro-turn, their ratios, and how many greedy tokens agreed.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.settings import KV_DTYPES, OWN_CORES_SINGLE_THREAD_MAX_TOKENS, WEIGHT_FORMS, EngineSettings
from worker.openmp import GOMP_SPINCOUNT, choose_spin

logger = logging.getLogger(__name__)

PEERS = ("llamacpp",)
INSTALL_HINT = "pip install 'microturn[peer]' (or: pip install llama-cpp-python; it builds llama.cpp)"
_VOCAB_SPAN = 5000  # token ids drawn from [100, 5100): ordinary tokens of SmolLM2's vocabulary
# llama.cpp's context where a caller names none: the quality prompts' (loadtest/weight_quality.py).
DEFAULT_PEER_CONTEXT = 4096


def workload_ids(count: int, salt: int) -> list[int]:
    """Deterministic token ids, the same for both engines."""
    return [(97 * (i + salt) * (salt + 1) + 13 * i) % _VOCAB_SPAN + 100 for i in range(count)]


class LlamaCppPeer:
    """llama.cpp with kept state: each call evaluates only the tokens it is given."""

    def __init__(
        self, path: str, threads: int, *, context: int = DEFAULT_PEER_CONTEXT, logits_all: bool = False
    ) -> None:
        from llama_cpp import Llama

        # `logits_all` keeps every position's logits (loadtest/weight_quality.py); off, as here, only
        # the last position's are computed, as a serving engine does.
        # Typed as Any: llama-cpp-python is an optional extra, so mypy sees it typed or missing.
        self.runner: Any = Llama(
            model_path=path,
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            logits_all=logits_all,
            verbose=False,
        )
        # The last sampled token gets its KV at the start of the next turn, as in a microturn session.
        self._pending: list[int] = []

    def restart(self) -> None:
        """Forget the kept history: the next call starts a new sequence."""
        self.runner.reset()
        self._pending = []

    def logits_of(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """float32 logits of every position of a new sequence (needs `logits_all`)."""
        self.restart()
        self.runner.eval(list(tokens))
        return np.array(self.runner.scores[: len(tokens)], dtype=np.float32)

    def turn(self, tokens: Sequence[int], outputs: int) -> list[int]:
        self.runner.eval(list(tokens))
        produced: list[int] = []
        for _ in range(outputs):
            token = int(self.runner.sample(top_k=1, temp=0.0, repeat_penalty=1.0))  # greedy
            produced.append(token)
            if len(produced) < outputs:
                self.runner.eval([token])
        self._pending = produced[-1:]
        return produced

    def feed(self, tokens: Sequence[int], outputs: int) -> list[int]:
        return self.turn([*self._pending, *tokens], outputs)


def peer_llama(
    model: str, threads: int, *, context: int = DEFAULT_PEER_CONTEXT, logits_all: bool = False
) -> LlamaCppPeer:
    """llama.cpp on the GGUF file `model` names (a preset or a path), holding up to `context` tokens."""
    from worker.model.loader import SMOLLM2_PRESET
    from worker.model.presets import smollm2_gguf_path

    path = str(smollm2_gguf_path()) if model == SMOLLM2_PRESET else model
    return LlamaCppPeer(path, threads, context=context, logits_all=logits_all)


class LlamaCppProcess:
    """llama.cpp in a process of its own, driven turn by turn: each `feed` returns the peer's tokens
    and the milliseconds it took there.

    Why not in microturn's process: both engines would share one OpenMP runtime (torch's libgomp,
    which llama.cpp's and microturn's C kernels bind to as well), and libgomp makes every team's
    waiting threads yield the CPU once the process holds more threads than cores. Measured in one
    process, microturn's two-thread appends made llama.cpp's turns 1.5x slower (309-357 ms alone,
    469-585 ms beside them, 2026-11-27); two engines deployed side by side run as two processes.
    """

    def __init__(self, model: str, threads: int, *, context: int, spin: str | None) -> None:
        """`context`: the tokens llama.cpp holds. `spin`: llama.cpp's `GOMP_SPINCOUNT` (None: libgomp's
        default), whatever microturn's process chose for itself (worker/openmp.py), which the child
        would otherwise inherit."""
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(
            target=_serve_peer, args=(child, model, threads, context, spin), daemon=True
        )
        self._process.start()
        child.close()
        ready = self._conn.recv()
        if ready != "ready":
            raise RuntimeError(f"the llama.cpp process did not start: {ready}")

    def feed(self, tokens: Sequence[int], outputs: int) -> tuple[list[int], float]:
        self._conn.send((list(tokens), outputs))
        produced, ms = self._conn.recv()
        return produced, ms

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def _serve_peer(conn: Connection, model: str, threads: int, context: int, spin: str | None) -> None:
    # Before llama.cpp loads libgomp, which reads it once.
    if spin is None:
        os.environ.pop(GOMP_SPINCOUNT, None)
    else:
        os.environ[GOMP_SPINCOUNT] = spin
    try:
        peer = peer_llama(model, threads, context=context)
    except Exception as error:  # the parent says why it could not start
        conn.send(f"{type(error).__name__}: {error}")
        return
    conn.send("ready")
    while (request := conn.recv()) is not None:
        tokens, outputs = request
        started = time.perf_counter()
        produced = peer.feed(tokens, outputs)
        conn.send((produced, (time.perf_counter() - started) * 1e3))


@dataclass(frozen=True)
class PeerWorkload:
    model: str = "smollm2-135m"
    weights: str = "auto"
    kv_dtype: str = "auto"  # microturn's KV pool (worker/attention/kv_dtype.py; llama.cpp's is float16)
    turns: int = 30
    prompt_tokens: int = 512
    chunk: int = 32
    outputs: int = 8
    threads: int = 2
    # The engine's single-thread rule (the worker's `--cpu-single-thread-max-tokens`): here 0, every
    # step on the `threads` threads, as llama.cpp runs every op. The worker's default (256: small
    # steps on one thread) is for a machine shared with the gateway and other workers; the peer
    # comparison is two engines each with the machine's 2 threads to itself.
    single_thread_max_tokens: int = OWN_CORES_SINGLE_THREAD_MAX_TOKENS
    # llama.cpp's OpenMP spin: the operator's `GOMP_SPINCOUNT` as it was before microturn chose its own.
    peer_spin: str | None = None


def run(workload: PeerWorkload) -> dict[str, Any]:
    import torch

    from worker.engine import Engine

    w = workload
    model, weights, turns, chunk, outputs, threads = (
        w.model,
        w.weights,
        w.turns,
        w.chunk,
        w.outputs,
        w.threads,
    )
    prompt_tokens = w.prompt_tokens
    torch.set_num_threads(threads)
    # Both engines hold the whole run (a long prompt measures the turns at a long history).
    kv_tokens = prompt_tokens + turns * (chunk + outputs) + 64
    peer = LlamaCppProcess(model, threads, context=max(kv_tokens, DEFAULT_PEER_CONTEXT), spin=w.peer_spin)
    prompt = workload_ids(prompt_tokens, 0)
    chunks = [workload_ids(chunk, turn + 1) for turn in range(turns)]
    times: dict[str, list[float]] = {"microturn": [], "llamacpp": []}
    prompt_ms: dict[str, float] = {}
    agree = total = 0
    with Engine.load(
        model,
        weights=weights,
        kv_dtype=w.kv_dtype,
        kv_tokens=kv_tokens,
        cpu_single_thread_max_tokens=w.single_thread_max_tokens,
    ) as engine:
        sid = engine.open_session(stop_token_ids=())
        started = time.perf_counter()
        # In chunks the engine takes (its `max_chunk_tokens`), as a client sends a long history.
        limit = engine.config.max_chunk_tokens
        for first in range(0, len(prompt), limit):
            engine.run_turn(sid, tokens=prompt[first : first + limit], max_output_tokens=0, timeout=600)
        prompt_ms["microturn"] = (time.perf_counter() - started) * 1e3
        _, prompt_ms["llamacpp"] = peer.feed(prompt, 0)
        for turn, tokens in enumerate(chunks):
            order = ("microturn", "llamacpp") if turn % 2 == 0 else ("llamacpp", "microturn")
            replies: dict[str, list[int]] = {}
            for name in order:
                if name == "microturn":
                    started = time.perf_counter()
                    reply = engine.run_turn(sid, tokens=tokens, max_output_tokens=outputs, timeout=600)
                    replies[name] = list(reply.tokens)
                    times[name].append((time.perf_counter() - started) * 1e3)
                else:
                    replies[name], ms = peer.feed(tokens, outputs)
                    times[name].append(ms)
            agree += sum(a == b for a, b in zip(replies["microturn"], replies["llamacpp"], strict=False))
            total += outputs
        weight_form = engine._core.runner.model.weights.form
        kv_dtype = engine.kv_format.dtype
    peer.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": model,
        "weights": weight_form,
        "kv_dtype": kv_dtype,
        "threads": threads,
        "cpu_single_thread_max_tokens": w.single_thread_max_tokens,
        "prompt_tokens": prompt_tokens,
        "turns": turns,
        "turn_in_out": [chunk, outputs],
        "prompt_ms": {k: round(v, 1) for k, v in prompt_ms.items()},
        "turn_median_ms": {k: round(v, 1) for k, v in medians.items()},
        "prompt_ratio": round(prompt_ms["microturn"] / prompt_ms["llamacpp"], 2),
        "turn_ratio": round(medians["microturn"] / medians["llamacpp"], 2),
        "greedy_agreement": f"{agree}/{total}",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="microturn bench --peer", description=__doc__.split("\n")[0])
    parser.add_argument("--peer", choices=PEERS, default="llamacpp")
    parser.add_argument("--model", default="smollm2-135m", help="a preset or .gguf file both engines load")
    parser.add_argument("--weights", choices=WEIGHT_FORMS, default="auto")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cpu-single-thread-max-tokens",
        type=int,
        default=OWN_CORES_SINGLE_THREAD_MAX_TOKENS,
        help="microturn's steps of at most this many tokens run on one thread (0, here the default: "
        f"every step on all; the worker's default is {EngineSettings.cpu_single_thread_max_tokens})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Before torch loads libgomp (worker/openmp.py): microturn's rule says whether it shares its cores.
    peer_spin = os.environ.get(GOMP_SPINCOUNT)
    choose_spin(shared_cores=args.cpu_single_thread_max_tokens > 0)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"skipped: the llama.cpp peer needs llama-cpp-python: {INSTALL_HINT}", file=sys.stderr)
        return 0
    workload = PeerWorkload(
        model=args.model,
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        turns=args.turns,
        prompt_tokens=args.prompt_tokens,
        chunk=args.chunk_tokens,
        outputs=args.output_tokens,
        threads=args.threads,
        single_thread_max_tokens=args.cpu_single_thread_max_tokens,
        peer_spin=peer_spin,
    )
    result = run(workload)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
