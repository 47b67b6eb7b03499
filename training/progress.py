"""The progress file `<bundle>/build.json`: what a running build is doing, for whoever polls
it (`service.artifacts.progress.read_build_status`), and the lock against a second build."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.artifacts.bundle import now_iso, write_json_atomic
from service.artifacts.progress import BUILD_STATUS, read_build_status
from service.errors import BundleError


class BuildProgress:
    """`<bundle>/build.json`, rewritten atomically at every step of a build (see
    `service.artifacts.progress.read_build_status`). Refuses a second live build of one bundle."""

    def __init__(self, bundle_dir: Path) -> None:
        running = read_build_status(bundle_dir)
        if running and running.get("state") == "running" and running.get("pid") != os.getpid():
            raise BundleError(f"{bundle_dir} is being built by process {running['pid']} "
                              f"({BUILD_STATUS})")
        self.path = bundle_dir / BUILD_STATUS
        self.status: dict[str, Any] = {
            "state": "running", "pid": os.getpid(), "started": now_iso(), "plan": [],
            "current": None, "finished": [], "error": None,
        }
        self.update()

    def update(self, **changes: Any) -> None:
        """Merge `changes` into the status and rewrite the file: a poller never reads half."""
        self.status.update(changes, updated=now_iso())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.status)
