"""The files a benchmark writes: its report as JSON (--json) and a plot (--plot).

matplotlib is imported lazily with the Agg backend: benchmarks run headless, and one that writes
no plot does not pay for the import.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

logger = logging.getLogger(__name__)


def write_json(data: Mapping[str, Any], path: Path, *, indent: int = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    logger.info("wrote %s", path)


@contextlib.contextmanager
def plot_file(path: Path, *, size: tuple[float, float], dpi: int) -> Iterator[Axes]:
    """Axes to draw on; once drawn, with a grid and a legend, the figure is saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=size)
    try:
        yield axes
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(figure)
    logger.info("wrote %s", path)
