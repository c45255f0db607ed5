"""Where a broker keeps its checkpoint when ``--state-dir`` is not given."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

ENV_STATE_DIR = "KVCACHED_BROKER_STATE_DIR"


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$KVCACHED_BROKER_STATE_DIR``, else ``/var/lib/kvcached-broker`` for root, else
    ``$XDG_STATE_HOME/kvcached-broker``, else ``~/.local/state/kvcached-broker``."""
    env = os.environ if env is None else env
    if env.get(ENV_STATE_DIR):
        return Path(env[ENV_STATE_DIR])
    if os.getuid() == 0:
        return Path("/var/lib/kvcached-broker")
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "kvcached-broker"
    return Path.home() / ".local" / "state" / "kvcached-broker"
