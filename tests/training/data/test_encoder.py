"""The encoder as a bundle setting: a transformer checkpoint exported to ONNX into the bundle,
the catalog embedded by it, the service encoding queries with it (no torch there)."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.artifacts.bundle import load_bundle
from service.command import main
from service.errors import BundleError
from service.runtime.encoder import Encoder
from tests.prerequisites import needs
from training.data.encoder import encoder_source, export_encoder
from training.pipeline import CatalogConfig, build_catalog

WORDS = ["tree", "oak", "pine", "a", "of", "the", "tall", "plant", "wood", "with", "leaves"]
# the tiny checkpoint is built, and exported, in torch
needs_torch = needs(modules=("torch",), package="torch, the train extra (make install)")


def tiny_encoder_checkpoint(folder: Path) -> Path:
    """A random 32-d, one-layer BERT with a word-level WordPiece tokenizer, saved as a
    sentence-transformers folder would be (config, weights, tokenizer.json, pooling)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]").save_pretrained(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": 1}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_encoder_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def encoder_bundle(tmp_path_factory: pytest.TempPathFactory, small_sources, checkpoint) -> Path:
    catalog, benchmark = small_sources
    bundle_dir = tmp_path_factory.mktemp("bundles") / "tiny-bert"
    build_catalog(bundle_dir, CatalogConfig(source=str(catalog), benchmark=str(benchmark),
                                            dim=32, encoder=str(checkpoint)))
    return bundle_dir


@needs_torch
@pytest.mark.parametrize("batch_size, tokens_per_run", [(2, None), (512, 12)])
def test_exported_encoder_matches_the_checkpoint_whatever_the_batch(
        checkpoint, tmp_path, monkeypatch, batch_size, tokens_per_run):
    import torch
    from transformers import AutoModel, AutoTokenizer

    import service.runtime.encoder as encoder_module

    config = export_encoder(encoder_source(str(checkpoint)), tmp_path / "encoder")
    if tokens_per_run:  # runs cut by padded tokens rather than by count
        monkeypatch.setattr(encoder_module, "TOKENS_PER_RUN", tokens_per_run)
    encoder = Encoder(replace(config, batch_size=batch_size))  # texts by length
    texts = ["oak", "a tall tree of the pine with leaves", "wood", "plant with leaves", "pine"]
    model = AutoModel.from_pretrained(str(checkpoint)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    expected = []
    for text in texts:  # one text at a time: no padding anywhere
        batch = tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            expected.append(model(**batch).last_hidden_state.mean(1)[0].numpy())
    expected = np.stack(expected) / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(encoder.encode(texts), expected, atol=1e-5)  # padded, reordered
    assert encoder.encode([]).shape == (0, 32)


@needs_torch
def test_bundle_embeds_its_catalog_with_the_encoder_it_serves(encoder_bundle):
    bundle = load_bundle(encoder_bundle)
    assert bundle.manifest["encoder"] == {"name": "checkpoint0", "dim": 32, "folder": "encoder"}
    texts = bundle.items.texts[:5]
    served = Encoder(bundle.encoder_config).encode(texts)  # what the service runs on a query
    np.testing.assert_allclose(served, bundle.items.embeddings[:5], atol=1e-5)


@needs_torch
def test_a_corrupted_encoder_is_refused(encoder_bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(encoder_bundle, copy)
    with (copy / "encoder" / "model.onnx").open("r+b") as model:
        model.seek(100)
        flipped = bytes(b ^ 0xFF for b in model.read(4))
        model.seek(100)
        model.write(flipped)
    with pytest.raises(BundleError, match=r"encoder/model\.onnx fails its sha256 check"):
        load_bundle(copy)


@needs_torch
def test_the_service_encodes_queries_with_the_bundles_encoder(encoder_bundle):
    from service.runtime.index import search
    from tests.service.live import live_server, make_settings

    bundle = load_bundle(encoder_bundle)
    query = "a tall oak tree with leaves"
    scores, rows = search(bundle.index, Encoder(bundle.encoder_config).encode([query]), 5)
    with live_server(make_settings(encoder_bundle, None, routes="single=1")) as live, \
            live.client() as client:
        body = client.post("/v1/retrieve", json={"query": query, "k": 5}).json()
    assert [item["id"] for item in body["items"]] == [bundle.items.ids[r] for r in rows[0]]
    assert body["groundedness"] == pytest.approx(float(scores[0, 0]), abs=1e-5)


@needs_torch
def test_a_new_checkpoint_rebuilds_the_catalog(small_sources, tmp_path, capsys):
    catalog, _ = small_sources
    checkpoint = tiny_encoder_checkpoint(tmp_path / "checkpoint")
    config = CatalogConfig(source=str(catalog), dim=32, encoder=str(checkpoint))
    build_catalog(tmp_path / "b", config)
    before = np.load(tmp_path / "b" / "embeddings.npy")
    from transformers import BertModel

    BertModel(BertModel.config_class.from_pretrained(checkpoint)).save_pretrained(checkpoint)
    capsys.readouterr()
    build_catalog(tmp_path / "b", config)
    assert "catalog: rebuild (config changed)" in capsys.readouterr().out
    assert not np.allclose(np.load(tmp_path / "b" / "embeddings.npy"), before)


@needs_torch
def test_a_bundle_keeps_its_encoder_when_rebuilt_without_naming_it(encoder_bundle,
                                                                     small_sources, capsys):
    catalog, benchmark = small_sources
    capsys.readouterr()
    assert main(["--bundle", str(encoder_bundle), "catalog", "--source", str(catalog),
                 "--benchmark", str(benchmark)]) == 0
    assert "every stage is up to date" in capsys.readouterr().out
    assert main(["--bundle", str(encoder_bundle), "catalog", "--source", str(catalog),
                 "--benchmark", str(benchmark), "--dim", "128"]) == 2  # its encoder is 32-d
    assert "was built with dim 32, not 128" in capsys.readouterr().err


def test_a_wordllama_bundle_keeps_the_catalog_key_it_had_before_encoders_were_a_setting(
        tmp_path):
    from training.data.parts import PART_NAMES
    from training.pipeline import stage_keys

    assert stage_keys(CatalogConfig())["catalog"] == {"source": "wordnet", "dim": 128,
                                                       "index_factory": None,
                                                       "parts": list(PART_NAMES)}
    with pytest.raises(BundleError, match=r"--dim 100: WordLlama's dimensions are \(64"):
        build_catalog(tmp_path / "b", CatalogConfig(dim=100))
    assert not (tmp_path / "b").exists()


@needs_torch
def test_a_wrong_dim_or_encoder_is_refused(small_sources, checkpoint, tmp_path):
    catalog, _ = small_sources
    with pytest.raises(BundleError, match="gives 32-d vectors, not --dim 128"):
        build_catalog(tmp_path / "b", CatalogConfig(source=str(catalog), encoder=str(checkpoint)))
    with pytest.raises(BundleError, match="not wordllama, minilm or a local checkpoint"):
        encoder_source(str(tmp_path / "nowhere"))
    dense = tiny_encoder_checkpoint(tmp_path / "dense")
    (dense / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Transformer"},
        {"type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(BundleError, match="unsupported sentence-transformers modules"):
        export_encoder(encoder_source(str(dense)), tmp_path / "out")
