"""How big each KV tier is, in pages: the device pool from `kv_tokens` (or the device's free
memory), the host tier from `host_kv_tokens` (or the host's available memory)."""

from __future__ import annotations

import logging
from typing import Final

import psutil
import torch

from worker.engine.config import EngineConfig
from worker.model.config import ModelConfig

logger = logging.getLogger(__name__)

# CPU pools are sized by bytes (made resident in the background after start, worker/mapped_zeros.py).
CPU_KV_BYTES: Final = 512 * 2**20
CPU_KV_TOKENS_CAP: Final = 131072
# The host tier, unless `host_kv_tokens` says otherwise, takes this share of the memory available
# when the worker starts: idle sessions parked there cost host RAM, which is plentiful next to a
# GPU's, and the rest stays for the process and its neighbours.
HOST_KV_MEMORY_FRACTION: Final = 0.25


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    return model.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def device_pages(config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Pages of the device pool: `kv_tokens`, else a share of free GPU memory, else a CPU default."""
    per_token = kv_bytes_per_token(model, dtype)
    if config.kv_tokens:
        tokens = config.kv_tokens
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        tokens = int(free * config.kv_memory_fraction) // per_token
    else:
        tokens = min(CPU_KV_BYTES // per_token, CPU_KV_TOKENS_CAP)
    return max(tokens // config.page_size, 1)


def host_pages(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, *, pending_bytes: int = 0
) -> int:
    """Pages of the host tier: `host_kv_tokens` (0: no tier), or, when negative (the default), a
    share of the host memory available now, less `pending_bytes` this process has mapped and will
    make resident (a CPU device pool still filling in the background), said in the log."""
    if config.host_kv_tokens >= 0:
        return config.host_kv_tokens // config.page_size
    per_token = kv_bytes_per_token(model, dtype)
    available = max(psutil.virtual_memory().available - pending_bytes, 0)
    tokens = int(available * HOST_KV_MEMORY_FRACTION) // per_token
    logger.info(
        "host KV tier sized from host memory: %d tokens (%.1f GiB, %.0f%% of %.1f GiB available); "
        "set --host-kv-tokens to choose, 0 to turn it off",
        tokens,
        tokens * per_token / 2**30,
        HOST_KV_MEMORY_FRACTION * 100,
        available / 2**30,
    )
    return tokens // config.page_size
