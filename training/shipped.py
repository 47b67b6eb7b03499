"""The default bundle's learned stages, shipped in the repository (`models/shipped/default/`).

Stages 1-3 of the `cpu` preset take over an hour on 2 cores; their exports are a few MB. So
they are committed with the records they were built with, and a build adopts a shipped stage
instead of training it when its config is the one the build would use and its inputs are the
ones the bundle holds. Inputs are compared by `stage_hash`, which keys the catalog on its item
texts and encoder, not on float bytes that differ between CPUs: a machine with another CPU
accepts them, a changed item text or config rebuilds them with the reason printed.

`r4t ship` writes the folder from a built bundle; the test suite checks that the shipped
records still match the code's recipe (tests/training/test_shipped.py), so a change to
stages 1-3 that changes their output fails CI until the stages are rebuilt and shipped again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.artifacts.bundle import (
    config_hash,
    git_commit,
    now_iso,
    read_manifest,
    sha256_file,
    stage,
    stage_inputs,
    write_json_atomic,
)
from service.artifacts.stages import SHIPPED_STAGES, inputs_of
from service.errors import BundleError

SHIPPED_ROOT = Path(__file__).resolve().parents[1] / "models" / "shipped"
SHIPPED_FILE = "shipped.json"
SHIPPED_PRESET = "cpu"  # the default bundle's recipe
SHIPPED_NAME = "default"


@dataclass(frozen=True)
class ShippedStages:
    """A shipped folder: its `shipped.json` (records, keys, provenance, eval figures) and the
    stages' files beside it."""

    folder: Path
    record: dict[str, Any]

    @classmethod
    def open(cls, folder: Path) -> ShippedStages | None:
        """The shipped stages in `folder`, or None when it holds none."""
        path = Path(folder) / SHIPPED_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path} is not valid JSON: {exc}") from exc
        return cls(Path(folder), record)

    @classmethod
    def for_preset(cls, preset: str) -> ShippedStages | None:
        """The repository's shipped stages of `preset` (the default's: cpu), if any."""
        if preset != SHIPPED_PRESET:
            return None
        return cls.open(SHIPPED_ROOT / SHIPPED_NAME)

    def expected_seconds(self, stages: list[str]) -> float | None:
        """How long the shipped default's build took for these stages (its recorded wall
        times; None when it records none of them): a first estimate of a build of the same
        recipe on a machine like its own."""
        walls = self.record.get("build_wall_s", {})
        known = [float(walls[name]) for name in stages if walls.get(name) is not None]
        return sum(known) if known else None

    @property
    def keys(self) -> dict[str, dict[str, Any]]:
        """{stage: the config it is current by}, in build order, as the code that built it
        computed them."""
        return {name: self.record["keys"][name] for name in SHIPPED_STAGES}

    def mismatch(self, name: str, key: dict[str, Any], manifest: dict[str, Any]) -> str | None:
        """Why the shipped `name` cannot stand in for a build with `key` on this bundle's
        inputs (None: it can)."""
        shipped = self.record["stages"].get(name)
        if shipped is None:
            return "not shipped"
        if shipped["config_hash"] != config_hash(key):
            return "the shipped copy was built with another config"
        now = stage_inputs(manifest, name)
        differ = [dep for dep in inputs_of(name)
                  if shipped["inputs"].get(dep) != now.get(dep)]
        if differ:
            return f"the shipped copy was built on another {', '.join(differ)}"
        return None

    def adopt(self, bundle_dir: Path, manifest: dict[str, Any], name: str) -> dict[str, Any]:
        """Copy the shipped stage into the bundle, checked against its recorded sha256, and
        commit it with its shipped record; returns the manifest."""
        shipped = self.record["stages"][name]
        record = {**shipped, "shipped_from": str(self.folder)}
        with stage(bundle_dir, manifest, name, record) as staged:
            for file in shipped["files"]:
                source, target = self.folder / file, staged / file
                expected = self.record["files"][file]
                if not source.is_file() or sha256_file(source) != expected["sha256"]:
                    raise BundleError(f"{source}: missing or not the file shipped "
                                      f"(sha256 {expected['sha256'][:12]}…)")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
        return read_manifest(bundle_dir)


def shippable(bundle_dir: Path, keys: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """The bundle's manifest, or a BundleError when its stages 1-3 are missing or not built by
    `keys` (the code's recipe now), or when `out` holds something other than shipped stages."""
    if out.exists() and not (out / SHIPPED_FILE).is_file():
        raise BundleError(f"{out} exists and holds no {SHIPPED_FILE}: name an empty --out")
    manifest = read_manifest(bundle_dir)
    stages = manifest.get("stages", {})
    missing = [name for name in SHIPPED_STAGES if name not in stages]
    if missing:
        raise BundleError(f"{bundle_dir} lacks {', '.join(missing)}: build it first "
                          "(r4t bundle)")
    stale = [name for name in SHIPPED_STAGES
             if stages[name]["config_hash"] != config_hash(keys[name])]
    if stale:
        raise BundleError(f"{bundle_dir}: {', '.join(stale)} not built by this recipe: "
                          "rebuild first (r4t bundle)")
    return manifest


def ship(bundle_dir: Path, keys: dict[str, dict[str, Any]], figures: dict[str, Any],
         out: Path) -> Path:
    """Write `out/shipped.json` and copy the bundle's stages 1-3 beside it (`shippable`
    first)."""
    manifest = shippable(bundle_dir, keys, out)
    stages = manifest["stages"]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    for name in SHIPPED_STAGES:
        for file in stages[name]["files"]:
            (out / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle_dir / file, out / file)
            files[file] = manifest["files"][file]
    record = {
        "preset": SHIPPED_PRESET, "shipped": now_iso(), "git_commit": git_commit(),
        "bundle": {"name": manifest.get("name"), "seed": manifest.get("seed"),
                   "created": manifest.get("created"), "encoder": manifest.get("encoder"),
                   "n_items": manifest.get("n_items")},
        "keys": {name: keys[name] for name in SHIPPED_STAGES},
        "stages": {name: _portable(stages[name]) for name in SHIPPED_STAGES},
        "build_wall_s": {name: record.get("build_wall_s") for name, record in stages.items()},
        "files": files, "eval": figures,
    }
    write_json_atomic(out / SHIPPED_FILE, record)
    return out


def _portable(record: dict[str, Any]) -> dict[str, Any]:
    """A stage record without the paths of the machine that built it."""
    return {k: v for k, v in record.items() if k not in ("checkpoint", "run_dir",
                                                           "shipped_from")}
