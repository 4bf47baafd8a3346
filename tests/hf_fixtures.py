"""Tiny Hugging Face models and tokenizers built here, never downloaded."""

from __future__ import annotations

import json
from pathlib import Path

SHAKESPEARE = Path(__file__).resolve().parents[1] / "axonn_launch/train/assets/tinyshakespeare.txt"
EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int = 512, *, chars: int = 100_000):
    """A byte-level BPE trained on the built-in corpus, with ``EOS`` as its id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([SHAKESPEARE.read_text()[:chars]], trainer)
    return tok


def tiny_llama_dir(directory: Path, *, seed: int = 0, tokenizer: bool = True, **config) -> Path:
    """A random 2-layer ``LlamaForCausalLM`` (hidden 64, 4 heads, 2 KV heads, vocab 512)
    saved with ``save_pretrained``, with a tokenizer of that vocabulary when asked."""
    import torch
    import transformers

    settings = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    settings.update(config)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    model.save_pretrained(directory)
    if tokenizer:
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=train_tokenizer(settings["vocab_size"]), eos_token=EOS,
            pad_token=EOS,
        )  # fmt: skip
        fast.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def sft_examples(n: int = 48) -> list[dict]:
    """Prompt/response pairs with a learnable rule (the response repeats a word)."""
    words = SHAKESPEARE.read_text().split()[:400]
    return [
        {"prompt": f"Say {words[i]} twice.", "response": f"{words[i]} {words[i]}"} for i in range(n)
    ]
