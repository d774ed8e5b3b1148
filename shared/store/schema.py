"""The Redis key schema (docs/design.md section 5): every key name, and the fields of the registry's
and the sessions' hashes.

Every key name microturn uses is built here, so the gateway, the worker and the Lua scripts cannot
drift apart on spelling. Two groups of keys with different placement needs:

- Registry keys (`{mt}:workers`, `{mt}:worker:<id>`, `{mt}:suspect:<id>`) carry the hash tag
  `{<prefix>}`, so they all map to one Redis Cluster slot and the placement script may touch them
  together atomically.
- Session keys (`mt:session:{<sid>}`, `mt:log:{<sid>}`) carry a tag of their own, the sid: one
  session's two keys share a slot (a script or MULTI may touch both, and a failover loses or keeps
  them together), and sessions spread over every slot of a cluster; nothing ever needs two
  sessions' keys in one command.

The byte format of the token log's value is shared/store/log_format.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Final


@cache
def lua_script(*names: str) -> str:
    """The text of `shared/store/lua/<name>.lua` for each name, in order (a prelude first), read once from
    the installed package. Every Lua script lives in that folder, one file each, with its KEYS and
    ARGV documented at its top."""
    lua = resources.files("shared.store").joinpath("lua")
    return "".join(lua.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in names)


def lua_code(script: str) -> str:
    """`script` without its comment lines. A script sent whole with every call (EVAL, as a cluster
    pipeline must) then costs Redis its code's bytes, not its documentation's (the token log's
    append: 393 bytes against 1,305, with every flush of every session)."""
    return "".join(line for line in script.splitlines(keepends=True) if not line.lstrip().startswith("--"))


DEFAULT_PREFIX: Final = "mt"

# Fields of the worker hash `{mt}:worker:<id>`. shared/store/lua/place.lua spells the first four itself:
# keep the two in step.
WORKER_URL: Final = "url"
WORKER_STATE: Final = "state"
WORKER_SESSIONS: Final = "sessions"
WORKER_MAX_SESSIONS: Final = "max_sessions"
WORKER_KV_TOKENS_FREE: Final = "kv_tokens_free"
WORKER_KV_TOKENS_TOTAL: Final = "kv_tokens_total"
WORKER_MODEL: Final = "model"
WORKER_HEARTBEAT_MS: Final = "heartbeat_ms"
# The names of the prefixes whose KV the worker holds (shared/store/prefix_label.py); place.lua
# spells it too.
WORKER_PREFIXES: Final = "prefixes"

STATE_READY: Final = "ready"
STATE_DRAINING: Final = "draining"

# Fields of the session hash `mt:session:<sid>`. Hashes written by older versions also hold a
# `last_seq` (always 0, never read): readers ignore it.
SESSION_WORKER: Final = "worker"
SESSION_TOKEN_SHA256: Final = "token_sha256"
SESSION_MODEL: Final = "model"
SESSION_CREATED_MS: Final = "created_ms"
SESSION_CONFIG: Final = "config"
# With auth on, the limits the session was opened under (`AuthLimits`): its key's digest, and each
# granted limit by its name after the prefix (`auth_max_session_s`, `auth_max_tokens`).
SESSION_AUTH_KEY: Final = "auth_key"
SESSION_AUTH_LIMIT_PREFIX: Final = "auth_"
# The tokens a budgeted session spent, settled every second by the gateways (`SessionUsage`).
SESSION_AUTH_USED: Final = "auth_used"


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Builds every key name from one prefix, so several deployments can share one Redis.

    The prefix also names the registry hash tag: `KeySchema("mt").workers()` is `{mt}:workers`.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        # A brace in the prefix would move or break the hash tag, splitting the registry across slots;
        # whitespace would make keys awkward to address from redis-cli.
        if not self.prefix or any(c in self.prefix for c in "{} \t\r\n"):
            raise ValueError(f"invalid key prefix {self.prefix!r}: must be non-empty, no braces or spaces")

    @property
    def tag(self) -> str:
        """The hash tag shared by every registry key: `{<prefix>}`."""
        return "{" + self.prefix + "}"

    def workers(self) -> str:
        """ZSET: worker id -> load score, ascending = least loaded first."""
        return f"{self.tag}:workers"

    def worker_prefix(self) -> str:
        """What a worker id is appended to for its hash key; the placement script gets it as ARGV."""
        return f"{self.tag}:worker:"

    def worker(self, worker_id: str) -> str:
        """HASH describing one worker; its TTL is the worker's liveness."""
        if not worker_id:
            raise ValueError("empty worker id")
        return self.worker_prefix() + worker_id

    def suspect_prefix(self) -> str:
        """What a worker id is appended to for its suspect key; the placement script gets it as ARGV."""
        return f"{self.tag}:suspect:"

    def suspect(self, worker_id: str) -> str:
        """STRING with a short TTL: a gateway lost its link to this worker; placement skips it meanwhile.

        In the registry slot, so place.lua reads it in the same atomic step. A worker that registers
        afresh (restarted) deletes it; otherwise it lapses after its TTL.
        """
        if not worker_id:
            raise ValueError("empty worker id")
        return self.suspect_prefix() + worker_id

    def model(self, name: str) -> str:
        """HASH: a served model's chat template and end-of-turn tokens, written by its workers at
        registration (shared/store/models.py); what a gateway needs to render a conversation."""
        if not name:
            raise ValueError("empty model name")
        return f"{self.tag}:model:{name}"

    def session(self, sid: str) -> str:
        """HASH: the session's affinity (worker), resume-token digest, model, config."""
        if not sid:
            raise ValueError("empty session id")
        return f"{self.prefix}:session:{{{sid}}}"

    # API keys (gateway/auth/api_keys.py). Each per-key key names one credential digest, so a script
    # that touches one of them is single-key and runs on Redis Cluster; none needs a hash tag.

    def api_keys(self) -> str:
        """HASH: key name -> SHA-256 hex of the key (the index `keys list` and `keys revoke` use)."""
        return f"{self.prefix}:apikeys"

    def api_key(self, digest: str) -> str:
        """HASH: one API key's name and limits, addressed by the SHA-256 of the key."""
        return f"{self.prefix}:apikey:{digest}"

    def key_sessions(self, digest: str) -> str:
        """ZSET: session id -> lease expiry (ms, server clock) of each live session of one key."""
        return f"{self.prefix}:keysessions:{digest}"

    def key_usage(self, digest: str, day: str) -> str:
        """STRING: tokens (in + out) one key spent on one UTC day (`YYYYMMDD`)."""
        return f"{self.prefix}:keyusage:{digest}:{day}"

    def client_token(self, digest: str) -> str:
        """HASH: a browser token's key and limits, addressed by the SHA-256 of the token."""
        return f"{self.prefix}:clienttoken:{digest}"

    def log(self, sid: str) -> str:
        """STRING: the session's token history, little-endian uint32, appended per turn."""
        if not sid:
            raise ValueError("empty session id")
        return f"{self.prefix}:log:{{{sid}}}"
