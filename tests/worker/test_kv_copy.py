"""A drain's KV copy on the engine side: pages exported from one engine, imported into another as a
warm copy, which then answers exactly as the session would have where it was, prefilling only what
the copy did not cover. Two real tiny engines; the format check says which pages another takes."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from shared.errors import CapacityExhausted
from shared.protocol.kv_copy import KVFormat
from shared.protocol.messages import OpenConfig
from tests.worker.cpu_kernel import needs_cpu_kernel
from worker.engine import Engine
from worker.engine.memory.kv_transfer import FINGERPRINT_SAMPLE, KVExport, _samples
from worker.tokenizer.incremental import EMPTY_TAIL

CONFIG = OpenConfig(stop_token_ids=(), max_output_tokens=3)
TURNS = [[(7 * t + j) % 200 + 1 for j in range(40)] for t in range(6)]


@pytest.fixture(scope="module")
def source() -> Iterator[Engine]:
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0) as engine:
        yield engine


@pytest.fixture(scope="module", params=["host", "device"])
def target(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """With a host tier and without: on the CPU a copy lands on the device while it has room
    (`test_on_the_cpu_a_copy_lands_on_the_device_while_it_has_room_then_in_the_host_tier`)."""
    host = 4096 if request.param == "host" else 0
    with Engine.load("tiny", kv_tokens=4096, host_kv_tokens=host) as engine:
        yield engine


def served(engine: Engine, sid: str) -> tuple[list[int], KVExport]:
    """Serve five turns of `sid`, then export its KV; (its history, the export)."""
    engine.open_session(session_id=sid, config=CONFIG)
    history: list[int] = []
    for seq, chunk in enumerate(TURNS[:5], 1):
        result = engine.run_turn(sid, tokens=chunk, seq=seq, timeout=60)
        history += [*chunk, *result.tokens]
    return history, engine.export_kv(sid).result(timeout=60)


def import_into(
    engine: Engine, sid: str, export: KVExport, *, history: list[int], accepted_seq: int
) -> Future[int]:
    """Ask `engine` to open a copy of `sid` holding `export`'s pages (`Engine.import_copy`)."""
    return engine.import_copy(
        sid,
        config=CONFIG,
        history=history,
        accepted_seq=accepted_seq,
        text_tail=EMPTY_TAIL,
        kv_tokens=export.tokens,
        kv=export.data,
    )


def test_imported_pages_answer_as_the_session_would_have_and_are_not_recomputed(
    source: Engine, target: Engine
) -> None:
    sid = f"copy-{target.stats().memory.host_pages_total}"
    history, export = served(source, sid)
    assert export.tokens == history[: len(export.tokens)] and len(export.tokens) >= len(history) - 1
    assert export.pages * source.kv_format.page_size >= len(export.tokens)
    assert len(export.payload()) == export.pages * source.kv_format.page_bytes
    assert target.kv_format == source.kv_format
    kept = import_into(target, sid, export, history=history, accepted_seq=5).result(timeout=60)
    assert kept == len(export.tokens)
    before = target.stats().tokens_forwarded
    warmed = target.warm_async(sid, config=CONFIG, history=history, accepted_seq=5, extend=True).result(60)
    assert warmed.length == len(history)
    assert target.stats().tokens_forwarded - before == len(history) - kept  # only what the copy lacked
    target.open_session(session_id=sid, config=CONFIG, history=history, accepted_seq=5, adopt=True)
    moved = target.run_turn(sid, tokens=TURNS[5], seq=6, timeout=60)
    stayed = source.run_turn(sid, tokens=TURNS[5], seq=6, timeout=60)
    assert moved.tokens == stayed.tokens and moved.length == stayed.length


def test_a_copy_keeps_only_the_prefix_the_history_begins_with(source: Engine, target: Engine) -> None:
    sid = f"prefix-{target.stats().memory.host_pages_total}"
    history, export = served(source, sid)
    shorter = history[:100]  # the log had only the first turns when the copy arrived
    kept = import_into(target, sid, export, history=shorter, accepted_seq=2).result(timeout=60)
    assert kept == 100
    target.close_session(sid)


def test_on_the_cpu_a_copy_lands_on_the_device_while_it_has_room_then_in_the_host_tier(
    source: Engine,
) -> None:
    history, export = served(source, "placed")
    pages = export.pages
    with Engine.load("tiny", kv_tokens=(pages + 8) * 16, host_kv_tokens=4096) as target:
        for sid in ("first", "second"):
            import_into(target, sid, export, history=history, accepted_seq=5).result(timeout=60)
        memory = target.stats().memory
        assert (memory.device_pages_used, memory.host_pages_used) == (pages, pages)
        # The one in the host tier is as good a copy: it answers as the session would have.
        target.close_session("first")
        target.open_session(session_id="second", config=CONFIG, history=history, accepted_seq=5, adopt=True)
        moved = target.run_turn("second", tokens=TURNS[5], seq=6, timeout=60)
    stayed = source.run_turn("placed", tokens=TURNS[5], seq=6, timeout=60)
    assert moved.tokens == stayed.tokens


def test_no_room_anywhere_refuses_the_copy_and_leaves_nothing(source: Engine) -> None:
    history, export = served(source, "big")
    with Engine.load("tiny", kv_tokens=64, host_kv_tokens=0) as small:
        future = import_into(small, "big", export, history=history[:64], accepted_seq=1)
        small.open_session(
            session_id="other", config=CONFIG, history=[1] * 40
        )  # the first copy took every page
        with pytest.raises(CapacityExhausted):
            import_into(small, "big2", export, history=history[:64], accepted_seq=1).result(timeout=60)
        assert future.result(timeout=60) == 64
        assert small.stats().sessions == 2  # the refused copy left no session behind


def test_the_format_tells_other_weights_page_sizes_and_dtypes_apart(source: Engine) -> None:
    ours = source.kv_format
    with Engine.load("tiny", kv_tokens=256, host_kv_tokens=0, seed=source.config.seed + 1) as other:
        assert ours.mismatch(other.kv_format) == "model"
    with Engine.load("tiny", kv_tokens=256, host_kv_tokens=0, page_size=32) as paged:
        assert paged.kv_format.model == ours.model and ours.mismatch(paged.kv_format) == "page_size"
    with Engine.load("tiny", kv_tokens=256, host_kv_tokens=0, kv_dtype="float16") as half:
        assert half.kv_format.model == ours.model and ours.mismatch(half.kv_format) == "dtype"
    assert (
        ours.mismatch(KVFormat(ours.model, "bfloat16", ours.page_size, ours.layout, ours.page_bytes))
        == "dtype"
    )
    assert ours.mismatch(KVFormat(ours.model, ours.dtype, ours.page_size, "nhd", ours.page_bytes)) == "layout"
    assert ours.mismatch(ours) is None


def test_a_session_parked_on_the_host_tier_is_exported_from_there(target: Engine) -> None:
    with Engine.load("tiny", kv_tokens=384, host_kv_tokens=4096) as small:
        small.open_session(session_id="parked", config=CONFIG)
        history: list[int] = []
        for seq, chunk in enumerate(TURNS[:5], 1):
            history += [*chunk, *small.run_turn("parked", tokens=chunk, seq=seq, timeout=60).tokens]
        small.open_session(session_id="other", config=CONFIG)
        for seq, chunk in enumerate(TURNS[:5], 1):  # needs the pool: "parked" goes to the host tier
            small.run_turn("other", tokens=chunk, seq=seq, timeout=60)
        assert small.stats().memory.offloads.count >= 1
        export = small.export_kv("parked").result(timeout=60)
        sid = f"parked-{target.stats().memory.host_pages_total}"
        kept = import_into(target, sid, export, history=history, accepted_seq=5).result(timeout=60)
        assert kept == len(export.tokens) >= len(history) - 1
        target.open_session(session_id=sid, config=CONFIG, history=history, accepted_seq=5, adopt=True)
        moved = target.run_turn(sid, tokens=TURNS[5], seq=6, timeout=60)
        stayed = small.run_turn("parked", tokens=TURNS[5], seq=6, timeout=60)
        assert moved.tokens == stayed.tokens


def test_read_only_stored_blocks_are_fingerprinted_without_a_warning() -> None:
    """A GGUF's blocks are a read-only mapping: handed whole to torch, they made it warn of undefined
    behaviour at every worker start. Only a copied sample of them reaches torch now."""
    blocks = np.arange(3 * 50_000, dtype=np.uint8).reshape(3, 50_000)
    blocks.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [(name, shape, dtype, sample)] = list(_samples("w", blocks))
    assert (name, shape, dtype) == ("w", (3, 50_000), torch.uint8)
    step = blocks.size // FINGERPRINT_SAMPLE
    assert torch.equal(sample, torch.from_numpy(blocks.reshape(-1)[::step][:FINGERPRINT_SAMPLE].copy()))


@pytest.mark.parametrize(
    "kv_dtype",
    [
        "float16",
        pytest.param("int8-keys", marks=needs_cpu_kernel),
        pytest.param("int8", marks=needs_cpu_kernel),  # auto's pool for the quantised forms on the cpu kernel
    ],
)
def test_half_width_pages_move_between_two_workers_of_their_form_and_answer_as_the_session_would_have(
    kv_dtype: str,
) -> None:
    """A float16 pool, or an int8 form in its float16 slots: the copy carries the pool's own pages, and
    the session continues on the target as it would have here."""
    with (
        Engine.load("tiny", kv_tokens=4096, host_kv_tokens=0, kv_dtype=kv_dtype) as here,
        Engine.load("tiny", kv_tokens=4096, host_kv_tokens=4096, kv_dtype=kv_dtype) as there,
    ):
        history, export = served(here, "half")
        assert export.data.dtype == torch.float16
        kept = import_into(there, "half", export, history=history, accepted_seq=5).result(timeout=60)
        assert kept == len(export.tokens) >= len(history) - 1
        there.open_session(session_id="half", config=CONFIG, history=history, accepted_seq=5, adopt=True)
        moved = there.run_turn("half", tokens=TURNS[5], seq=6, timeout=60)
        stayed = here.run_turn("half", tokens=TURNS[5], seq=6, timeout=60)
        assert moved.tokens == stayed.tokens
