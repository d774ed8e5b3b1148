"""The capacity benchmark's configuration and its per-step results (what the JSON holds)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

from loadtest.bench.config import STREAMING
from loadtest.capacity.locust_run import LocustStats
from loadtest.capacity.metrics import ServerCounts
from loadtest.capacity.search import best_passing
from loadtest.capacity.workload import ChunkLoad
from shared.errors import ErrorCode
from shared.settings import BENCH_MODEL
from shared.store.connection import redacted_url

NO_SESSION: Final = "no_session"
MODES: Final = (STREAMING, NO_SESSION)
P99_LIMIT_MS: Final = 200.0


@dataclass(frozen=True)
class CapacityConfig:
    model: str = BENCH_MODEL
    device: str | None = None  # None: cuda if torch sees a GPU, else cpu
    dtype: str | None = None  # None: the worker's default
    duration_s: float = 60.0
    load: ChunkLoad = field(default_factory=ChunkLoad)
    p99_limit_ms: float = P99_LIMIT_MS
    start_sessions: int = 1
    max_sessions: int = 256
    kv_tokens: int | None = None  # None: the worker's default
    modes: tuple[str, ...] = MODES
    redis_url: str | None = None  # None: an embedded Valkey
    redis_mode: str = "standalone"

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {', '.join(self.modes)}")
        if self.duration_s <= 0 or not 1 <= self.start_sessions <= self.max_sessions:
            raise ValueError("need duration_s > 0 and 1 <= start_sessions <= max_sessions")

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(body.pop("load"))
        body["modes"] = list(self.modes)
        if self.redis_url is not None:  # a report is shared: never with the password
            body["redis_url"] = redacted_url(self.redis_url)
        body["chunks_per_s"] = self.load.chunks_per_s
        return body


@dataclass(frozen=True)
class Step:
    """One load step: Locust's figures and what the servers counted meanwhile."""

    sessions: int
    locust: LocustStats
    servers: ServerCounts
    p99_limit_ms: float

    @property
    def passed(self) -> bool:
        return self.locust.p99_ms <= self.p99_limit_ms and self.locust.failures == 0

    @property
    def answered(self) -> int:
        return self.locust.requests - self.locust.chunk_failures

    @property
    def metrics_agree(self) -> bool:
        """Locust's answered chunks = the gateway's outputs = the worker's turns; each Locust failure
        is a gateway error, and each gateway error is a Locust failure but for `backpressure`
        refusals, which the Locust user sends again (loadtest/locustfile.py) and counts as failures
        only once its retries run out."""
        servers = self.servers
        refused = servers.gateway_errors_by_code.get(ErrorCode.BACKPRESSURE.value, 0)
        return (
            self.answered == servers.gateway_outputs == servers.worker_turns
            and servers.gateway_errors - refused <= self.locust.failures <= servers.gateway_errors
        )

    def to_json(self) -> dict[str, Any]:
        locust, servers = self.locust, self.servers
        return {
            "sessions": self.sessions,
            "p50_ms": locust.p50_ms,
            "p99_ms": locust.p99_ms,
            "errors": locust.failures,
            "chunk_p99_ms": locust.chunk_p99_ms,
            "reply_p99_ms": locust.reply_p99_ms,
            "within_limit": self.passed,
            "locust": {"chunks": locust.requests, "answered": self.answered, "failures": locust.failures},
            "gateway": {
                "chunks_forwarded": servers.gateway_chunks,
                "outputs": servers.gateway_outputs,
                "errors": servers.gateway_errors,
                "errors_by_code": servers.gateway_errors_by_code,
            },
            "worker": {
                "turns": servers.worker_turns,
                "errors": servers.worker_errors,
                "tokens_forwarded": servers.worker_tokens_forwarded,
            },
            "metrics_agree": self.metrics_agree,
        }


@dataclass
class ModeResult:
    mode: str
    steps: list[Step] = field(default_factory=list)

    @property
    def sessions(self) -> int:
        return best_passing({step.sessions: step.passed for step in self.steps})

    def to_json(self) -> dict[str, Any]:
        ordered = sorted(self.steps, key=lambda step: step.sessions)
        return {"sessions": self.sessions, "steps": [step.to_json() for step in ordered]}
