"""The rewind benchmark end to end at a tiny size (issue #35, point 6). No timing is asserted: what
is checked are the exact counts the figures stand on (a rewind forwards nothing, a delete forwards
what followed the item, an out-of-band answer its own question and outputs, one over other items
those and then the conversation after what it kept) and that the side answers leave no trace (the
benchmark asserts that itself)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.rewind_bench import main


def test_the_counts_the_figures_stand_on(tmp_path: Path) -> None:
    out = tmp_path / "rewind.json"
    sizes = {"history": 256, "item": 8, "after": 16, "question": 8, "outputs": 4, "kept": 64}
    main([*(f"--{name}={value}" for name, value in sizes.items()), "--rounds", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["rewind_last_reply"]["tokens_forwarded"] == [0]
    assert report["delete_item"]["edit_tokens_forwarded"] == 16
    assert report["delete_item"]["whole_tokens_forwarded"] == 256 - 8
    assert report["out_of_band"]["oob_tokens_forwarded"] == 8 + 4 - 1
    assert report["out_of_band"]["cold_tokens_forwarded"] == 256 + 8 + 4 - 1
    # Over other items: its question and outputs, then the conversation after the kept 64 again.
    other = report["out_of_band_other"]
    assert other["answer_tokens_forwarded"] == 8 + 4 - 1
    assert other["restore_tokens_forwarded"] == 256 - 64
    assert other["cold_tokens_forwarded"] == 64 + 8 + 4 - 1
