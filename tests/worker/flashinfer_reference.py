"""A pure-torch reference of exactly the part of flashinfer's API the flashinfer backend calls.

Names, parameter names and their order are flashinfer-python 0.7.2.post1's (its docstrings in
`flashinfer/prefill.py` and `flashinfer/page.py`); tests/worker/test_flashinfer_api.py holds both
this file and the backend against the wheel's own source. Semantics, from the same documentation,
written independently of the backend:

- A paged KV cache in the NHD layout is a tuple (k_cache, v_cache), each
  [max_num_pages, page_size, num_kv_heads, head_dim]. Row b owns pages
  kv_indices[kv_indptr[b]:kv_indptr[b + 1]] and holds (pages - 1) * page_size + last_page_len[b]
  tokens; token p of the row lives in page p // page_size of that list, slot p % page_size.
- `append_paged_kv_cache` writes entry n at (row batch_indices[n], position positions[n]); the
  page metadata already counts the appended tokens.
- `BatchPrefillWithPagedKVCacheWrapper.plan` fixes the batch; `run(q, cache)` attends with the
  causal mask aligned bottom-right: query i of a row with q_len queries over kv_len keys sees keys
  j <= kv_len - q_len + i. Scores are scaled by 1/sqrt(head_dim) unless `sm_scale` is given; a
  query's heads map to KV heads in groups of num_qo_heads // num_kv_heads. `run` refuses a query
  dtype other than the planned `q_data_type` (whose default is float16), as flashinfer does.

`install` puts it in place of the `flashinfer` module; `wrong` builds a deliberately broken one
(top-left causal mask) for the start-up self-check's tests.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from typing import Any

import torch


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    return getattr(torch, value) if isinstance(value, str) else value


def _row_slots(
    kv_indices: torch.Tensor, kv_indptr: torch.Tensor, last: torch.Tensor, row: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, slots-in-page) of every token the row holds, in order."""
    pages = kv_indices[int(kv_indptr[row]) : int(kv_indptr[row + 1])].long()
    length = (len(pages) - 1) * page_size + int(last[row])
    positions = torch.arange(length, device=pages.device)
    return pages[positions // page_size], positions % page_size


def append_paged_kv_cache(  # noqa: PLR0917 (flashinfer's own signature)
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    if kv_layout != "NHD" or not isinstance(paged_kv_cache, tuple):
        raise NotImplementedError("the reference covers the NHD (k_cache, v_cache) tuple only")
    k_cache, v_cache = paged_kv_cache
    page_size = k_cache.shape[1]
    for n in range(append_key.shape[0]):
        row, position = int(batch_indices[n]), int(positions[n])
        pages = kv_indices[int(kv_indptr[row]) : int(kv_indptr[row + 1])]
        length = (len(pages) - 1) * page_size + int(kv_last_page_len[row])
        if not 0 <= position < length:
            raise ValueError(f"position {position} outside row {row}'s {length} tokens")
        page = int(pages[position // page_size])
        k_cache[page, position % page_size] = append_key[n]
        v_cache[page, position % page_size] = append_value[n]


class BatchPrefillWithPagedKVCacheWrapper:
    top_left_mask = False  # `wrong()` flips it: the mistake SDPA's is_causal makes for appends

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        if kv_layout != "NHD":
            raise NotImplementedError("the reference covers NHD only")
        self._plan: dict[str, Any] | None = None

    def plan(  # noqa: PLR0917 (flashinfer's own signature)
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
    ) -> None:
        if custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode != "NONE":
            raise NotImplementedError("the reference covers plain causal or full attention")
        self._plan = {
            "qo_indptr": qo_indptr.cpu(),
            "kv_indptr": paged_kv_indptr.cpu(),
            "kv_indices": paged_kv_indices,
            "last": paged_kv_last_page_len.cpu(),
            "heads": (num_qo_heads, num_kv_heads, head_dim_qk),
            "page_size": page_size,
            "causal": causal,
            "scale": sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk),
            "q_dtype": _dtype(q_data_type),
        }

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        if q.dtype != plan["q_dtype"]:
            raise ValueError(f"the query's dtype {q.dtype} is not the planned {plan['q_dtype']}")
        k_cache, v_cache = paged_kv_cache
        num_qo_heads, num_kv_heads, _head_dim = plan["heads"]
        group = num_qo_heads // num_kv_heads
        out = torch.empty_like(q)
        qo = plan["qo_indptr"].tolist()
        for row in range(len(qo) - 1):
            pages, slots = _row_slots(
                plan["kv_indices"], plan["kv_indptr"], plan["last"], row, plan["page_size"]
            )
            keys = k_cache[pages, slots].float().repeat_interleave(group, dim=1)  # [kv, heads, dim]
            values = v_cache[pages, slots].float().repeat_interleave(group, dim=1)
            query = q[qo[row] : qo[row + 1]].float()  # [q, heads, dim]
            scores = torch.einsum("qhd,khd->hqk", query, keys) * plan["scale"]
            q_len, kv_len = query.shape[0], keys.shape[0]
            if plan["causal"]:
                shift = 0 if self.top_left_mask else kv_len - q_len
                visible = torch.arange(kv_len).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + shift
                scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            attended = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
            out[qo[row] : qo[row + 1]] = attended.to(q.dtype)
        return out


def _module(wrapper: type[BatchPrefillWithPagedKVCacheWrapper]) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.append_paged_kv_cache = append_paged_kv_cache  # type: ignore[attr-defined]
    module.BatchPrefillWithPagedKVCacheWrapper = wrapper  # type: ignore[attr-defined]
    return module


def module() -> types.ModuleType:
    return _module(BatchPrefillWithPagedKVCacheWrapper)


def wrong() -> types.ModuleType:
    """A flashinfer whose causal mask is aligned top-left: appends see too few keys."""

    class TopLeft(BatchPrefillWithPagedKVCacheWrapper):
        top_left_mask = True

    return _module(TopLeft)


def install(fake: types.ModuleType) -> types.ModuleType | None:
    """Put `fake` in place of `flashinfer`; returns what was there (for the caller to restore)."""
    previous = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = fake
    return previous
