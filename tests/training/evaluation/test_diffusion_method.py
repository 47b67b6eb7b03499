import json
import shutil
import time

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.errors import InputError
from service.fanout.candidates import Candidates
from service.routes.diffusion import draw_rows
from service.routes.resolution import first_distinct
from service.runtime.encoder import Encoder
from tests.training.stage3_diffusion.proxy_dataset import tiny_checkpoint
from training.evaluation.auto import auto
from training.evaluation.diffusion_method import diffusion
from training.evaluation.harness import METHODS, evaluate, gaps, write_report
from training.evaluation.steps_curve import steps_curve
from training.evaluation.trigger_curve import trigger_curve
from training.stage3_diffusion.export import ExportConfig, export_diffusion


@pytest.fixture(scope="module")
def bundle(small_bundle_dir, tmp_path_factory):
    """The small real bundle plus a tiny diffusion stage with L = 12 rows for k = 10, which
    attends to each query's 4 nearest items."""
    import torch

    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("diffusion-bundle") / "b"
    shutil.copytree(small_bundle_dir, directory)
    checkpoint = tiny_checkpoint(directory / "runs" / "diffusion", rows=12, context=4)
    export_diffusion(directory, checkpoint, ExportConfig(solver="heun", steps=2, draws=1))
    return load_bundle(directory)


def test_resolution_returns_k_distinct_ids(bundle):
    queries = Encoder(bundle.encoder_config).encode(["dog", "tool", "vehicle"])
    for steps in (None, 3):
        out = diffusion(bundle, k=10, steps=steps)(["dog", "tool", "vehicle"], queries)
        assert out.items.shape == (3, 10) and out.probes.shape == (3, 10, 128)
        for row in out.items:
            assert len(set(row.tolist())) == 10
        assert all(len(pool) >= 10 for pool in out.pools)


def _record(sampler):
    """Wrap `sampler.draw` to keep the (rows, context) of every run."""
    calls = []
    original = sampler.draw

    def recording(query_emb, seed=None, noise=None, context=None, embeddings=None):
        drawn = original(query_emb, seed, noise, context, embeddings)
        calls.append((drawn.rows, context))
        return drawn

    sampler.draw = recording
    return calls


def _exported_copy(bundle, tmp_path, config, **model):
    """A copy of the bundle whose diffusion stage is a fresh tiny model (context 4) exported
    with `config`; returns the copy's folder."""
    directory = tmp_path / "b"
    shutil.copytree(bundle.path, directory, ignore=shutil.ignore_patterns("runs"))
    export_diffusion(directory, tiny_checkpoint(tmp_path / "run", context=4, **model), config)
    return directory


def test_the_served_path_attends_to_the_querys_nearest_items(bundle):
    from service.routes.answer import RouteQuery
    from service.routes.diffusion import DiffusionRoute
    from service.runtime.index import neighbourhood
    from service.runtime.sampler import DiffusionSampler

    sampler = DiffusionSampler(bundle.path / "diffusion", threads=1)
    assert sampler.context == 4
    calls = _record(sampler)
    encoder = Encoder(bundle.encoder_config)
    answers = DiffusionRoute(bundle, encoder, sampler, seed=0)([RouteQuery("dog", 10),
                                                               RouteQuery("tool", 5)])
    assert [len(set(a.selection.rows)) for a in answers] == [10, 5]
    expected = neighbourhood(bundle.index, bundle.items.embeddings,
                             encoder.encode(["dog", "tool"]), 4)  # as training looks it up
    assert np.allclose(calls[0][1], expected)


def test_a_bundle_trained_on_prompt_contexts_serves_with_them(bundle, tmp_path):
    from service.fanout.grounding import PromptNeighbourhood
    from service.routes.answer import RouteQuery
    from service.routes.diffusion import DiffusionRoute
    from service.runtime.sampler import DiffusionSampler

    directory = _exported_copy(bundle, tmp_path, ExportConfig(solver="euler", steps=2, draws=1),
                               context_source="prompt")
    served = load_bundle(directory)
    sampler = DiffusionSampler(directory / "diffusion", threads=1)
    assert sampler.config["context_source"] == "prompt"
    calls = _record(sampler)
    encoder = Encoder(served.encoder_config)
    answers = DiffusionRoute(served, encoder, sampler, seed=0)([RouteQuery("dog", 10)])
    assert len(set(answers[0].selection.rows)) == 10
    queries = encoder.encode(["dog"])
    rows = PromptNeighbourhood(Candidates(served.index), served.items.texts,
                               served.items.embeddings, 4).rows(["dog"], queries)
    assert np.allclose(calls[0][1], served.items.embeddings[rows])


def test_draws_sample_the_batch_again_and_replace_repeated_items(bundle, tmp_path):
    from service.routes.answer import RouteQuery
    from service.routes.diffusion import DiffusionRoute
    from service.runtime.sampler import DiffusionSampler

    directory = _exported_copy(bundle, tmp_path, ExportConfig(solver="euler", steps=2, draws=1))
    one = json.loads((directory / "diffusion" / "diffusion.json").read_text())
    two = export_diffusion(directory, tmp_path / "run" / "checkpoint.pt",
                           ExportConfig(solver="euler", steps=2, draws=2))
    assert two["draws"] == 2 and two["flops_per_query"] == 2 * one["flops_per_query"]
    served = load_bundle(directory)
    sampler = DiffusionSampler(directory / "diffusion", threads=1)
    raw = _record(sampler)
    answers = DiffusionRoute(served, Encoder(served.encoder_config), sampler, seed=0)(
        [RouteQuery("dog", 10), RouteQuery("tool", 10)])
    rows, context = raw[0]  # (4, 10, d): dog, dog, tool, tool
    assert len(raw) == 1 and len(rows) == len(context) == 4  # one run, the batch repeated
    assert [len(set(a.selection.rows)) for a in answers] == [10, 10]
    kept = draw_rows(served.index, sampler, Encoder(served.encoder_config).encode(["dog", "tool"]),
                     0, context[::2]).rows  # (2, 10, d)
    positions = first_distinct(served.index, rows.reshape(2, 20, -1), 10, context[::2])
    expected = np.take_along_axis(rows.reshape(2, 20, -1), positions[..., None], axis=1)
    assert np.array_equal(kept, expected)
    picked = np.argmax(kept @ context[::2].transpose(0, 2, 1), axis=2)  # (2, 10)
    first = np.argmax(rows[::2] @ context[::2].transpose(0, 2, 1), axis=2)  # draw 1's picks
    for q in range(2):  # as many distinct items as both draws offer, up to 10
        offered = set(np.argmax(rows[2 * q + 1] @ context[2 * q].T, axis=1).tolist())
        assert len(set(picked[q].tolist())) == min(10, len(set(first[q].tolist()) | offered))
        assert set(first[q].tolist()) <= set(picked[q].tolist())  # draw 1's items all kept
    with pytest.raises(InputError, match="draws"):
        ExportConfig(draws=0)


def test_evaluation_returns_the_http_answer_for_the_same_seed(bundle):
    """The harness scores the served route: the items `r4t eval` counts for a query are the
    ones POST /v1/retrieve returns with the same seed, and each probe is the row that claimed
    its item (L = 12 rows for k = 10)."""
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.settings import Settings

    texts = ["dog", "tool"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    evaluated = [diffusion(bundle, k=10, seed=3)([t], queries[i : i + 1])
                 for i, t in enumerate(texts)]
    settings = Settings(bundle=bundle.path, index="bundle", seed=3, threads=1, routes="diffusion=1",
                        groundedness_threshold=-1)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:  # start-up loads in the background
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.05)
        for text, out in zip(texts, evaluated, strict=True):
            answer = client.post("/v1/retrieve", json={"query": text, "k": 10,
                                                       "route": "diffusion"}).json()
            ids = [bundle.items.ids[r] for r in out.items[0]]
            assert [item["id"] for item in answer["items"]] == ids
            cosines = np.einsum("kd,kd->k", out.probes[0], bundle.items.embeddings[out.items[0]])
            assert np.allclose(cosines, [item["score"] for item in answer["items"]], atol=1e-5)


def test_harness_runs_diffusion_and_the_steps_curve(bundle, monkeypatch):
    from training.evaluation.harness import evaluate, write_report

    monkeypatch.setitem(METHODS, "diffusion", diffusion)
    report = evaluate(bundle, "diffusion", "test", k=10)
    assert report["metrics"]["groundedness"] > 0
    write_report(bundle.path, report)
    train = {name: 2 * value for name, value in report["metrics"].items()  # twice as good
             if value is not None}  # hit@1: broad queries name no item
    write_report(bundle.path, {**report, "split": "train", "metrics": train})
    assert gaps(bundle.path)["train_vs_test"]["groundedness"] == pytest.approx(0.5)
    curve = steps_curve(bundle, "test", steps_list=(1, 2), solvers=("euler",))
    # few steps are measured with one and two draws: evaluations per query = steps x draws
    assert [(p["steps"], p["draws"]) for p in curve["points"]] == [(1, 1), (1, 2), (2, 1),
                                                                   (2, 2)]
    assert [p["evaluations"] for p in curve["points"]] == [1, 2, 2, 4]
    one, two = curve["points"][:2]
    assert two["mflop_per_query"] == pytest.approx(2 * one["mflop_per_query"])
    assert all(p["solver_ms_per_query"] > 0 for p in curve["points"])


def test_the_index_curve_measures_each_choice_against_exact(bundle, monkeypatch):
    from training.evaluation.index_curve import index_curve, write_index_curve

    monkeypatch.setitem(METHODS, "diffusion", diffusion)
    curve = index_curve(bundle.path, "test", choices=("bundle", "HNSW16/efSearch=256"), seeds=1)
    exact, hnsw = curve["points"]
    assert (exact["index"], hnsw["index"]) == ("bundle", "HNSW16/efSearch=256")
    assert exact["coverage_vs_exact"] == 1.0
    # on a catalog this small a wide HNSW search finds what exact search finds
    assert hnsw["single"]["coverage@10"] == pytest.approx(exact["single"]["coverage@10"], abs=0.02)
    for p in curve["points"]:
        assert p["single_search"]["one_ms"] > 0 and p["diffusion_search"]["batch_ms_per_query"] > 0
    table = write_index_curve(bundle.path, curve).with_suffix(".md").read_text()
    assert "| bundle |" in table and "| HNSW16/efSearch=256 |" in table


def test_seeds_average_a_sampling_method_over_its_seeds(bundle):
    from training.evaluation.harness import evaluate

    one = [evaluate(bundle, "diffusion", "test", seeds=1, seed=s)["metrics"] for s in (0, 1)]
    both = evaluate(bundle, "diffusion", "test", seeds=2)
    per_seed = both["diagnostics"]["per_seed"]
    assert both["diagnostics"]["seeds"] == 2
    for name in ("coverage@10", "recall@5k", "reward"):
        assert per_seed[name] == pytest.approx([m[name] for m in one])
        assert both["metrics"][name] == pytest.approx(sum(per_seed[name]) / 2)
    assert one[0]["reward"] != one[1]["reward"]  # the seeds draw different rows
    single = evaluate(bundle, "single", "test", seeds=3)  # deterministic: run once
    assert single["diagnostics"]["seeds"] == 1
    with pytest.raises(InputError, match="seeds"):
        evaluate(bundle, "diffusion", "test", seeds=0)


def test_auto_answers_each_query_by_the_triggers_decision(bundle):
    from service.scheduling.trigger import FanoutTrigger

    texts = ["dog", "tool", "vehicle", "golden retriever", "oak", "musical instrument"]
    queries = Encoder(bundle.encoder_config).encode(texts)
    alone = METHODS["single"](bundle)(texts, queries).items
    fanned = diffusion(bundle, seed=0)(texts, queries).items
    assert (auto(bundle, threshold=float("inf"))(texts, queries).items == alone).all()
    assert (auto(bundle, threshold=0.0, lead=0)(texts, queries).items == fanned).all()
    led = auto(bundle, threshold=0.0, lead=1)(texts, queries).items  # the query's own first
    for row, own, fan in zip(led, alone, fanned, strict=True):
        assert row[0] == own[0] and list(row[1:]) == [r for r in fan if r != own[0]][:9]
    scores = [FanoutTrigger(bundle.lexical, 0.0).score(t) for t in texts]
    middle = sorted(scores)[len(scores) // 2]
    mixed = auto(bundle, threshold=middle, lead=0)(texts, queries).items
    wide = [i for i, score in enumerate(scores) if score >= middle]
    assert 0 < len(wide) < len(texts)
    # the noise is drawn per batch: the fanned-out queries are diffused as a batch of their own
    subset = diffusion(bundle, seed=0)([texts[i] for i in wide], queries[wide]).items
    for i in range(len(texts)):
        assert (mixed[i] == (subset[wide.index(i)] if i in wide else alone[i])).all()


def test_trigger_curve_runs_from_no_fanout_to_all(bundle):
    for method in ("single", "diffusion"):
        write_report(bundle.path, evaluate(bundle, method, split="mixed-val"))
    curve = trigger_curve(bundle.path, "mixed-val")
    shares = [p["share_fanned_out"] for p in curve["points"]]
    assert shares[0] == 1.0 and shares[-1] == 0.0 and shares == sorted(shares, reverse=True)
    reports = {m: json.loads((bundle.path / "eval" / f"{m}-mixed-val.json").read_text())
               for m in ("single", "diffusion")}
    everything = curve["points"][0]["coverage@10"]
    assert everything["net"] == pytest.approx(reports["diffusion"]["metrics"]["coverage@10"]
                                              - reports["single"]["metrics"]["coverage@10"])
    for point in curve["points"]:
        for name in ("coverage@10", "hit@1"):
            p = point[name]
            assert p["gain"] >= 0 >= p["harm"] and p["net"] == pytest.approx(
                p["gain"] + p["harm"])
    assert curve["points"][-1]["coverage@10"] == {"gain": 0.0, "harm": 0.0, "net": 0.0}
    assert curve["best_threshold"] in [p["threshold"] for p in curve["points"]]


def test_a_projected_export_takes_another_one_evaluation_schedule_and_refuses_more(
        small_bundle_dir, tmp_path):
    from service.runtime.sampler import read_config
    from tests.service.bundles import export_tiny_diffusion
    from training.evaluation.diffusion_method import open_sampler

    directory = tmp_path / "b"
    shutil.copytree(small_bundle_dir, directory)
    export_tiny_diffusion(directory, tmp_path / "run")  # the default's shape: projected
    projected = load_bundle(directory)
    assert read_config(directory / "diffusion")["items_file"] == "items.npy"
    sampler = open_sampler(projected, steps=1, solver="heun")  # Heun's one step is Euler's
    assert sampler.items is not None and sampler.config["solver"] == "heun"
    with pytest.raises(InputError, match="exported projected"):
        open_sampler(projected, steps=2, solver="euler")
