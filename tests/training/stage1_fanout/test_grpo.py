"""Stage 1: reward functions, one GRPO step, the run directory and collapse signatures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from service.artifacts.bundle import load_bundle
from service.errors import InputError
from service.fanout.decoding import lines_regex
from service.fanout.format import format_fanout
from service.runtime.encoder import Encoder
from tests.training.stage1_fanout.test_policy import make_tiny_bundle, make_tiny_policy
from training.device import Device
from training.stage1_fanout.ablation import best_of_n, collapse_signatures, mode_score
from training.stage1_fanout.grpo import (
    GRPO_PRESETS,
    FanoutScorer,
    resolve_config,
    reward_functions,
)
from training.stage1_fanout.grpo_run import per_process_batch, train_grpo, vllm_of
from training.stage1_fanout.policy import load_policy

GOOD = format_fanout(["tent", "lantern", "compass", "backpack", "tarp", "hammock", "canteen",
                      "camp stove", "sleeping bag", "hiking boot"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    bundle = make_tiny_bundle(tmp_path_factory.mktemp("grpo"))
    return bundle, make_tiny_policy(bundle)


@pytest.fixture(scope="module")
def scorer(setup: tuple[Path, Path]) -> FanoutScorer:
    bundle = load_bundle(setup[0])
    return FanoutScorer(bundle, Encoder(bundle.encoder_config), 10)


def composite(scorer: FanoutScorer, completions: list[str]) -> np.ndarray:
    funcs, weights = reward_functions(scorer, "all")
    rewards = [f([""] * len(completions), completions, query=["camping"] * len(completions))
               for f in funcs]
    return np.asarray(weights) @ np.asarray(rewards)


def test_malformed_outputs_score_low(scorer: FanoutScorer) -> None:
    malformed = [
        "",  # nothing
        "tent lantern compass",  # one line instead of ten
        format_fanout(["tent"] * 10),  # ten duplicates
        GOOD + "\nextra line\nanother",  # more than k lines: malformed, every slot scores 0
        format_fanout(["x" * 300] * 10),  # over-long lines
    ]
    scores = composite(scorer, [GOOD, *malformed])
    assert scores[0] > 0.3
    assert (scores[1:3] < 0.1 * scores[0]).all() and scores[3] < 0.2 * scores[0]
    assert scores[4] == 0.0 and scores[5] == 0.0


def test_ablation_modes_pick_terms_and_weights(scorer: FanoutScorer) -> None:
    for mode, names in (("ground", ["ground"]), ("ground+align", ["ground", "alignment"]),
                        ("all", ["ground", "diversity", "alignment"])):
        funcs, weights = reward_functions(scorer, mode)
        assert [f.__name__ for f in funcs] == names
        assert len(weights) == len(names) and weights[0] == 0.6
    funcs, weights = reward_functions(scorer, "about")
    assert [f.__name__ for f in funcs] == ["about"] and weights == [1.0]


def tent_share(query: str, items: list[str]) -> float:
    """A user's reward, as `--reward py:module:function` names it: the share of tent items."""
    return sum("tent" in text.split(":")[0] for text in items) / 10


def test_a_user_reward_callable_scores_the_items_a_fan_out_retrieves(
    scorer: FanoutScorer,
) -> None:
    from service.errors import InputError
    from training.stage1_fanout.grpo import reward_terms_of, run_dir_for

    mode = f"py:{__name__}:tent_share"
    funcs, weights = reward_functions(scorer, mode)
    assert weights == [1.0] and reward_terms_of(mode) == ("user",)
    tents = format_fanout(["tent", "lantern", "compass", "backpack", "tarp", "violin", "cello",
                           "trumpet", "flute", "drum"])
    assert funcs[0]([""], [tents], query=["camping"]) == [0.1]
    assert funcs[0]([""], [""], query=["camping"]) == [0.0]  # no valid slot, no item
    assert "/" not in run_dir_for(Path("b"), mode).name
    for bad in ("py:no_such_module:f", f"py:{__name__}:missing", "bogus"):
        with pytest.raises(InputError):
            reward_terms_of(bad)


def test_the_label_reward_is_the_share_of_a_labeled_train_querys_groups_reached(
    setup: tuple[Path, Path], scorer: FanoutScorer,
) -> None:
    from tests.training.stage1_fanout.test_policy import THEMES
    from training.data.splits import query_texts
    from training.stage1_fanout.grpo import labeled_groups, reward_terms_of, training_queries_of

    groups = labeled_groups(setup[0])
    held_out = set(query_texts(setup[0], "val")) | set(query_texts(setup[0], "test"))
    assert groups and not set(groups) & held_out
    assert training_queries_of(setup[0], "label") == list(groups)
    query, members = next(iter(groups.items()))
    theme, _ = members[0][0].split("-", 1)
    reached = [group[0].split("-", 1)[1] for group in members[:3]]  # 3 of its groups
    other = next(words for name, words in THEMES.items() if name != theme)
    funcs, weights = reward_functions(scorer, "label")
    assert reward_terms_of("label") == ("label",) and weights == [1.0]
    completion = format_fanout(reached + other[: 10 - len(reached)])
    assert funcs[0]([""], [completion], query=[query]) == pytest.approx([3 / len(members)])
    assert funcs[0]([""], [format_fanout(other)], query=[query]) == [0.0]


def test_the_label_reward_without_labeled_train_queries_is_a_clear_error(tmp_path: Path) -> None:
    from tests.training.ranker.test_lambdarank import write_split
    from training.data.splits import BenchmarkQuery
    from training.stage1_fanout.grpo import training_queries_of

    write_split(tmp_path, "val", [BenchmarkQuery("tree", [["oak"]], id="t")])
    write_split(tmp_path, "test", [])
    write_split(tmp_path, "train", [BenchmarkQuery("oak", [["oak"]], id="o"),  # only held out
                                    BenchmarkQuery("rock")])  # no labels
    with pytest.raises(InputError, match="labeled train queries"):
        training_queries_of(tmp_path, "label")
    assert training_queries_of(tmp_path, "about") == ["oak", "rock"]


def test_aboutness_is_the_share_of_items_whose_text_the_lexical_index_matches(
    scorer: FanoutScorer,
) -> None:
    camping = scorer.score(["camping"], [GOOD])[0].about[0]
    music = scorer.score(["music"], [GOOD])[0].about[0]
    assert camping == 1.0 and music == 0.0  # every GOOD item is a camping item
    half = format_fanout(["tent", "lantern", "compass", "backpack", "tarp", "violin", "cello",
                          "trumpet", "flute", "drum"])
    assert scorer.score(["camping"], [half])[0].about[0] == 0.5
    assert scorer.score(["camping"], [format_fanout(["tent"] * 10)])[0].about[0] == 0.1


def test_one_grpo_step_changes_the_weights(
    setup: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.stage1_fanout.grpo_trainer as masked

    bundle, init = setup
    torch.set_num_threads(1)
    calls: list[tuple[tuple[int, ...], ...]] = []
    scored = masked.masked_log_probs

    def spy(
        logits: torch.Tensor, tokens: torch.Tensor, allowed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((tuple(logits.shape[:2]), tuple(tokens.shape), tuple(allowed.shape[:2])))
        return scored(logits, tokens, allowed)

    monkeypatch.setattr(masked, "masked_log_probs", spy)
    before = {k: v.clone() for k, v in load_policy(init)[0].state_dict().items()}
    config = resolve_config("tiny", reward="all")  # a continuous reward: never a flat group
    assert config.steps == 1 == GRPO_PRESETS["tiny"].steps
    final = train_grpo(bundle, config, init, run_dir=tmp_path / "run")
    after = load_policy(final)[0].state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "GRPO step left every weight unchanged"
    # beta > 0: the reference's pass and the policy's, every position of every completion
    assert len(calls) >= 2, "GRPO scored its completions without the decoding mask"
    assert all(a == b == c for a, b, c in calls)
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["config"]["reward"] == "all" and record["ledger"]["steps"] == 1
    curves = json.loads((tmp_path / "run" / "curves.json").read_text())
    assert curves["step"] == [1] and curves["ground"][0] is not None
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
    assert list((tmp_path / "run").glob("checkpoint-1"))
    train_grpo(bundle, resolve_config("tiny", reward="all", steps=2), init,
               run_dir=tmp_path / "run")
    curves = json.loads((tmp_path / "run" / "curves.json").read_text())
    assert curves["step"] == [1, 2]  # resumed from checkpoint-1, ran only step 2


def test_collapse_signatures_tell_the_modes_apart(scorer: FanoutScorer) -> None:
    nonsense = format_fanout([("line ending " * (i + 1)).strip() for i in range(10)])
    paraphrase = format_fanout([f"camping {w}" for w in ("stuff", "things", "kit", "gear",
                                "items", "goods", "supplies", "set", "outfit", "pack")])
    sig = {name: collapse_signatures(scorer, ["camping"], [text])
           for name, text in (("good", GOOD), ("nonsense", nonsense), ("para", paraphrase))}
    assert sig["good"]["non_catalog_name_share"] < sig["nonsense"]["non_catalog_name_share"]
    assert sig["nonsense"]["repeated_word_share"] > 0.5 > sig["good"]["repeated_word_share"]
    assert sig["para"]["contains_query_share"] == 1.0 > sig["good"]["contains_query_share"]
    assert sig["good"]["top_item_share"] <= sig["nonsense"]["top_item_share"]
    queries = [f"query {i}" for i in range(20)]
    stock = collapse_signatures(scorer, queries, [GOOD] * 20)  # one fan-out whatever the query
    own = [format_fanout([f"thing {i} {j}" for j in range(10)]) for i in range(20)]
    assert stock["stock_line_share"] == 1.0
    assert collapse_signatures(scorer, queries, own)["stock_line_share"] == 0.0


def test_best_of_n_keeps_each_querys_best_under_the_ablated_reward(scorer: FanoutScorer) -> None:
    queries = ["camping", "tent"]
    paraphrase = format_fanout([f"camping {w}" for w in ("stuff", "things", "kit", "gear",
                                "items", "goods", "supplies", "set", "outfit", "pack")])
    samples = [paraphrase, GOOD, format_fanout(["tent"] * 10), GOOD]  # 2 per query
    for mode in ("ground", "ground+align", "all"):
        chosen = best_of_n(scorer, queries, samples, 2, mode)
        for i, query in enumerate(queries):
            pair = samples[2 * i : 2 * i + 2]
            scores = mode_score(scorer, [query] * 2, pair, mode)  # (2,)
            assert chosen[i] == pair[int(scores.argmax())]
    assert best_of_n(scorer, queries, samples, 2, "all")[1] == GOOD  # not the ten duplicates
    only_ground = mode_score(scorer, ["camping"], [GOOD], "ground")
    assert np.isclose(only_ground[0], 0.6 * scorer.score(["camping"], [GOOD])[0].ground[0])


def test_ablation_report_lists_every_run(setup: tuple[Path, Path]) -> None:
    from training.stage1_fanout.ablation import ablation_report

    bundle, init = setup
    out = ablation_report(bundle, {"warm start": init, "all": init}, limit=2, best_of=2)
    report = json.loads((out / "report.json").read_text())
    assert set(report) == {"warm start", "all", "best-of-2 by ground",
                           "best-of-2 by ground+align", "best-of-2 by all"}
    assert 0.0 <= report["all"]["composite"] <= 1.0
    assert "| warm start |" in (out / "report.md").read_text()


def test_cli_registration_shares_the_train_and_export_groups() -> None:
    import argparse

    from training.stage1_fanout import command as stage1_command
    from training.stage1_fanout import export as policy_export
    from training.stage2_synthesis import command as synthesis

    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path, default=Path("models/default"))
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train").add_subparsers(dest="what", required=True)
    train.add_parser("diffusion")  # another stage registered first
    for module in (stage1_command, policy_export, synthesis):
        module.register(sub)
    args = parser.parse_args(["train", "folm", "--preset", "tiny", "--reward", "ground+align"])
    assert args.func is stage1_command.cmd_train_folm and args.reward == "ground+align"
    args = parser.parse_args(["train", "diffusion"])
    assert args.what == "diffusion"
    args = parser.parse_args(["export", "folm", "--which", "folm"])
    assert args.func is policy_export.cmd_export
    args = parser.parse_args(["synthesize", "--samples", "4", "--keep-top-frac", "0.25"])
    assert args.samples == 4 and args.keep_top_frac == 0.25 and args.backend == "local"


def test_context_decoding_needs_a_policy_with_catalog_names() -> None:
    from service.errors import InputError
    from training.stage1_fanout.grpo import check_decoding

    with pytest.raises(InputError, match="context > 0"):
        check_decoding("context", 0)
    check_decoding("lines", 0)
    check_decoding("context", 16)


def test_reward_ablation_runs_each_reward_on_free_lines_and_reports(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    import shutil

    from service.command import main

    bundle = tmp_path / "bundle"
    shutil.copytree(setup[0], bundle)
    main(["--bundle", str(bundle), "train", "folm", "--preset", "tiny", "--reward", "ablation",
          "--init", str(setup[1]), "--ablation-best-of", "2"])
    for mode in ("ground", "ground+align", "all"):
        record = json.loads((bundle / "runs/ablation" / mode / "config.json").read_text())
        assert record["config"]["decoding"] == "lines" and record["config"]["reward"] == mode
        assert record["config"]["lr"] == GRPO_PRESETS["tiny"].lr  # the preset's own settings
    report = json.loads((bundle / "runs/ablation/report.json").read_text())
    assert list(report) == ["warm start", "ground", "ground+align", "all", "best-of-2 by ground",
                            "best-of-2 by ground+align", "best-of-2 by all"]


def test_vllm_samples_a_regex_grammar_and_leaves_name_trees_to_generate() -> None:
    """On a GPU with vLLM: "lines" as its regex, "free" unconstrained; the name decodings (one
    tree per prompt, no single regex) keep HF generate and our logits processor."""
    gpu = Device("cuda", 1, True, True, "H200")
    lines = vllm_of("lines", gpu, 10)
    assert lines["use_vllm"] and lines["vllm_mode"] == "colocate"
    assert lines["vllm_structured_outputs_regex"] == lines_regex(10)
    assert vllm_of("free", gpu, 10)["vllm_structured_outputs_regex"] is None
    assert vllm_of("context", gpu, 10) == vllm_of("catalog", gpu, 10) == {}
    assert vllm_of("lines", Device("cuda", 1, True, False, "H200"), 10) == {}
    assert vllm_of("lines", Device("cpu", 0, False, False, "cpu"), 10) == {}


def test_a_steps_prompts_are_shared_among_processes() -> None:
    config = GRPO_PRESETS["gpu"]  # 16 prompts × 8 completions per step
    assert per_process_batch(config, 1) == 128
    assert per_process_batch(config, 4) == 32
    with pytest.raises(InputError, match="do not split over 3 processes"):
        per_process_batch(config, 3)
