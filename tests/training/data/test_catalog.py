import json
from pathlib import Path

import pytest

import training.data.catalog as catalog_module
from service.artifacts.bundle import MANIFEST
from service.errors import CatalogError
from training.data.catalog import jsonl_catalog
from training.pipeline import CatalogConfig, build_catalog


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def good(i: int) -> str:
    return json.dumps({"id": f"item-{i}", "text": f"thing number {i}", "color": "red"})


def test_good_catalog_keeps_metadata(tmp_path):
    catalog = jsonl_catalog(write_lines(tmp_path / "c.jsonl", [good(1), good(2)]))
    assert catalog.ids == ["item-1", "item-2"]
    assert catalog.metadata[0] == {"color": "red"}


def test_missing_file(tmp_path):
    with pytest.raises(CatalogError, match="not found"):
        jsonl_catalog(tmp_path / "absent.jsonl")


def test_invalid_json_names_the_line(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good(1), good(2), '{"id": "x", "text": '])
    with pytest.raises(CatalogError, match=r"c\.jsonl:3: invalid JSON"):
        jsonl_catalog(path)


def test_duplicate_id_names_both_lines(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good(1), good(2), good(1)])
    with pytest.raises(CatalogError, match=r":3: duplicate id 'item-1' \(first seen on line 1\)"):
        jsonl_catalog(path)


@pytest.mark.parametrize("text", ["", "   ", None])
def test_empty_text_names_the_line(tmp_path, text):
    bad = json.dumps({"id": "x", "text": text})
    with pytest.raises(CatalogError, match=r":2: 'text' is missing or empty"):
        jsonl_catalog(write_lines(tmp_path / "c.jsonl", [good(1), bad]))


def test_non_object_line(tmp_path):
    with pytest.raises(CatalogError, match=r":1: expected a JSON object"):
        jsonl_catalog(write_lines(tmp_path / "c.jsonl", ["[1, 2]"]))


def test_too_many_items_without_factory(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog_module, "MAX_EXACT_ITEMS", 3)
    path = write_lines(tmp_path / "c.jsonl", [good(i) for i in range(5)])
    with pytest.raises(CatalogError, match=r":4: more than 3 items need an approximate index"):
        jsonl_catalog(path)
    assert len(jsonl_catalog(path, index_factory="HNSW32")) == 5


def test_bad_catalog_leaves_no_half_written_bundle(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [good(1), good(1)])
    bundle_dir = tmp_path / "bundle"
    with pytest.raises(CatalogError):
        build_catalog(bundle_dir, CatalogConfig(source=str(path)))
    assert not bundle_dir.exists() or not any(bundle_dir.iterdir())


def test_bad_catalog_keeps_existing_bundle_intact(tmp_path, small_bundle_dir):
    before = (small_bundle_dir / MANIFEST).read_text()
    path = write_lines(tmp_path / "c.jsonl", [good(1), "not json"])
    with pytest.raises(CatalogError):
        build_catalog(small_bundle_dir, CatalogConfig(source=str(path)))
    assert (small_bundle_dir / MANIFEST).read_text() == before
    assert not list(small_bundle_dir.glob(".staging-*"))


def test_rebuild_is_skipped_when_up_to_date(small_bundle_dir, small_sources, capsys):
    catalog, benchmark = small_sources
    build_catalog(small_bundle_dir, CatalogConfig(source=str(catalog), benchmark=str(benchmark)))
    assert "up to date" in capsys.readouterr().out


def test_approximate_index_factory(tmp_path, small_sources):
    catalog, _ = small_sources
    manifest = build_catalog(tmp_path / "hnsw", CatalogConfig(source=str(catalog),
                                                             index_factory="HNSW16"))
    assert manifest["stages"]["catalog"]["config"]["index_factory"] == "HNSW16"
