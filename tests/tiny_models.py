"""The tiny random Llama the tests save as safetensors: one shape, each test's own overrides."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def save_tiny_llama(folder: Path, *, seed: int, vocab_size: int, **overrides: object) -> Path:
    """A random `LlamaForCausalLM` of TINY_LLAMA's shape (with `overrides`), seeded, in `folder`."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": vocab_size, **overrides})
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def copy_tokenizer(source: Path, folder: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """Copy `source`'s tokenizer files (those it has) into the model folder `folder`."""
    for name in names:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
