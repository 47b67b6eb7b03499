"""A tiny randomly initialised Hugging Face checkpoint shaped like a foreign LLM's: the
accelerator recipe's stand-in teacher wherever no real one is on disk (tests, a GPU smoke run).

A Qwen3 architecture with a Qwen-style tokenizer (byte-level BPE, `<|endoftext|>` padding,
`<|im_end|>` end of turn, no BOS, a chat template) and a vocabulary padded past the tokenizer's,
as real checkpoints are; no policy.json. Nothing is downloaded: the tokenizer is trained here
on the texts given.

    python -m training.stage1_fanout.random_init DIR [--texts FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
VOCAB = 1024
PAD_TO = 64  # the model's vocabulary is a multiple of this, past the tokenizer's ids


def write_random_checkpoint(directory: Path, texts: list[str], seed: int = 0) -> Path:
    """Write the checkpoint into `directory` (created); returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=IM_END,
                                        pad_token=ENDOFTEXT, model_max_length=4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = -(-len(tokenizer) // PAD_TO) * PAD_TO + PAD_TO  # padded past the tokenizer
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--texts", type=Path, default=None,
                        help="one text per line for the tokenizer (default: WordNet's nouns)")
    args = parser.parse_args()
    if args.texts:
        texts = args.texts.read_text().splitlines()
    else:
        from training.data.catalog import wordnet_catalog

        texts = wordnet_catalog().texts
    print(f"wrote {write_random_checkpoint(args.directory, texts)}")


if __name__ == "__main__":
    main()
