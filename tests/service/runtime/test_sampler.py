import numpy as np
import pytest

from service.errors import BundleError
from service.runtime.sampler import DiffusionSampler
from tests.training.stage3_diffusion.proxy_dataset import tiny_diffusion_dir


@pytest.fixture(scope="module")
def diffusion_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return tiny_diffusion_dir(tmp_path_factory.mktemp("tiny"), solver="heun", steps=3)


def _queries(n: int) -> np.ndarray:
    q = np.random.default_rng(5).standard_normal((n, 128)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def test_sample_shape_unit_rows_and_cpu_provider(diffusion_dir):
    sampler = DiffusionSampler(diffusion_dir, threads=1)
    rows = sampler.sample(_queries(4), seed=0)
    assert rows.shape == (4, sampler.config["rows"], 128) and rows.dtype == np.float32
    assert np.allclose(np.linalg.norm(rows, axis=-1), 1.0, atol=1e-5)
    assert "CPUExecutionProvider" in sampler.providers
    assert sampler.config["solver"] == "heun" and sampler.config["steps"] == 3


def test_seed_fixes_the_noise_and_the_rows(diffusion_dir):
    sampler = DiffusionSampler(diffusion_dir, threads=1)
    queries = _queries(3)
    assert np.array_equal(sampler.sample(queries, seed=1), sampler.sample(queries, seed=1))
    assert not np.allclose(sampler.sample(queries, seed=1), sampler.sample(queries, seed=2))


def test_rows_depend_on_the_query(diffusion_dir):
    sampler = DiffusionSampler(diffusion_dir, threads=1)
    noise = sampler.noise(2, seed=0)
    a = sampler.sample(_queries(2), noise=noise)
    b = sampler.sample(-_queries(2), noise=noise)
    assert not np.allclose(a, b)


def test_empty_batch_and_bad_shapes(diffusion_dir):
    sampler = DiffusionSampler(diffusion_dir, threads=1)
    assert sampler.sample(np.zeros((0, 128), np.float32)).shape == (0, 10, 128)
    with pytest.raises(ValueError):
        sampler.sample(np.zeros((2, 64), np.float32))


def test_missing_model_is_a_bundle_error(tmp_path):
    with pytest.raises(BundleError, match="export diffusion"):
        DiffusionSampler(tmp_path)


@pytest.fixture(scope="module")
def context_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return tiny_diffusion_dir(tmp_path_factory.mktemp("ctx"), solver="euler", steps=3,
                              context=4)


def test_a_sampler_with_context_needs_it_and_uses_it(context_dir):
    whole = DiffusionSampler(context_dir, threads=1)
    assert whole.context == 4
    queries = _queries(3)
    context = np.stack([_queries(4) for _ in range(3)])  # (3, 4, 128)
    with pytest.raises(ValueError, match="needs context"):
        whole.sample(queries, seed=0)
    with pytest.raises(ValueError, match="needs context"):
        whole.sample(queries, seed=0, context=context[:, :3])
    rows = whole.sample(queries, seed=0, context=context)
    assert rows.shape == (3, 10, 128)
    assert not np.allclose(rows, whole.sample(queries, seed=0, context=context[:, ::-1]))



@pytest.mark.parametrize("form", ["unrolled", "loop"])
def test_a_mixture_head_returns_the_weights_its_rows_are(tmp_path, form):
    import torch

    torch.set_num_threads(1)
    directory = tiny_diffusion_dir(tmp_path, solver="heun", steps=2, context=4, form=form,
                                   parts=("name",))
    sampler = DiffusionSampler(directory, threads=1)
    assert sampler.pointed and sampler.config["claims"] == "pointers"
    # the graph returns the weights alone: the mixture and the last update are not in it
    assert sampler.mixed and [o.name for o in sampler.session.get_outputs()] == ["weights"]
    queries = _queries(3)
    context = np.concatenate([np.stack([_queries(4) for _ in range(3)]),  # (3, 4, 128 + 1)
                              np.full((3, 4, 1), 0.5, np.float32)], axis=2)
    drawn = sampler.draw(queries, seed=0, context=context)
    assert drawn.weights is not None and drawn.weights.shape == (3, 10, 4)
    np.testing.assert_allclose(drawn.weights.sum(axis=2), 1.0, atol=1e-5)  # guided, still 1
    mixed = drawn.weights @ context[..., :128]  # (3, 10, 128)
    mixed /= np.linalg.norm(mixed, axis=2, keepdims=True)
    np.testing.assert_allclose(drawn.rows, mixed, atol=1e-4)
    assert np.array_equal(sampler.sample(queries, seed=0, context=context), drawn.rows)
    empty = sampler.draw(queries[:0], context=context[:0])
    assert empty.rows.shape == (0, 10, 128) and empty.weights.shape == (0, 10, 4)


def test_a_vector_head_returns_no_weights(context_dir):
    sampler = DiffusionSampler(context_dir, threads=1)
    context = np.stack([_queries(4) for _ in range(2)])
    assert not sampler.pointed
    assert sampler.draw(_queries(2), seed=0, context=context).weights is None


def test_the_noise_is_standard_normal_and_the_seed_decides_it(diffusion_dir):
    from scipy import stats

    sampler = DiffusionSampler(diffusion_dir, threads=1)
    noise = sampler.noise(64, seed=0)
    assert noise.shape == (64, 10, 128) and noise.dtype == np.float32
    assert stats.kstest(noise.ravel(), "norm").pvalue > 0.01
    assert stats.kstest(noise[0].ravel(), "norm").pvalue > 0.01  # one query's block
    assert np.array_equal(noise, sampler.noise(64, seed=0))
    assert not np.allclose(noise, sampler.noise(64, seed=1))
    assert not np.allclose(sampler.noise(64), sampler.noise(64))  # fresh without a seed
    assert sampler.noise(0, seed=0).shape == (0, 10, 128)
