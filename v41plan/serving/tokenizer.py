"""Tokenizers: byte-level for the embedded models, ``tokenizer.json`` beside a checkpoint otherwise.

The byte-level tokenizer maps byte ``b`` to id ``b`` (ids 0..255) and takes ``bos``/``eos`` from
the model config (tiny: 256/257); ids it cannot decode (specials, ids above 255) decode to
nothing. ``load_tokenizer(dir, config)`` uses ``dir/tokenizer.json`` (the ``tokenizers``
library) when it exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    def __init__(self, bos_token_id: int, eos_token_id: int, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` (optionally led by bos)."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; non-byte ids are dropped and invalid UTF-8 is replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, path: str | Path, bos_token_id: int, eos_token_id: int):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` without template specials (optionally led by bos)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(checkpoint_dir: str | Path | None, config: Any) -> ByteTokenizer | HFTokenizer:
    """``tokenizer.json`` beside the checkpoint when present, else the byte-level default."""
    if checkpoint_dir is not None:
        p = Path(checkpoint_dir) / "tokenizer.json"
        if p.exists():
            return HFTokenizer(p, config.bos_token_id, config.eos_token_id)
    return ByteTokenizer(config.bos_token_id, config.eos_token_id, config.vocab_size)
