"""The model registry: which models live workers serve, and each model's card (its chat template).

Why in Redis: a gateway renders OpenAI-dialect conversations with the served model's own chat
template (gateway/openai/), but only workers load models. Each worker writes its model's card at
registration (and again when a heartbeat finds Redis lost its entry); a gateway reads it once per
socket. Which models are *served* is read from the live worker hashes themselves (their `model`
field), so a card never outlives the truth: a model whose workers are all gone is not served,
whatever cards remain.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from shared.store.registry import read_workers
from shared.store.schema import STATE_READY, KeySchema
from shared.store.values import text_map

logger = logging.getLogger(__name__)

_TEMPLATE = "chat_template"
_BOS = "bos_token"
_EOS = "eos_token"
_EOS_IDS = "eos_token_ids"


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A served model as a gateway needs it: its template ("" when it has none) and stop tokens."""

    name: str
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    eos_token_ids: tuple[int, ...] = ()


async def write_model(redis: Redis, schema: KeySchema, card: ModelCard) -> None:
    """Publish `card` (no TTL: it only describes the model; liveness is the workers')."""
    mapping = {
        _TEMPLATE: card.chat_template,
        _BOS: card.bos_token,
        _EOS: card.eos_token,
        _EOS_IDS: json.dumps(list(card.eos_token_ids)),
    }
    await redis.hset(schema.model(card.name), mapping=mapping)  # type: ignore[arg-type]


async def read_model(redis: Redis, schema: KeySchema, name: str) -> ModelCard | None:
    raw = text_map(await redis.hgetall(schema.model(name)))
    if not raw:
        return None
    try:
        ids = tuple(int(i) for i in json.loads(raw.get(_EOS_IDS, "[]")))
    except (ValueError, TypeError):
        logger.warning("model card %s has unreadable eos ids", name)
        ids = ()
    return ModelCard(name, raw.get(_TEMPLATE, ""), raw.get(_BOS, ""), raw.get(_EOS, ""), ids)


async def served_models(redis: Redis, schema: KeySchema) -> list[str]:
    """The models of the live `ready` workers, sorted (a dead worker's hash has expired)."""
    workers = await read_workers(redis, schema)
    return sorted({w.model for w in workers if w.state == STATE_READY and w.model})
