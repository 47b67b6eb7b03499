"""The fan-out language model (FOLM): a small decoder-only LM in the Hugging Face format.

A Qwen2-style config (grouped-query attention, RoPE, SwiGLU, RMSNorm, tied embeddings) with a
byte-level BPE tokenizer trained with `tokenizers` on the catalog's texts and the training
queries' texts (never val/test). Presets: `cpu` (the default, small enough that stages 1 and 2
each fit a CPU build on 2 cores) and `tiny` (tests, seconds). Any local
Hugging Face causal-LM checkpoint can be named instead with `load_policy(path)` (a Qwen3 or
Gemma 3 on disk: the accelerator recipe, docs/gpu.md); it is prompted as the default policy
is. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from service.fanout.format import (
    CONTEXT_SEPARATOR,
    PROMPT_RECIPE,
    build_prompt,
    format_fanout,
    item_names,
)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class PolicyConfig:
    """Architecture and decoding budget of a from-scratch FOLM."""

    preset: str = "cpu"
    vocab_size: int = 4096
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 384
    max_positions: int = 256
    max_new_tokens: int = 64  # k catalog names, one per line, with headroom
    k: int = PROMPT_RECIPE.k
    context: int = PROMPT_RECIPE.context  # candidate catalog names in the prompt; 0 = none
    candidates: str = PROMPT_RECIPE.candidates  # their source (service/fanout/candidates.py)
    rope_theta: float = 10000.0


POLICY_PRESETS: dict[str, PolicyConfig] = {
    "tiny": PolicyConfig(
        preset="tiny", vocab_size=384, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1,
        intermediate_size=64, max_positions=128, max_new_tokens=32, context=4,
    ),
    "cpu": PolicyConfig(),
}


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over `texts`; encoding prepends <bos>, decoding is lossless."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def tokenizer_corpus(catalog_texts: list[str], queries: list[str]) -> list[str]:
    """What the tokenizer sees: catalog texts, prompts and fan-out/context-shaped name lists."""
    names = item_names(catalog_texts)
    blocks = [names[i : i + 10] for i in range(0, len(names), 10)]
    prompts = [build_prompt(q, blocks[i % len(blocks)] if blocks else ()) for i, q in
               enumerate(queries)]
    name_blocks = [format_fanout(b) for b in blocks]
    context_blocks = [CONTEXT_SEPARATOR.join(b) for b in blocks]
    return [*catalog_texts, *prompts, *name_blocks, *context_blocks]


def hf_tokenizer(tokenizer: Tokenizer, max_length: int) -> PreTrainedTokenizerFast:
    """Wrap a `tokenizers` tokenizer for transformers/TRL (left padding for generation)."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=max_length,
    )
    wrapped.padding_side = "left"
    return wrapped


def build_model(config: PolicyConfig, tokenizer: Tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    hf_config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.max_positions,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        use_cache=True,
    )
    return Qwen2ForCausalLM(hf_config)


def init_embeddings_from_encoder(
    model: Qwen2ForCausalLM, tokenizer: Tokenizer, encode: Any, norm: float = 0.5
) -> int:
    """Start the (tied) token embeddings at the retrieval encoder's vectors of each token's text.

    The encoder is Matryoshka-trained, so its first `hidden_size` dims are a usable embedding
    when the model is narrower. Rows of special or empty tokens keep their random init.
    Returns how many rows were set. This gives the from-scratch policy the encoder's notion of
    similar words, which the warm start would otherwise have to learn from the catalog alone.
    """
    weight = model.get_input_embeddings().weight  # (V, D)
    dim = weight.shape[1]
    texts = [tokenizer.decode([i], skip_special_tokens=True).strip()
             for i in range(weight.shape[0])]
    rows = [i for i, t in enumerate(texts) if t and t not in SPECIAL_TOKENS]
    vectors = torch.from_numpy(encode([texts[i] for i in rows]))[:, :dim]  # (R, min(d, D))
    vectors = vectors / vectors.norm(dim=1, keepdim=True).clamp_min(1e-6) * norm
    with torch.no_grad():
        weight[rows, : vectors.shape[1]] = vectors.to(weight.dtype)
        if vectors.shape[1] < dim:
            weight[rows, vectors.shape[1] :] *= 0.1
    return len(rows)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_policy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, directory: Path,
    meta: dict[str, Any],
) -> None:
    """A loadable HF checkpoint folder plus `policy.json` (our config, seed, commit...)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "policy.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def load_policy(directory: Path) -> tuple[Any, PreTrainedTokenizerFast]:
    """Any local HF causal-LM folder (ours or e.g. a Qwen3 on disk); never downloads."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                 dtype=torch.float32)  # a GPU run saves bf16
    return model, tokenizer


def load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A checkpoint's tokenizer, padding on the left (generation), <eos> as padding if it
    has none."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face checkpoint at {directory}")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def policy_meta(directory: Path) -> dict[str, Any]:
    """A checkpoint's policy.json; a checkpoint we did not write (no policy.json) is
    prompted as the default policy (its k, context names, their source, token budget)."""
    path = Path(directory) / "policy.json"
    if path.is_file():
        return json.loads(path.read_text())
    return {"policy": foreign_policy(), "init": str(directory)}


def foreign_policy() -> dict[str, Any]:
    """The prompt and budget of a checkpoint we did not train: the default policy's."""
    policy = asdict(POLICY_PRESETS["cpu"])
    return {"preset": "foreign", **{key: policy[key] for key in
                                    ("k", "context", "candidates", "max_new_tokens")}}
