"""The streaming-session engine: `Engine.load(...)`, then sessions that append chunks and generate."""

from worker.engine.config import EngineConfig
from worker.engine.core import EngineStats
from worker.engine.engine import START_REFUSALS, Engine
from worker.engine.session_rules import SessionRules
from worker.engine.turn import TokenDelta, TurnResult

__all__ = [
    "START_REFUSALS",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "SessionRules",
    "TokenDelta",
    "TurnResult",
]
