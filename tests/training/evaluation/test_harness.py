import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import InputError
from training.data import metrics
from training.data.metrics import group_hit_rate, precision, recall, set_vendi
from training.data.splits import load_split, query_texts
from training.evaluation.baselines import mmr_select, reward_greedy_select
from training.evaluation.harness import METRICS, evaluate, write_report


def test_metric_functions_by_hand():
    reference = {"a", "b", "c", "d"}
    assert recall({"a", "b", "x"}, reference) == 0.5
    assert precision(["a", "x", "y", "b"], reference) == 0.5
    assert group_hit_rate({"a", "x"}, [["a", "b"], ["c"], ["d", "a"]]) == pytest.approx(2 / 3)
    assert set_vendi(np.eye(3)) == pytest.approx(3.0)
    hit_at_1, ndcg = metrics.hit_at_1, metrics.ndcg
    assert hit_at_1(["a", "b"], "a") == 1.0 and hit_at_1(["b", "a"], "a") == 0.0
    assert np.isnan(hit_at_1(["a"], None))  # a broad query names no one item
    assert ndcg(["x", "a"], {"a"}) == pytest.approx(1 / np.log2(3))  # one relevant, ranked 2nd
    assert ndcg(["a", "b", "x"], {"a", "b"}) == 1.0
    assert ndcg(["x", "y", "a"], {"a", "b", "c", "d"}) == pytest.approx(
        0.5 / (1 + 1 / np.log2(3) + 0.5))


def test_narrow_queries_are_scored_on_the_exact_item(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    report = evaluate(bundle, "single", split="narrow-val")
    m = report["metrics"]
    assert 0.3 < m["hit@1"] <= 1.0  # one dense query finds the item a narrow query names
    per_query = report["diagnostics"]["per_query"]
    assert len(per_query["hit@1"]) == report["n_queries"]
    assert set(per_query["hit@1"]) <= {0.0, 1.0}


def test_mmr_prefers_a_new_direction_over_a_near_duplicate():
    query = np.array([1.0, 0.0, 0.0])
    a = np.array([0.9, 0.436, 0.0])
    near_a = np.array([0.89, 0.456, 0.0])
    other = np.array([0.8, 0.0, 0.6])
    candidates = np.stack([a, near_a, other]) / np.linalg.norm([a, near_a, other], axis=1)[:, None]
    assert mmr_select(query, candidates, 2, lam=0.5) == [0, 2]
    assert mmr_select(query, candidates, 2, lam=1.0) == [0, 1]


def test_reward_greedy_takes_one_duplicate_then_new_directions():
    query = np.array([1.0, 0.0, 0.0])
    a = np.array([0.95, 0.312, 0.0])
    b, c = np.array([0.7, 0.0, 0.714]), np.array([0.7, -0.714, 0.0])
    candidates = np.stack([a, a, a, b, c]) / np.linalg.norm([a, a, a, b, c], axis=1)[:, None]
    picked = reward_greedy_select(query, candidates, 3)
    assert picked[0] in (0, 1, 2) and sorted(picked[1:]) == [3, 4]


def test_training_view_of_the_benchmark_is_text_only(small_bundle_dir):
    texts = query_texts(small_bundle_dir, "train")
    assert texts and all(isinstance(t, str) for t in texts)
    assert texts == [q.query for q in load_split(small_bundle_dir, "train")]


@pytest.mark.parametrize("method", ["single", "mmr", "reward-greedy", "prompt-names"])
def test_report_shape_and_ranges(small_bundle_dir, method):
    bundle = load_bundle(small_bundle_dir)
    report = evaluate(bundle, method, split="train")
    assert list(report["metrics"]) == list(METRICS)
    assert report["n_queries"] == len(load_split(small_bundle_dir, "train"))
    m = report["metrics"]
    for name in ("recall@5k", "hit@5k", "precision@10", "coverage@10", "reward"):
        assert 0.0 <= m[name] <= 1.0
    assert 1.0 <= m["vendi@10"] <= 10.0
    assert m["recall@5k"] > 0.2  # the subtree is in the catalog; dense retrieval finds much of it
    path = write_report(small_bundle_dir, report)
    written = json.loads(path.read_text())
    assert set(written) == {"method", "split", "n_queries", "k", "metrics"}
    assert written["metrics"] == report["metrics"]
    assert report["diagnostics"]["distinct_subqueries"] == 10.0  # items are never repeated
    table = (small_bundle_dir / "eval" / "README.md").read_text()
    assert f"| {method} | train |" in table


def test_mmr_is_more_diverse_than_single(small_bundle_dir):
    bundle = load_bundle(small_bundle_dir)
    single = evaluate(bundle, "single", split="train")["metrics"]
    mmr = evaluate(bundle, "mmr", split="train", lam=0.5)["metrics"]
    assert mmr["vendi@10"] > single["vendi@10"]


def test_fanout_pools_hold_as_many_distinct_items_as_single(small_bundle_dir, monkeypatch):
    """A fan-out's pool is POOL_SIZE distinct items, interleaved rank by rank over its probes,
    even when the probes' neighbourhoods overlap (the paper's union then holds fewer)."""
    import training.evaluation.baselines as methods
    from service.runtime.index import search

    monkeypatch.setattr(methods, "POOL_SIZE", 20)
    monkeypatch.setattr(methods, "POOL_PER_SLOT", 2)
    bundle = load_bundle(small_bundle_dir)
    emb = bundle.items.embeddings
    same = np.repeat(emb[[0]], 10, axis=0)[None]  # (1, 10, d): ten copies of one probe
    out = methods.fanout_output(bundle, same)
    _, ranked = search(bundle.index, emb[[0]], 20)
    assert len(out.union_pools[0]) == 2  # 2 per slot, all the same two
    assert sorted(out.pools[0]) == sorted(ranked[0])  # the probe's own top 20
    spread = emb[np.arange(0, 40, 4)][None]  # (1, 10, d): ten different probes
    out = methods.fanout_output(bundle, spread)
    pool = list(out.pools[0])
    assert len(pool) == len(set(pool)) == 20
    tops = search(bundle.index, spread[0], 1)[1][:, 0]  # each probe is an item: itself
    assert pool[:10] == tops.tolist()  # every probe's first neighbour, in probe order, first


def test_counts_on_the_command_line_must_be_positive(capsys):
    from service.command import build_parser

    parser = build_parser()
    assert parser.parse_args(["eval", "--seeds", "4"]).seeds == 4
    for argv in (["eval", "--seeds", "0"], ["export", "diffusion", "--draws", "-1"],
                 ["train", "folm", "--queries-per-step", "0"], ["train", "folm", "--steps", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert "must be at least 1" in capsys.readouterr().err
    assert parser.parse_args(["train", "folm", "--ablation-best-of", "0"]).ablation_best_of == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "folm", "--ablation-best-of", "-1"])
    assert "must be at least 0" in capsys.readouterr().err


def write_val_reports(bundle: Path) -> Path:
    """Two methods' val reports over three queries (diffusion 0.5 / 0.3 / 0.4, single 0.2 /
    0.3 / 0.1 coverage@10); returns the reports' folder."""
    directory = bundle / "eval" / "diagnostics"
    directory.mkdir(parents=True)
    per_query = {"diffusion": [0.5, 0.3, 0.4], "single": [0.2, 0.3, 0.1]}
    for method, coverage in per_query.items():
        record = {"per_query": {"coverage@10": coverage, "recall@5k": [0.5, 0.5, 0.5]}}
        (directory / f"{method}-val.json").write_text(json.dumps(record))
        (directory.parent / f"{method}-val.json").write_text(json.dumps(
            {"method": method, "split": "val", "n_queries": 3, "metrics": {}}))
    return directory.parent


def test_paired_table_is_the_mean_per_query_difference(tmp_path):
    from training.evaluation.harness import paired_table

    reports = write_val_reports(tmp_path)
    other = {"method": "single-narrow", "split": "narrow-val"}  # not read as val's "single"
    (reports / "single-narrow-val.json").write_text(json.dumps(other))
    table = paired_table(tmp_path, "val")
    diff = np.array([0.3, 0.0, 0.3])
    se = diff.std(ddof=1) / np.sqrt(3)
    assert f"| single | {diff.mean():+.3f} ± {se:.3f} | +0.000 ± 0.000 |" in table
    assert paired_table(tmp_path, "test") == ""  # nothing to compare


def test_paired_table_by_kind_pairs_only_that_kinds_queries(tmp_path, capsys):
    from training.evaluation.harness import paired_table, query_kinds

    write_val_reports(tmp_path)
    (tmp_path / "benchmark").mkdir()
    ids = ["block:A00-A09", "category:A00", "category:A01"]
    (tmp_path / "benchmark" / "val.jsonl").write_text("".join(
        json.dumps({"query": f"q{i}", "id": id_, "groups": [["x"]]}) + "\n"
        for i, id_ in enumerate(ids)))
    assert query_kinds(tmp_path, "val") == ["block", "category", "category"]
    table = paired_table(tmp_path, "val", kind="category")
    diff = np.array([0.0, 0.3])
    se = diff.std(ddof=1) / np.sqrt(2)
    assert "(category: 2 queries)" in table
    assert f"| single | {diff.mean():+.3f} ± {se:.3f} |" in table
    # the command pairs each kind where the split was measured (and reads no narrow split)
    from training.cli import cmd_table

    cmd_table(argparse.Namespace(bundle=tmp_path, paired="diffusion", by_kind=True))
    printed = capsys.readouterr().out
    assert "(block: 1 queries)" in printed and "(category: 2 queries)" in printed
    with pytest.raises(InputError, match="no evaluation reports"):
        cmd_table(argparse.Namespace(bundle=tmp_path / "unmeasured", paired="diffusion",
                                     by_kind=False))
