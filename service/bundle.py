"""Artifact bundles: `models/<name>/manifest.json` plus the files it lists with their sha256.

A bundle is written stage by stage (catalog, index, benchmark, then the models); each stage's
files are moved in and the manifest is replaced atomically last, so a bundle on disk is
either consistent or refused on load with a clear reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss

from service.encoder import EncoderConfig
from service.errors import BundleError
from service.index import load_index
from service.items import ItemStore

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
REPORTS_DIR = "eval"  # evaluation reports: written after the fact, not checksummed


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def config_hash(config: dict[str, Any]) -> str:
    """Stable short hash of a JSON-able config: a stage is current when its hash matches."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def git_commit() -> str:
    """HEAD's sha, with "-dirty" when the code that builds artifacts has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=5, cwd=root).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "service", "training"],
                                capture_output=True, text=True, check=True, timeout=5, cwd=root)
        return head + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_manifest(bundle_dir: Path) -> dict[str, Any]:
    """Parse the manifest; raise BundleError when it is absent, unreadable or of another format."""
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise BundleError(f"no bundle at {bundle_dir}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from exc
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION}")
    return manifest


def verify_bundle(bundle_dir: Path) -> dict[str, Any]:
    """Check every listed file exists with its recorded sha256; return the manifest."""
    manifest = read_manifest(bundle_dir)
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    if not files:
        raise BundleError(f"bundle {bundle_dir} lists no files: it is partial")
    for name, record in sorted(files.items()):
        path = bundle_dir / name
        if not path.is_file():
            raise BundleError(f"bundle {bundle_dir} is partial: {name} is missing")
        if path.stat().st_size != record["bytes"] or sha256_file(path) != record["sha256"]:
            raise BundleError(f"bundle {bundle_dir} is corrupted: {name} fails its sha256 check")
    return manifest


def new_manifest(name: str, encoder: EncoderConfig, seed: int) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "created": now_iso(),
        "git_commit": git_commit(),
        "seed": seed,
        "encoder": {"name": encoder.name, "dim": encoder.dim},
        "n_items": 0,
        "stages": {},
        "files": {},
    }


def write_manifest(bundle_dir: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically (write a temp file, fsync, rename)."""
    manifest["updated"] = now_iso()
    fd, tmp = tempfile.mkstemp(dir=bundle_dir, prefix=".manifest.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(manifest, out, indent=2, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, bundle_dir / MANIFEST)


def commit_stage(
    bundle_dir: Path,
    manifest: dict[str, Any],
    stage: str,
    staged_dir: Path,
    files: list[str],
    record: dict[str, Any],
) -> dict[str, Any]:
    """Move a finished stage's files from `staged_dir` into the bundle and record them."""
    for name in files:
        target = bundle_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged_dir / name, target)
        manifest["files"][name] = {"sha256": sha256_file(target), "bytes": target.stat().st_size}
    manifest["stages"][stage] = {
        **record,
        "files": sorted(files),
        "git_commit": git_commit(),
        "finished": now_iso(),
    }
    write_manifest(bundle_dir, manifest)
    shutil.rmtree(staged_dir, ignore_errors=True)
    return manifest


def stage_is_current(manifest: dict[str, Any], stage: str, stage_config: dict[str, Any]) -> bool:
    record = manifest.get("stages", {}).get(stage)
    return bool(record) and record.get("config_hash") == config_hash(stage_config)


@dataclass
class Bundle:
    """A verified bundle loaded for serving or evaluation."""

    path: Path
    manifest: dict[str, Any]
    items: ItemStore
    index: faiss.Index

    @property
    def name(self) -> str:
        return str(self.manifest.get("name", self.path.name))

    @property
    def encoder_config(self) -> EncoderConfig:
        enc = self.manifest["encoder"]
        return EncoderConfig(name=enc["name"], dim=int(enc["dim"]))

    def has(self, name: str) -> bool:
        return name in self.manifest.get("files", {})


def load_bundle(bundle_dir: Path) -> Bundle:
    """Verify checksums, then load the item store and the index."""
    bundle_dir = Path(bundle_dir)
    manifest = verify_bundle(bundle_dir)
    for needed in (INDEX_FILE, "items.jsonl", "embeddings.npy"):
        if needed not in manifest["files"]:
            raise BundleError(f"bundle {bundle_dir} has no {needed}: run `r4t catalog` first")
    items = ItemStore.load(bundle_dir)
    index = load_index(bundle_dir / INDEX_FILE)
    if index.ntotal != len(items) or index.d != items.embeddings.shape[1]:
        raise BundleError(
            f"bundle {bundle_dir}: index holds {index.ntotal}x{index.d}, "
            f"items {items.embeddings.shape}"
        )
    return Bundle(path=bundle_dir, manifest=manifest, items=items, index=index)
