"""The policy (tokenizer, presets) and the warm start on a toy bundle, `tiny` preset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from service.fanout.format import build_prompt, item_name
from training.data.splits import query_texts, training_queries
from training.pipeline import CatalogConfig, build_catalog
from training.stage1_fanout.policy import (
    BOS,
    EOS,
    POLICY_PRESETS,
    build_model,
    load_policy,
    n_params,
    policy_meta,
    train_tokenizer,
)
from training.stage1_fanout.warmstart import (
    WARMSTART_PRESETS,
    rank_weights,
    sample_target,
    target_pool,
    warm_start,
)

THEMES = {
    "camping": ["tent", "sleeping bag", "lantern", "camp stove", "compass", "backpack",
                "hiking boot", "canteen", "tarp", "hammock"],
    "kitchen": ["saucepan", "skillet", "whisk", "ladle", "colander", "spatula", "cutting board",
                "rolling pin", "kettle", "grater"],
    "music": ["violin", "cello", "trumpet", "flute", "drum", "piano", "guitar", "harp",
              "clarinet", "tuba"],
    "animal": ["dog", "cat", "horse", "rabbit", "fox", "wolf", "deer", "otter", "badger",
               "beaver"],
    "tool": ["hammer", "screwdriver", "wrench", "pliers", "chisel", "saw", "drill", "file",
             "mallet", "crowbar"],
}
GLOSS = {"camping": "gear used when camping outdoors", "kitchen": "a utensil used for cooking",
         "music": "a musical instrument", "animal": "a mammal found in the wild or at home",
         "tool": "a hand tool used in carpentry"}


def make_tiny_bundle(root: Path) -> Path:
    """A 55-item catalog in five themes with a 20-query benchmark (16/2/2 split)."""
    catalog, bench = write_tiny_sources(root)
    bundle = root / "bundle"
    build_catalog(bundle, CatalogConfig(source=str(catalog), benchmark=str(bench)))
    return bundle


def write_tiny_sources(root: Path) -> tuple[Path, Path]:
    """(catalog.jsonl, bench.jsonl) of `make_tiny_bundle` in `root`."""
    items, queries = [], []
    for theme, words in THEMES.items():
        items.append({"id": theme, "text": f"{theme}: {GLOSS[theme]}"})
        ids = []
        for word in words:
            items.append({"id": f"{theme}-{word}", "text": f"{word}, {theme} {word}: "
                          f"{GLOSS[theme]}, the {word}"})
            ids.append(f"{theme}-{word}")
        for j, name in enumerate((theme, f"{theme} things", f"{theme} kit", f"best {theme}")):
            groups = [[i] for i in ids[j : j + 6]]
            queries.append({"query": name, "groups": groups})
    catalog, bench = root / "catalog.jsonl", root / "bench.jsonl"
    catalog.write_text("".join(json.dumps(r) + "\n" for r in items))
    bench.write_text("".join(json.dumps(q) + "\n" for q in queries))
    return catalog, bench


def make_tiny_policy(bundle: Path) -> Path:
    torch.set_num_threads(1)
    return warm_start(bundle, WARMSTART_PRESETS["tiny"])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("folm"))


def test_tokenizer_prepends_bos_and_round_trips_newlines() -> None:
    texts = ["tent, camping tent: gear", "query: camping\nfan-out:\n", "lantern\nstove\nmap"] * 5
    tok = train_tokenizer(texts, 300)
    enc = tok.encode("lantern\nstove")
    assert enc.ids[0] == tok.token_to_id(BOS)
    assert tok.decode(enc.ids, skip_special_tokens=True) == "lantern\nstove"
    assert tok.token_to_id(EOS) is not None


def test_presets_are_ordered_by_size() -> None:
    tok = train_tokenizer(["a b c d e f g"] * 3, 300)
    tiny = n_params(build_model(POLICY_PRESETS["tiny"], tok))
    cpu = n_params(build_model(POLICY_PRESETS["cpu"], tok))
    assert tiny < 100_000 < cpu


def test_item_name_takes_first_lemma() -> None:
    assert item_name("tent, camping tent: gear used") == "tent"
    assert item_name("camping: gear") == "camping"


def test_warm_start_targets_come_from_the_context_in_its_order() -> None:
    context = [f"name {i}" for i in range(16)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        lines = sample_target(target_pool(context, [], 10), 10, rng).split("\n")
        assert len(set(lines)) == 10 and set(lines) <= set(context)
        assert lines == sorted(lines, key=context.index)  # similarity order kept
    short = target_pool(["a", "b"], ["B", "c", "d", "a", "e"], 4)
    assert short == ["a", "b", "c", "d"]  # topped up to k, no repeats (case-insensitive)


def test_rank_decay_draws_nearer_names_more_often() -> None:
    context = [f"name {i}" for i in range(16)]

    def share_of_nearest_ten(decay: float) -> float:
        rng = np.random.default_rng(0)
        draws = [sample_target(context, 10, rng, decay=decay).split("\n") for _ in range(200)]
        return float(np.mean([sum(line in context[:10] for line in d) / 10 for d in draws]))

    uniform, biased = share_of_nearest_ten(0.0), share_of_nearest_ten(2.0)
    assert abs(uniform - 10 / 16) < 0.05  # a uniform draw of 10 of 16
    assert biased > uniform + 0.2
    assert rank_weights(4, 0.0) is None
    assert np.all(np.diff(rank_weights(4, 2.0)) < 0)


def test_training_queries_exclude_val_and_test(bundle: Path) -> None:
    held_out = {q.lower() for s in ("val", "test") for q in query_texts(bundle, s)}
    names = [*held_out, "tent", "lantern", "violin"]
    queries = training_queries(bundle, names, n_extra=10, seed=0)
    assert not held_out & {q.lower() for q in queries}
    assert set(query_texts(bundle, "train")) <= set(queries)
    assert {"tent", "lantern", "violin"} <= set(queries)


def test_training_queries_by_breadth_favour_wide_names_and_exclude_val_and_test(
        bundle: Path) -> None:
    held_out = sorted({q.lower() for s in ("val", "test") for q in query_texts(bundle, s)})
    wide, narrow = [f"wide {i}" for i in range(50)], [f"narrow {i}" for i in range(50)]
    names = [*held_out, *wide, *narrow]
    breadth = np.array([10**6] * len(held_out) + [1000] * 50 + [1] * 50)  # log1p: 6.9 vs 0.69
    n_train = len(query_texts(bundle, "train"))
    drawn = [training_queries(bundle, names, 20, seed, breadth)[n_train:] for seed in range(20)]
    assert not set(held_out) & {q.lower() for d in drawn for q in d}
    assert all(len(d) == 20 for d in drawn)
    widths = [sum(q.startswith("wide") for q in d) for d in drawn]
    assert np.mean(widths) > 15  # 10 of 20 by a uniform draw
    assert training_queries(bundle, names, 20, 0, np.zeros(len(names)))[n_train:] == []


def test_warm_start_writes_a_loadable_checkpoint(bundle: Path) -> None:
    final = make_tiny_policy(bundle)
    meta = policy_meta(final)
    assert meta["policy"]["preset"] == "tiny" and meta["params"] > 0
    model, tokenizer = load_policy(final)
    enc = tokenizer([build_prompt("camping")], return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == tokenizer.bos_token_id
    out = model.generate(**enc, max_new_tokens=5, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > enc["input_ids"].shape[1]
    curves = json.loads((final.parent / "curves.json").read_text())
    assert len(curves["lm_loss"]) == WARMSTART_PRESETS["tiny"].lm_steps
    assert np.isfinite(curves["sft_loss"]).all()


def test_export_commits_both_folders_and_methods_run(bundle: Path) -> None:
    from service.artifacts.bundle import load_bundle, verify_bundle
    from service.runtime.encoder import Encoder
    from training.evaluation.fanout import FANOUT_METHODS
    from training.stage1_fanout.export import commit_policy

    final = make_tiny_policy(bundle)
    for name in ("folm-warmstart", "folm"):
        config = commit_policy(bundle, final, name)
        assert config["preset"] == "tiny" and config["k"] == 10 and config["temperature"] == 1.0
    manifest = verify_bundle(bundle)
    assert {"folm/model.onnx", "folm-warmstart/tokenizer.json"} <= set(manifest["files"])
    assert manifest["stages"]["folm"]["config_hash"]
    loaded = load_bundle(bundle)
    texts = query_texts(bundle, "test")
    queries = Encoder(loaded.encoder_config).encode(texts)
    for factory in FANOUT_METHODS.values():
        out = factory(loaded, k=10, threads=1)(texts, queries)
        assert out.items.shape == (len(texts), 10) and out.valid.shape == (len(texts), 10)
        assert out.probes.shape == (len(texts), 10, queries.shape[1])
        assert all(len(set(row.tolist())) == 10 for row in out.items)  # k distinct items
        assert all(len(pool) >= 10 for pool in out.pools)


def test_export_records_how_the_policy_sampled() -> None:
    from training.stage1_fanout.export import trained_decoding

    assert trained_decoding({"config": {"decoding": "catalog"}}) == "catalog"
    assert trained_decoding({"config": {"grammar": True}}) == "lines"  # older GRPO runs
    assert trained_decoding({"config": {"grammar": False}}) == "free"
    assert trained_decoding({"config": {}, "policy": {"context": 16}}) == "context"
    assert trained_decoding({"policy": {"context": 0}}) == "lines"


def test_export_refuses_a_stage_that_is_no_policy_before_any_work(tmp_path: Path) -> None:
    import argparse

    from service.errors import InputError
    from training.stage1_fanout.export import cmd_export

    args = argparse.Namespace(which="folm,diffusion", bundle=tmp_path, checkpoint=None,
                              threads=1)
    with pytest.raises(InputError, match="not diffusion"):
        cmd_export(args)
    assert not any(tmp_path.iterdir())
