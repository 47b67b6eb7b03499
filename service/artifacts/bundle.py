"""Artifact bundles: `models/<name>/manifest.json` plus the files it lists with their sha256.

A stage's files are moved in and the manifest replaced atomically last, so a bundle on disk is
consistent or refused with a reason. A stage is current while its config is today's and each
input (service.artifacts.stages) is the record it was built from (`stage_status`); a build keeps
`build.json` up to date for service/artifacts/progress.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from service.artifacts.items import ItemStore
from service.artifacts.lexical import LEXICAL_FILE, LexicalIndex
from service.artifacts.parts import PARTS_FILE, ItemParts
from service.artifacts.stages import STAGE, inputs_of
from service.errors import BundleAbsentError, BundleError
from service.runtime.encoder import EncoderConfig
from service.runtime.index import FaissIndex, IndexChoice, VectorIndex, chosen_index, load_index
from service.runtime.milvus import MILVUS_STAGE, MilvusIndex

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
REPORTS_DIR = "eval"  # evaluation reports: written after the fact, not checksummed
# A stage record's field naming what its files are a function of, where those files are not
# byte-stable across machines (stage_hash)
CONTENT_KEY = "content"

# An engine call's bound for offline callers (eval, bench), whose pools and batches are large;
# the service passes its serving deadline (R4T_INDEX_TIMEOUT_S).
ENGINE_TIMEOUT_S = 300.0


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
    root = Path(__file__).resolve().parents[2]
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
        raise BundleAbsentError(f"no bundle at {bundle_dir}: {MANIFEST} is missing")
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
        path = inside(bundle_dir, name)
        if not path.is_file():
            raise BundleError(f"bundle {bundle_dir} is partial: {name} is missing")
        if path.stat().st_size != record["bytes"] or sha256_file(path) != record["sha256"]:
            raise BundleError(f"bundle {bundle_dir} is corrupted: {name} fails its sha256 check")
    return manifest


def inside(bundle_dir: Path, name: str) -> Path:
    """`bundle_dir / name` for a relative path that stays inside the bundle (symlinks
    followed); a BundleError for an absolute path, a `..` or a link out of it."""
    relative = PurePosixPath(name)
    path = bundle_dir / relative
    if relative.is_absolute() or ".." in relative.parts or not path.resolve().is_relative_to(
            bundle_dir.resolve()):
        raise BundleError(f"bundle {bundle_dir} names {name!r}, a path outside the bundle")
    return path


def listed_file(bundle_dir: Path, manifest: dict[str, Any], name: str) -> Path:
    """The bundle file `name`, refused unless the manifest lists (and so checksums) it."""
    path = inside(bundle_dir, name)
    if name not in manifest.get("files", {}):
        raise BundleError(f"bundle {bundle_dir} loads {name!r}, which its manifest does not list")
    return path


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


FILE_MODE = 0o644  # bundle files: written by the builder, readable by whoever serves them


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` atomically with `data` as JSON (write a temp file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would hide the manifest from a service user
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(bundle_dir: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically."""
    manifest["updated"] = now_iso()
    write_json_atomic(bundle_dir / MANIFEST, manifest)


def commit_stage(
    bundle_dir: Path,
    manifest: dict[str, Any],
    stage: str,
    staged_dir: Path,
    files: list[str],
    record: dict[str, Any],
) -> dict[str, Any]:
    """Move a finished stage's files from `staged_dir` into the bundle and record them.

    The record gets the stage's `inputs` (unless it brings them) and replaces the stage's
    previous one; files of the previous record that the new one does not list are dropped.
    Prefer `with stage(...)`, which stages, commits and cleans up."""
    inputs = record.get("inputs", stage_inputs(manifest, stage))
    previous = manifest.get("stages", {}).get(stage) or {}
    for name in files:
        target = bundle_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged_dir / name, target)
        manifest["files"][name] = {"sha256": sha256_file(target), "bytes": target.stat().st_size}
    dropped = set(previous.get("files", ())) - set(files)
    for name in dropped:
        manifest["files"].pop(name, None)
    manifest["stages"][stage] = {
        **record,
        "inputs": inputs,
        "files": sorted(files),
        "git_commit": git_commit(),
        "finished": now_iso(),
    }
    write_manifest(bundle_dir, manifest)
    for name in dropped:
        (bundle_dir / name).unlink(missing_ok=True)
    shutil.rmtree(staged_dir, ignore_errors=True)
    return manifest


@contextmanager
def stage(
    bundle_dir: Path, manifest: dict[str, Any], name: str, record: dict[str, Any]
) -> Iterator[Path]:
    """`with stage(bundle_dir, manifest, "folm", record) as staged:` yields a staging folder
    inside the bundle; the body writes the stage's files under it and may add to `record`.
    When the body returns, the files are committed (those the body lists in
    `record["files"]`, else every file written under `staged`) with `record` as the stage's
    manifest record, its `inputs` taken from `manifest` as it was on entry. When the body
    raises, the bundle is left as it was. The staging folder is removed either way."""
    bundle_dir = Path(bundle_dir)
    bundle_dir.mkdir(parents=True, exist_ok=True)
    inputs = stage_inputs(manifest, name)
    staged = Path(tempfile.mkdtemp(prefix=f".staging-{name}-", dir=bundle_dir))
    try:
        yield staged
        files = record.get("files")
        if files is None:
            files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*")
                           if p.is_file())
        commit_stage(bundle_dir, manifest, name, staged, list(files),
                     {"inputs": inputs, **record})
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def stage_hash(manifest: dict[str, Any], name: str) -> str | None:
    """The identity of a stage's current record (None when absent): its config hash, its
    inputs and its content: the sha256 of its files, or the record's `content` where its files
    hold floats that differ between CPUs (the catalog's embeddings and index: their item texts
    and encoder instead), so that stages built on one machine stay current on another."""
    record = manifest.get("stages", {}).get(name)
    if not record:
        return None
    files = manifest.get("files", {})
    content = record.get(CONTENT_KEY)
    if content is None:
        content = {f: files.get(f, {}).get("sha256") for f in record.get("files", ())}
    return config_hash({
        "config_hash": record.get("config_hash"), "inputs": record.get("inputs"),
        "files": content,
    })


def stage_inputs(manifest: dict[str, Any], name: str) -> dict[str, str]:
    """{input stage: its stage_hash} of the inputs (`inputs_of`) the manifest holds now."""
    hashes = {dep: stage_hash(manifest, dep) for dep in inputs_of(name)}
    return {dep: h for dep, h in hashes.items() if h is not None}


def stage_status(
    manifest: dict[str, Any], name: str, stage_config: dict[str, Any],
    changing: Iterable[str] = (),
) -> tuple[str, str]:
    """(action, reason) for a stage that would be built with `stage_config` now:
    ("current", ""), ("build", "absent"), ("rebuild", "config changed") or
    ("rebuild", "catalog changed") when an input's record is not the one it was built from
    or is in `changing` (stages about to be rebuilt)."""
    record = manifest.get("stages", {}).get(name)
    if not record:
        return "build", "absent"
    if record.get("config_hash") != config_hash(stage_config):
        return "rebuild", "config changed"
    recorded = record.get("inputs")
    if recorded is None:
        return "rebuild", "its inputs were not recorded"
    now = stage_inputs(manifest, name)
    changed = [dep for dep in inputs_of(name)
               if dep in set(changing) or recorded.get(dep) != now.get(dep)]
    if changed:
        return "rebuild", f"{', '.join(changed)} changed"
    return "current", ""


def require_stages(bundle_dir: Path, needed: Iterable[str | tuple[str, ...]], what: str,
                   manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest, or a BundleError naming the first stage `what` needs that the bundle
    lacks and the command that builds it (a tuple in `needed`: any one of its stages)."""
    if manifest is None:
        try:
            manifest = read_manifest(Path(bundle_dir))
        except BundleError:
            manifest = {}
    stages = manifest.get("stages", {})
    for need in needed:
        options = (need,) if isinstance(need, str) else need
        if not any(name in stages for name in options):
            command = STAGE[options[0]].command.format(bundle=bundle_dir)
            raise BundleError(f"{what} needs the `{' or '.join(options)}` stage, which "
                              f"{bundle_dir} lacks: build it with `{command}`")
    return manifest


@dataclass
class Bundle:
    """A verified bundle loaded for serving or evaluation."""

    path: Path
    manifest: dict[str, Any]
    items: ItemStore
    index: VectorIndex
    lexical: LexicalIndex | None = None  # the catalog's BM25 index, when the bundle has one
    # what readers compute once per bundle from its files (service.ranker.words), dropped with it
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return str(self.manifest.get("name", self.path.name))

    @property
    def encoder_config(self) -> EncoderConfig:
        enc = self.manifest["encoder"]
        folder = enc.get("folder")  # an exported ONNX encoder inside the bundle
        if folder is not None and not any(
                name.startswith(f"{folder}/") for name in self.manifest.get("files", {})):
            raise BundleError(f"bundle {self.path}: its encoder folder {folder!r} holds no "
                              "file the manifest lists")
        return EncoderConfig(name=enc["name"], dim=int(enc["dim"]),
                             folder=None if folder is None else str(inside(self.path, folder)))

    @property
    def encoder_identity(self) -> tuple[str, int, tuple[str, ...]]:
        """Name, width and the exported encoder's checksums: equal ones embed alike, wherever
        the bundles lie."""
        enc, files = self.manifest["encoder"], self.manifest.get("files", {})
        prefix = f"{enc['folder']}/" if enc.get("folder") else None
        sums = tuple(sorted(r["sha256"] for name, r in files.items()
                            if prefix and name.startswith(prefix)))
        return str(enc["name"]), int(enc["dim"]), sums

    def has(self, name: str) -> bool:
        return name in self.manifest.get("files", {})

    @functools.cached_property
    def parts(self) -> ItemParts | None:
        """The catalog's part embeddings (service.artifacts.parts), None in a bundle built
        before the catalog stage wrote them; memory-mapped on first use."""
        if not self.has(PARTS_FILE):
            return None
        return ItemParts.load(self.path, tuple(self.manifest.get("parts", ())), len(self.items))


def load_bundle(bundle_dir: Path, index_choice: IndexChoice | None = None,
                engine_timeout_s: float = ENGINE_TIMEOUT_S) -> Bundle:
    """Verify checksums, then load the item store and the index (the bundle's own, the one
    `index_choice` builds over its embeddings, or the engine collection it names)."""
    bundle_dir = Path(bundle_dir)
    manifest = verify_bundle(bundle_dir)
    for needed in (INDEX_FILE, "items.jsonl", "embeddings.npy"):
        if needed not in manifest["files"]:
            raise BundleError(f"bundle {bundle_dir} has no {needed}: run `r4t catalog` first")
    items = ItemStore.load(bundle_dir)
    served: VectorIndex
    if index_choice is not None and index_choice.engine:  # the replica holds no index
        served = engine_index(bundle_dir, manifest, index_choice, engine_timeout_s)
    else:
        served = own_index(bundle_dir, items, index_choice)
    lexical = LexicalIndex(bundle_dir / LEXICAL_FILE) if LEXICAL_FILE in manifest["files"] \
        else None
    return Bundle(path=bundle_dir, manifest=manifest, items=items, index=served,
                  lexical=lexical)


def own_index(bundle_dir: Path, items: ItemStore,
              index_choice: IndexChoice | None) -> FaissIndex:
    """The bundle's FAISS index, or the one `index_choice` builds over its embeddings."""
    index = load_index(bundle_dir / INDEX_FILE)
    if index.ntotal != len(items) or index.d != items.embeddings.shape[1]:
        raise BundleError(
            f"bundle {bundle_dir}: index holds {index.ntotal}x{index.d}, "
            f"items {items.embeddings.shape}"
        )
    choice = index_choice or IndexChoice()  # the bundle's own
    return FaissIndex(chosen_index(index, items.embeddings, choice), items.metadata,
                      choice.name, items.embeddings)


def engine_index(bundle_dir: Path, manifest: dict[str, Any], choice: IndexChoice,
                 timeout_s: float) -> MilvusIndex:
    """The engine collection the bundle records, verified to hold its current catalog."""
    record = manifest.get("stages", {}).get(MILVUS_STAGE)
    if not record:
        raise BundleError(f"bundle {bundle_dir} records no Milvus collection: load it with "
                          "`r4t index milvus://host:port/collection`")
    if record.get("inputs") != stage_inputs(manifest, MILVUS_STAGE):
        raise BundleError(f"bundle {bundle_dir}: the catalog changed since it was loaded into "
                          f"Milvus collection {record.get('collection')!r}: run `r4t index` "
                          "again")
    return MilvusIndex.of_record(record, choice.uri, timeout_s)
