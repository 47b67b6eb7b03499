"""The ranker stage: trained only on train queries disjoint from val and test, tuned on val,
recorded so the served route reads what was trained."""

from __future__ import annotations

import json
from pathlib import Path

from service.artifacts.bundle import load_bundle, read_manifest
from service.ranker.ranker import RANKER_CONFIG, RANKER_DIR, RANKER_MODEL, Ranker
from service.routes.answer import RouteQuery
from service.routes.ranked import RankedRoute
from service.runtime.encoder import Encoder
from training.data.splits import BENCHMARK_DIR, BenchmarkQuery, disjoint_train, masked_train
from training.ranker.lambdarank import RankerTrainConfig, ranker_stage_config


def write_split(bundle: Path, split: str, queries: list[BenchmarkQuery]) -> None:
    (bundle / BENCHMARK_DIR).mkdir(parents=True, exist_ok=True)
    (bundle / BENCHMARK_DIR / f"{split}.jsonl").write_text(
        "".join(q.to_json() + "\n" for q in queries))


def test_no_val_or_test_item_is_a_training_label(tmp_path):
    """disjoint_train drops a train query that shares one; masked_train drops the item."""
    write_split(tmp_path, "val", [BenchmarkQuery("tree", [["oak", "elm"]], id="t")])
    write_split(tmp_path, "test", [BenchmarkQuery("fish", [["cod"]], id="f")])
    write_split(tmp_path, "train", [
        BenchmarkQuery("oak", [["red oak"], ["elm"]], id="o"),  # holds a val item
        BenchmarkQuery("plant", [["shrub"], ["t"]], id="p"),  # holds the val query itself
        BenchmarkQuery("cod", [["atlantic cod"]], id="cod"),  # is a test item
        BenchmarkQuery("bird", [["robin"], ["wren"]], id="b"),
        BenchmarkQuery("rock", [], id="r"),  # no labels: nothing to learn
    ])
    assert [q.query for q in disjoint_train(tmp_path)] == ["bird"]
    masked = {q.query: q.groups for q in masked_train(tmp_path)}
    assert masked == {"oak": [["red oak"]], "plant": [["shrub"]], "bird": [["robin"], ["wren"]]}


def test_the_small_bundle_ranker_is_trained_recorded_and_served(small_bundle_dir):
    record = read_manifest(small_bundle_dir)["stages"]["ranker"]
    assert record["config"] == ranker_stage_config(RankerTrainConfig())
    assert record["n_train_queries"] == len(masked_train(small_bundle_dir)) > 0
    served = json.loads((small_bundle_dir / RANKER_DIR / RANKER_CONFIG).read_text())
    tried = served["trained"]["val_coverage@10"]
    assert {(t["model"], t["redundancy"]) for t in tried} == {
        (model, weight) for model in (None, RANKER_MODEL)
        for weight in RankerTrainConfig().redundancies}
    best = max(tried, key=lambda t: t["coverage@10"])  # the first best: the label-free on a tie
    assert (served["model"], served["redundancy"]) == (best["model"], best["redundancy"])
    assert record["val_coverage@10"] == best["coverage@10"] and record["model"] == best["model"]
    bundle = load_bundle(small_bundle_dir)
    ranker = Ranker.load(small_bundle_dir / RANKER_DIR)
    words = ranker.config.words  # learned from the train queries' candidates, at most n a side
    assert 0 < len(words.before) <= RankerTrainConfig().words
    assert 0 < len(words.after) <= RankerTrainConfig().words
    assert (ranker.booster is not None) == (served["model"] == RANKER_MODEL)
    [answer] = RankedRoute(bundle, Encoder(bundle.encoder_config), ranker)([RouteQuery("tree", 5)])
    assert len(set(answer.selection.rows)) == 5 and answer.selection.filled == 0


def test_a_group_s_head_is_labelled_above_its_members(small_bundle_dir):
    from training.ranker.lambdarank import labeled

    bundle = load_bundle(small_bundle_dir)
    path = RankedRoute(bundle, Encoder(bundle.encoder_config))
    [(rows, _)] = path.features.candidates(["tree"], path.encoder.encode(["tree"]))
    ids = [bundle.items.ids[r] for r in rows[:4]]
    query = BenchmarkQuery("tree", [[ids[0], ids[1]], [ids[2]]])  # heads: the first two
    for grade in (1, 2):
        _, labels, [size] = labeled(path, [query], {ids[3]}, grade)  # ids[3]: held out
        assert size == len(rows) - 1
        assert labels[:3].tolist() == [grade, 1, grade] and not labels[3:].any()
