"""The C extensions pip builds with the machine's compiler (worker/model/block_dot.c,
worker/model/row_ops.c, worker/attention/cpu_kernel.c): import one, or say why it does not run here.

Each is optional (a machine with no C compiler at install gets none) and answers `supported()`, its
CPU-feature check; where either fails the caller serves through torch and names the reason.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load_extension(module: str, *, needs: str) -> tuple[ModuleType | None, str]:
    """The extension `module` and "", or None and why it does not run here (`needs`: the CPU
    features its `supported()` asks for, as said to the operator)."""
    try:
        extension = importlib.import_module(module)
    except ImportError:
        name = module.rpartition(".")[2]
        return None, f"the {name} extension was not built (no C compiler at install?)"
    if not extension.supported():
        return None, f"this CPU lacks {needs}"
    return extension, ""
