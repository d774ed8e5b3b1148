"""The rewind benchmark end to end at a tiny size (issue #35, point 6). No timing is asserted: what
is checked are the exact counts the figures stand on (a rewind forwards nothing, a delete forwards
what followed the item, an out-of-band answer its own question and outputs) and that the side
answers leave no trace (the benchmark asserts that itself)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.rewind_bench import main


def test_the_counts_the_figures_stand_on(tmp_path: Path) -> None:
    out = tmp_path / "rewind.json"
    small = ["--history", "256", "--item", "8", "--after", "16", "--question", "8", "--outputs", "4"]
    main([*small, "--rounds", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["rewind_last_reply"]["tokens_forwarded"] == [0]
    assert report["delete_item"]["edit_tokens_forwarded"] == 16
    assert report["delete_item"]["whole_tokens_forwarded"] == 256 - 8
    assert report["out_of_band"]["oob_tokens_forwarded"] == 8 + 4 - 1
    assert report["out_of_band"]["cold_tokens_forwarded"] == 256 + 8 + 4 - 1
