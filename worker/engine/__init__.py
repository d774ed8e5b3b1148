"""The streaming-session engine: `Engine.load(...)`, then sessions that append chunks and generate."""

from worker.engine.config import EngineConfig
from worker.engine.core import EngineStats
from worker.engine.engine import Engine, torch_dtype
from worker.engine.turn import TokenDelta, TurnResult

__all__ = ["Engine", "EngineConfig", "EngineStats", "TokenDelta", "TurnResult", "torch_dtype"]
