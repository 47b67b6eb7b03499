import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from service.artifacts.bundle import MANIFEST, load_bundle, verify_bundle
from service.errors import BundleError


@pytest.fixture
def bundle_copy(small_bundle_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(small_bundle_dir, target)
    return target


def test_manifest_records_provenance(small_bundle_dir: Path):
    manifest = verify_bundle(small_bundle_dir)
    assert manifest["format_version"] == 1
    assert manifest["encoder"]["dim"] == 128
    assert manifest["n_items"] == len(load_bundle(small_bundle_dir).items)
    for key in ("created", "git_commit", "seed", "config", "stages", "files"):
        assert key in manifest
    assert {"items.jsonl", "embeddings.npy", "index.faiss"} <= set(manifest["files"])
    for record in manifest["files"].values():
        assert len(record["sha256"]) == 64


def test_loaded_bundle_is_row_aligned(small_bundle_dir: Path):
    bundle = load_bundle(small_bundle_dir)
    assert bundle.index.ntotal == len(bundle.items.ids)
    row = 7
    scores, rows = bundle.index.search(bundle.items.embeddings[row : row + 1], 1)
    assert rows[0, 0] == row and scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    assert np.allclose(np.linalg.norm(bundle.items.embeddings, axis=1), 1.0, atol=1e-5)
    assert "lemma" in bundle.items.metadata[0]  # extra catalog fields are kept


def test_corrupted_file_is_refused(bundle_copy: Path):
    path = bundle_copy / "embeddings.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"corrupted: embeddings\.npy"):
        load_bundle(bundle_copy)


def test_missing_file_is_refused_as_partial(bundle_copy: Path):
    (bundle_copy / "index.faiss").unlink()
    with pytest.raises(BundleError, match=r"partial: index\.faiss"):
        load_bundle(bundle_copy)


def test_unknown_format_version_is_refused(bundle_copy: Path):
    manifest = json.loads((bundle_copy / MANIFEST).read_text())
    manifest["format_version"] = 99
    (bundle_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format_version"):
        load_bundle(bundle_copy)


def test_missing_manifest_is_refused(tmp_path: Path):
    with pytest.raises(BundleError, match=r"manifest\.json is missing"):
        load_bundle(tmp_path)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "items/../../x"])
def test_a_manifest_naming_a_file_outside_the_bundle_is_refused(small_bundle_dir, tmp_path,
                                                                name):
    copy = tmp_path / "b"
    shutil.copytree(small_bundle_dir, copy)
    (tmp_path / "outside.txt").write_text("x")
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="outside the bundle"):
        verify_bundle(copy)


@pytest.mark.parametrize("folder, problem", [("/usr/lib", "holds no file"),
                                             ("../elsewhere", "holds no file")])
def test_an_encoder_folder_the_manifest_does_not_list_is_refused(small_bundle_dir, folder,
                                                                 problem):
    bundle = load_bundle(small_bundle_dir)
    bundle.manifest["encoder"] = {**bundle.manifest["encoder"], "folder": folder}
    with pytest.raises(BundleError, match=problem):
        _ = bundle.encoder_config


@pytest.mark.parametrize("model", ["/etc/hostname", "../manifest.json", "unlisted.txt"])
def test_a_ranker_model_outside_the_manifest_is_refused(small_bundle_dir, tmp_path, model):
    from service.ranker.ranker import RANKER_CONFIG, Ranker, RankerConfig

    copy = tmp_path / "b"
    shutil.copytree(small_bundle_dir, copy)
    (copy / "ranker" / "unlisted.txt").write_text("tree\n")
    config = RankerConfig.from_dict({**RankerConfig().to_dict(), "model": model})
    (copy / "ranker" / RANKER_CONFIG).write_text(json.dumps(config.to_dict()))
    with pytest.raises(BundleError, match=r"outside the bundle|does not list"):
        Ranker.load(copy / "ranker", json.loads((copy / MANIFEST).read_text()))


def test_every_bundle_file_is_readable_by_another_user(small_bundle_dir):
    """The image serves its bundle as an unprivileged user that does not own it: no file the
    build writes (the manifest, written atomically, included) may be private to its owner."""
    private = [p.name for p in small_bundle_dir.rglob("*")
               if p.is_file() and not p.stat().st_mode & stat.S_IROTH]
    assert private == []
