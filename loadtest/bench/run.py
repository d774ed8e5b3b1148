"""`run_bench(config)` runs the modes in order and returns a `BenchReport`; `main(argv)` is the CLI.

Streaming runs first because its outputs are the shared token history. Streaming and reprefill share
one engine (streaming's sessions are all closed before reprefill starts, so reprefill sees an empty
pool); the engine is shut down before hf so its thread cannot steal CPU from the transformers loop.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from loadtest.bench.config import (
    HF,
    HF_MISMATCH_FAIL_FRACTION,
    MODES,
    REPREFILL,
    STREAMING,
    TEXT,
    BenchConfig,
)
from loadtest.bench.floor import Floor, copy_bandwidth_gbps, steps_per_turn
from loadtest.bench.hf import run_hf
from loadtest.bench.host import HostProbe
from loadtest.bench.memory import peak_rss_mib
from loadtest.bench.report import BenchReport, Checks, print_report, write_json, write_plot
from loadtest.bench.reprefill import run_reprefill
from loadtest.bench.results import ModeRun
from loadtest.bench.streaming import run_streaming
from loadtest.bench.text_mode import run_text
from loadtest.bench.workload import Workload
from shared.settings import DTYPE_NAMES, copy_fields
from worker.dtypes import torch_dtype
from worker.engine import Engine
from worker.model.loader import load_model

logger = logging.getLogger(__name__)


def _check_capacity(engine: Engine, config: BenchConfig) -> None:
    """Fail before timing anything if the sessions cannot all be resident at their full length."""
    if config.session_tokens > engine.context_limit:
        raise ValueError(
            f"{config.turns} turns of {config.input_tokens}+{config.output_tokens} tokens reach "
            f"{config.session_tokens} tokens, beyond the engine's context of {engine.context_limit}: "
            "use fewer turns or more --kv-tokens"
        )
    stats = engine.stats()
    pages = -(-config.session_tokens // stats.page_size) * config.sessions
    if pages > stats.pages_total:
        raise ValueError(
            f"{config.sessions} sessions of {config.session_tokens} tokens need "
            f"{pages * stats.page_size} KV tokens; the pool holds {stats.kv_tokens_total}: raise --kv-tokens"
        )


def run_bench(config: BenchConfig) -> BenchReport:
    started = time.perf_counter()
    host = HostProbe.start()
    engine = Engine.load(
        config.model, device=config.device, dtype=config.dtype, kv_tokens=config.kv_tokens or 0
    )
    weights_seed = engine.config.seed
    vocab_size = engine.model_config.vocab_size
    runs: dict[str, ModeRun] = {}
    try:
        _check_capacity(engine, config)
        workload = Workload(
            sessions=config.sessions,
            turns=config.turns,
            input_count=config.input_tokens,
            output_count=config.output_tokens,
            vocab_size=vocab_size,
            seed=config.seed,
        )
        logger.info("streaming: %d sessions x %d turns", config.sessions, config.turns)
        steps_before = engine.stats().steps
        runs[STREAMING], rss = run_streaming(engine, workload, config)
        streaming_steps = engine.stats().steps - steps_before
        weight_bytes = engine.weight_bytes_per_step
        if TEXT in config.modes:
            logger.info("text: %d sessions x %d turns of text cut mid-word", config.sessions, config.turns)
            runs[TEXT] = run_text(engine, config)
        if REPREFILL in config.modes:
            logger.info("reprefill: sampled turns, %d sessions in parallel", config.sessions)
            runs[REPREFILL] = run_reprefill(engine, workload, config)
    finally:
        engine.shutdown()
    del engine
    # Measured once the engine is gone, so the copy has its memory (and no engine thread beside it).
    floor = Floor(
        weight_bytes=weight_bytes,
        copy_gbps=copy_bandwidth_gbps(torch.device(config.device)),
        steps_per_turn=steps_per_turn(config.output_tokens),
        steps_per_turn_taken=streaming_steps / config.turns,
    )
    if HF in config.modes:
        logger.info("hf: transformers with past_key_values, %d sessions one after another", config.sessions)
        loaded = load_model(
            config.model,
            device=torch.device(config.device),
            dtype=torch_dtype(config.dtype),
            seed=weights_seed,
        )
        runs[HF] = run_hf(loaded, workload, config)
    reprefill = runs.get(REPREFILL)
    hf = runs.get(HF)
    checks = Checks(
        reprefill_checked=reprefill.checked if reprefill else 0,
        reprefill_mismatches=tuple(sorted(reprefill.mismatches)) if reprefill else (),
        hf_checked=hf.checked if hf else 0,
        hf_mismatches=tuple(sorted(hf.mismatches)) if hf else (),
        hf_mismatch_limit=HF_MISMATCH_FAIL_FRACTION,
        hf_near_ties=tuple(sorted(hf.near_ties)) if hf else (),
    )
    return BenchReport(
        config, runs, rss, peak_rss_mib(), checks, time.perf_counter() - started, host.finish(), floor
    )


def _parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(
        prog="microturn bench",
        description="Turn latency of resident-KV streaming sessions vs re-prefill vs transformers' KV cache.",
    )
    parser.add_argument(
        "--model", default=defaults.model, help="preset (tiny, smollm2-135m, ...) or HF directory"
    )
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_NAMES)
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="micro-turns per session")
    parser.add_argument("--input-tokens", type=int, default=defaults.input_tokens, help="chunk size per turn")
    parser.add_argument(
        "--output-tokens", type=int, default=defaults.output_tokens, help="greedy tokens per turn"
    )
    parser.add_argument(
        "--modes",
        default=",".join(defaults.modes),
        help=f"comma-separated subset of {','.join(MODES)} (streaming required)",
    )
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency against turn here")
    parser.add_argument(
        "--kv-tokens", type=int, default=None, help="KV pool size in tokens (default: the engine's)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the input tokens")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the bench, print the table, write --json/--plot; 1 if outputs disagree beyond what is allowed."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
        config = copy_fields(BenchConfig, args, modes=modes)
    except ValueError as error:
        parser.error(str(error))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = run_bench(config)
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
    if args.plot is not None:
        write_plot(report, args.plot)
    if not report.checks.ok:
        print("bench FAILED: outputs disagree with streaming's (see the CHECK FAILED line above)")
        return 1
    return 0
