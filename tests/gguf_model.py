"""A tiny random Llama model written as a GGUF file with the `gguf` package: what llama.cpp and
transformers' GGUF loader read, in kilobytes (a byte-fallback SentencePiece vocabulary, so any
text, every catalog name included, can be written)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

EMBED, FF, LAYERS, HEADS = 32, 64, 2, 2
SPECIALS = ("<unk>", "<s>", "</s>")
PIECES = ("▁", "▁a", "▁the", "e", "a", "s", "t", "n", "\n")  # a few merged pieces past bytes


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types (2 unknown, 3 control, 6 byte, 1 normal)."""
    import gguf

    kinds = gguf.TokenType
    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + list(PIECES)
    types = [kinds.UNKNOWN, kinds.CONTROL, kinds.CONTROL] + [kinds.BYTE] * 256 + \
        [kinds.NORMAL] * len(PIECES)
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(PIECES))]
    return tokens, scores, [int(t) for t in types]


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """Write the model to `path` (a .gguf file), with `chat_template` if given; returns it."""
    import gguf

    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(512)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", weight(len(tokens), EMBED))  # (V, D)
    for i in range(LAYERS):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(EMBED, EMBED))  # (D, D)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(FF, EMBED))  # (F, D)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(FF, EMBED))  # (F, D)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(EMBED, FF))  # (D, F)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(EMBED, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    writer.add_tensor("output.weight", weight(len(tokens), EMBED))  # (V, D)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
