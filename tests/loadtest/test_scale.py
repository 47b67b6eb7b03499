"""The catalog-size benchmark: synthetic rows keep the catalog, and a small real run reports."""

from __future__ import annotations

import numpy as np

from loadtest.scale import BATCHES, markdown, run, synthetic_rows


def test_synthetic_rows_extend_the_catalog_with_unit_mixtures():
    catalog = np.eye(4, 8, dtype=np.float32)
    rows = synthetic_rows(catalog, 50)
    assert rows.shape == (50, 8) and np.array_equal(rows[:4], catalog)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    assert len(np.unique(rows.round(4), axis=0)) > 40  # mixtures, not copies
    assert np.array_equal(synthetic_rows(catalog, 3), catalog[:3])


def test_a_small_run_times_both_indexes_at_every_batch(small_bundle_dir):
    n = len(np.load(small_bundle_dir / "embeddings.npy"))
    report = run(small_bundle_dir, (n, 2 * n), "HNSW16/efSearch=128", threads=1)
    assert [r["size"] for r in report["rows"]] == [n, 2 * n]
    for row in report["rows"]:
        assert set(row["exact_s"]) == set(row["approximate_s"]) == set(BATCHES)
        assert all(v > 0 for v in [*row["exact_s"].values(), *row["approximate_s"].values()])
        assert 0.5 < row["recall"] <= 1.0
    table = markdown(report)
    assert f"| {2 * n:,} |" in table and "exact / HNSW16/efSearch=128" in table
