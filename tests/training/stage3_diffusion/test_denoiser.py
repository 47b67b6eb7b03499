import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from service.errors import BundleError, InputError
from service.fanout.candidates import Candidates
from tests.training.stage3_diffusion.proxy_dataset import synthetic_blocks, synthetic_neighbourhood
from training.stage3_diffusion.context import Neighbourhood
from training.stage3_diffusion.denoiser import (
    PRESETS,
    Denoiser,
    DenoiserConfig,
    flops_per_step,
    preset,
)
from training.stage3_diffusion.solvers import (
    euler_pf_ode,
    heun_edm,
    sigma_schedule,
    solver_evaluations,
)
from training.stage3_diffusion.trainer import (
    CHECKPOINT,
    batch_of,
    context_order,
    dsm_loss,
    load_ema,
    lr_factor,
    new_state,
    rows_from_block,
    stored_config_hash,
    train,
    train_preset,
    train_step,
)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def _randomised(config_name: str = "tiny", **overrides) -> Denoiser:
    torch.manual_seed(0)
    model = Denoiser(preset(config_name, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _fixed_loss(state, config, query, target, context=None) -> float:
    with torch.no_grad():
        return float(dsm_loss(state.model, query, target, config, torch.Generator().manual_seed(7),
                              context))


def test_one_training_step_lowers_the_loss_on_a_fixed_batch():
    config = train_preset("tiny", lr=3e-3, warmup=1)
    state = new_state(config)
    query, target, _, _ = batch_of(synthetic_blocks(), config, torch.Generator().manual_seed(1))
    before = _fixed_loss(state, config, query, target)
    state.generator = torch.Generator().manual_seed(7)  # the step sees the same noise
    train_step(state, config, query, target)
    assert _fixed_loss(state, config, query, target) < before


def test_training_with_a_context_attends_to_each_querys_nearest_items(tmp_path):
    data = synthetic_blocks()
    config = train_preset("tiny", lr=3e-3, warmup=1, model=preset("tiny", context=4))
    with pytest.raises(ValueError, match="neighbourhood"):
        train(data, config, tmp_path, progress=False)
    neighbours = synthetic_neighbourhood(data, 4)
    nearest = np.argsort(-(data.query_emb @ data.catalog.T), axis=1)[:, :4]  # (N, 4)
    assert np.array_equal(neighbours.rows, nearest)
    state = new_state(config)
    query, target, context, _ = batch_of(data, config, torch.Generator().manual_seed(1), neighbours)
    assert context.shape == (config.batch, 4, 128)
    before = _fixed_loss(state, config, query, target, context)
    state.generator = torch.Generator().manual_seed(7)
    train_step(state, config, query, target, context)
    assert _fixed_loss(state, config, query, target, context) < before


def test_context_conditions_the_rows_and_is_dropped_with_the_query():
    model = _randomised(context=4)
    x, sigma, query = torch.randn(2, 10, 128), torch.tensor([0.1, 0.5]), torch.randn(2, 128)
    c1, c2 = torch.randn(2, 4, 128), torch.randn(2, 4, 128)
    out = model(x, sigma, query, context=c1)
    assert not torch.allclose(out, model(x, sigma, query, context=c2))
    dropped = torch.zeros(2)  # the null condition of CFG ignores the context
    assert torch.allclose(model(x, sigma, query, dropped, c1),
                          model(x, sigma, query, dropped, c2))
    perm = torch.randperm(10)
    assert torch.allclose(model(x[:, perm], sigma, query, context=c1), out[:, perm],
                          atol=1e-5)
    guided = model.guided(x, sigma, query, 0.5, c1)
    uncond = model(x, sigma, query, dropped, c1)
    assert torch.allclose(guided, out + 0.5 * (out - uncond), atol=1e-6)
    with pytest.raises(ValueError, match="context must be"):
        model(x, sigma, query)


def test_a_prompt_context_is_the_items_each_querys_prompt_names():
    from service.fanout.grounding import PromptNeighbourhood
    from service.runtime.index import build_index
    from training.stage3_diffusion.context import block_neighbourhood

    data = synthetic_blocks()
    nearest = np.argsort(-(data.query_emb @ data.catalog.T), axis=1)  # (N, M)
    texts = [f"item {j}: synthetic" for j in range(len(data.catalog))]
    texts[nearest[0, 0]] = f"{data.queries[0]}: the query's own item"  # its prompt skips it
    prompt = PromptNeighbourhood(Candidates(build_index(data.catalog)), texts, data.catalog, 4)
    neighbours = block_neighbourhood(data, None, data.catalog, 4, prompt)
    assert neighbours.rows.shape == (len(data.query_emb), 4)
    for block in range(len(data.query_emb)):
        start = 1 if data.query_index[block] == 0 else 0
        assert np.array_equal(neighbours.rows[block], nearest[block, start : start + 4])


def test_a_prompt_context_must_name_as_many_items_as_the_teachers_prompts(tmp_path):
    from training.stage3_diffusion.context import check_prompt_context

    check_prompt_context(tmp_path, 16, "hybrid")  # no record: nothing to check
    (tmp_path / "config.json").write_text('{"stage": "synthesis", "context": 16}')
    check_prompt_context(tmp_path, 16, "dense")  # a record without a source named dense candidates
    with pytest.raises(BundleError, match="named 16 items"):
        check_prompt_context(tmp_path, 8, "dense")
    with pytest.raises(BundleError, match="'dense' candidates"):
        check_prompt_context(tmp_path, 16, "hybrid")
    (tmp_path / "config.json").write_text('{"context": 16, "candidates": "hybrid"}')
    check_prompt_context(tmp_path, 16, "hybrid")


def test_a_ranked_context_must_be_as_many_items_as_its_teacher_chose_among(tmp_path):
    from training.stage3_diffusion.context import check_context_size

    (tmp_path / "config.json").write_text('{"context": 12, "candidates": "ranked"}')
    assert check_context_size(tmp_path, 12, "ranked")["context"] == 12
    with pytest.raises(BundleError, match=r"named 12 items.*context_source='ranked'"):
        check_context_size(tmp_path, 24, "ranked")


def test_new_options_keep_old_configs_and_their_hashes():
    config = preset("cpu", context_source="nearest")
    assert "context_source" not in config.to_dict()
    assert DenoiserConfig.from_dict(config.to_dict()) == config
    prompt = preset("cpu", context_source="prompt")
    assert DenoiserConfig.from_dict(prompt.to_dict()) == prompt
    with pytest.raises(InputError, match="context_source"):
        preset("cpu", context_source="random")
    dense = preset("cpu", candidates="dense")
    assert "candidates" not in dense.to_dict()
    assert DenoiserConfig.from_dict(preset("cpu").to_dict()).candidates == "hybrid"
    with pytest.raises(InputError, match="candidates"):
        preset("cpu", candidates="nearest")


def test_configs_naming_removed_options_load_at_their_surviving_value():
    train_config = train_preset("tiny")
    old = train_config.to_dict()
    old["model"] = old["model"] | {"conditioning": "adaln", "head": "vector"}
    assert DenoiserConfig.from_dict(old["model"]) == train_config.model
    assert stored_config_hash(old) == stored_config_hash(train_config.to_dict())
    for removed in ({"conditioning": "token"}, {"head": "context"}):
        with pytest.raises(BundleError, match="no longer supported"):
            DenoiserConfig.from_dict(train_config.model.to_dict() | removed)


def test_ordered_rows_sort_each_block_by_cosine_to_the_query_and_carry_positions():
    config = train_preset("tiny", model=preset("tiny", ordered=True))
    data = synthetic_blocks()
    query, target, _, _ = batch_of(data, config, torch.Generator().manual_seed(1))
    sims = (target @ query[:, :, None])[..., 0]  # (B, k)
    assert (sims[:, :-1] >= sims[:, 1:]).all()
    unsorted = torch.from_numpy(data.target_emb)  # the stored blocks are not in that order
    assert not all(((unsorted @ torch.from_numpy(data.query_emb)[:, :, None])[..., 0]
                    .diff(dim=1) <= 0).all(dim=1))
    model = _randomised(ordered=True)
    x, sigma, q = torch.randn(2, 10, 128), torch.tensor([0.05, 0.5]), torch.randn(2, 128)
    perm = torch.flip(torch.arange(10), [0])
    out = model(x, sigma, q)
    assert not torch.allclose(model(x[:, perm], sigma, q), out[:, perm], atol=1e-3)


def test_teacher_target_order_keeps_each_block_as_written_and_leaves_old_hashes_alone():
    data = synthetic_blocks()
    config = train_preset("tiny", model=preset("tiny", ordered=True), target_order="teacher")
    generator = torch.Generator().manual_seed(1)
    picks = torch.randint(0, len(data.query_emb), (config.batch,), generator=generator)
    _, target, _, _ = batch_of(data, config, torch.Generator().manual_seed(1))
    assert torch.equal(target, torch.from_numpy(data.target_emb[picks.numpy()]))
    by_query = replace(config, target_order="query")
    assert "target_order" not in by_query.to_dict()  # runs written before the option match
    assert config.to_dict()["target_order"] == "teacher"
    with pytest.raises(InputError, match="target_order"):
        replace(config, target_order="random")


def test_context_target_order_puts_each_block_in_its_context_order():
    data = synthetic_blocks()  # each query's 20 items; its blocks, 10 of them
    assert data.catalog is not None
    shuffled = np.random.default_rng(0).permutation(20)  # the context: all 20, in this order
    neighbourhood = Neighbourhood(data.query_index[:, None] * 20 + shuffled[None, :], data.catalog)
    config = train_preset("tiny", model=preset("tiny", ordered=True, context=20),
                          target_order="context")
    picks = torch.randint(0, len(data.query_emb), (config.batch,),
                          generator=torch.Generator().manual_seed(1)).numpy()
    _, target, _, _ = batch_of(data, config, torch.Generator().manual_seed(1), neighbourhood)
    for b, block in enumerate(picks.tolist()):  # by each item's slot in its context
        slot = {int(row): i for i, row in enumerate(neighbourhood.rows[block])}
        rows = sorted(data.target_rows[block].tolist(), key=slot.__getitem__)
        assert torch.equal(target[b], torch.from_numpy(data.catalog[rows]))
    assert not torch.equal(target, torch.from_numpy(data.target_emb[picks]))  # reordered
    with pytest.raises(InputError, match="context"):  # no context to order by
        replace(config, model=preset("tiny", ordered=True))


def test_context_order_takes_a_repeated_slot_once_and_refuses_an_item_outside():
    context = np.array([[7, 3, 7, 5, 9]])  # a query with fewer candidates repeats them
    assert context_order(np.array([[5, 7, 9]]), context).tolist() == [[1, 0, 2]]
    with pytest.raises(BundleError, match="every block item in its context"):
        context_order(np.array([[5, 8, 9]]), context)


def test_denoiser_is_permutation_equivariant_over_rows():
    model = _randomised()
    x, query = torch.randn(2, 10, 128), torch.randn(2, 128)
    sigma = torch.tensor([0.05, 0.5])
    perm = torch.randperm(10)
    out = model(x, sigma, query)
    assert torch.allclose(model(x[:, perm], sigma, query), out[:, perm], atol=1e-5)


def test_condition_changes_the_output_and_cfg_zero_is_the_conditional_model():
    model = _randomised()
    x, sigma = torch.randn(2, 10, 128), torch.tensor([0.1, 0.1])
    q1, q2 = torch.randn(2, 128), torch.randn(2, 128)
    assert not torch.allclose(model(x, sigma, q1), model(x, sigma, q2))
    assert torch.allclose(model.guided(x, sigma, q1, 0.0), model(x, sigma, q1))
    guided = model.guided(x, sigma, q1, 0.5)
    cond = model(x, sigma, q1)
    uncond = model(x, sigma, q1, keep=torch.zeros(2))
    assert torch.allclose(guided, cond + 0.5 * (cond - uncond), atol=1e-6)


@pytest.mark.parametrize("config", [PRESETS["tiny"], PRESETS["cpu"]], ids=["tiny", "cpu"])
def test_flops_per_step_matches_a_flop_counter(config):
    model = Denoiser(config).eval()
    context = torch.randn(4, config.context, config.dim) if config.context else None
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(4, config.rows, config.dim), torch.ones(4), torch.randn(4, 128),
              context=context)
    assert counter.get_total_flops() / 4 == pytest.approx(flops_per_step(config), rel=0.01)


def test_sigma_schedule_and_evaluation_counts():
    sigmas = sigma_schedule(8, 0.002, 1.0)
    assert len(sigmas) == 9 and sigmas[-1] == 0.0
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-2] == pytest.approx(0.002)
    assert all(a > b for a, b in itertools.pairwise(sigmas))
    assert solver_evaluations("euler", 8) == 8 and solver_evaluations("heun", 8) == 15


def test_samplers_give_unit_rows_deterministic_per_generator():
    model = _randomised()
    query = torch.nn.functional.normalize(torch.randn(3, 128), dim=-1)
    a = heun_edm(model, query, 4, generator=torch.Generator().manual_seed(3))
    b = heun_edm(model, query, 4, generator=torch.Generator().manual_seed(3))
    c = euler_pf_ode(model, query, 4, generator=torch.Generator().manual_seed(4))
    assert a.shape == (3, 10, 128) and torch.equal(a, b) and not torch.allclose(a, c)
    assert torch.allclose(a.norm(dim=-1), torch.ones(3, 10), atol=1e-5)


def test_extra_rows_copy_items_of_the_block():
    target = torch.randn(4, 10, 128)
    rows = rows_from_block(target, 12, torch.Generator().manual_seed(0))
    assert rows.shape == (4, 12, 128) and torch.equal(rows[:, :10], target)
    for b in range(4):
        for extra in rows[b, 10:]:
            assert any(torch.equal(extra, item) for item in target[b])


def test_lr_schedule_warms_up_then_decays_to_zero():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100) == pytest.approx(0.5)
    assert lr_factor(100, 10, 100) == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(lr_factor(10, 10, 100), 1.0)


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    data = synthetic_blocks()
    config = train_preset("tiny", steps=20, checkpoint_every=7)
    straight = train(data, config, tmp_path / "a", progress=False)
    halfway = train(data, config, tmp_path / "b", progress=False, until=10)
    resumed = train(data, config, tmp_path / "b", progress=False)
    assert halfway["ledger"]["steps"] == 10
    assert resumed["ledger"]["steps"] == straight["ledger"]["steps"] == 20
    a = load_ema(tmp_path / "a" / CHECKPOINT)[0].state_dict()
    b = load_ema(tmp_path / "b" / CHECKPOINT)[0].state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (tmp_path / "b" / "loss_curve.png").stat().st_size > 0
    with pytest.raises(BundleError, match="another config"):
        train(data, train_preset("tiny", steps=20, lr=0.5), tmp_path / "a", progress=False)


def test_a_checkpoint_resumes_only_on_the_device_it_was_trained_on(tmp_path):
    """Its random stream lives on that device: a CPU run does not continue a CUDA one."""
    data = synthetic_blocks()
    config = train_preset("tiny", steps=4, checkpoint_every=2)
    train(data, config, tmp_path, progress=False, until=2)
    payload = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert payload["device"] == "cpu"
    torch.save({**payload, "device": "cuda"}, tmp_path / CHECKPOINT)
    with pytest.raises(BundleError, match="trained on cuda, this run is on cpu"):
        train(data, config, tmp_path, progress=False)


def test_train_diffusion_size_options_reach_the_model_and_bad_sizes_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service import command as cli
    from training.stage3_diffusion import trainer

    seen = []
    monkeypatch.setattr(trainer, "train_on_bundle",
                        lambda bundle, config, *a, **k: seen.append(config) or {"ledger": {}})
    argv = ["--bundle", str(tmp_path), "train", "diffusion", "--layers", "2", "--hidden", "64",
            "--mlp", "256", "--heads", "2", "--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) in (0, None)
    assert seen[0].model == preset("cpu", layers=2, hidden=64, mlp=256, heads=2)
    assert cli.main([*argv[:4], "--hidden", "128", "--heads", "3"]) == 2
    assert "hidden=128 must be divisible by heads=3" in capsys.readouterr().err
    with pytest.raises(InputError, match="rows L=8 must be at least k=10"):
        preset("cpu", rows=8)
