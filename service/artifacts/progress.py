"""A bundle build's progress record (`<bundle>/build.json`, written by training/progress.py),
read here so /readyz and /v1/info report a build under way without the service importing
training; it is not checksummed, and a "running" build whose process is gone reads as failed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BUILD_STATUS = "build.json"  # progress of a running `build_bundle`, not checksummed


def read_build_status(bundle_dir: Path) -> dict[str, Any] | None:
    """The progress of the bundle's last `build_bundle` (build.json), or None when there is
    none: {"state": "running"|"done"|"failed", "pid", "started", "updated", "plan": [{"stage",
    "action", "reason"}], "current", "finished", "error"}. A "running" build whose process is
    gone reads as "failed"."""
    try:
        status = json.loads((Path(bundle_dir) / BUILD_STATUS).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(status, dict):
        return None
    if status.get("state") == "running" and not process_alive(status.get("pid")):
        status["state"] = "failed"
        status["error"] = f"the build (pid {status.get('pid')}) stopped without finishing"
    return status


def process_alive(pid: Any) -> bool:
    """Whether a process of this id runs on this machine."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
