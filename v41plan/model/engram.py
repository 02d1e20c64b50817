"""Engram host half: token map, prime layout, multipliers, hash ids and table reads.

Imports numpy, safetensors and torch (CPU tensors only); no Triton and no CUDA. Row ids depend
only on token ids: they are prepared from the final token ids of a forward plus the request's
restored history (the latest ``max_ngram - 1`` compressed ids, newest first, ``DEAD`` where
missing), with no separate committed history map.

Token map. The real map (``token_map_from_tokenizer``) normalizes every vocab entry with the
published chain (NFKC, NFD, strip accents, lowercase, collapse whitespace, protect a lone space,
strip) and numbers distinct strings in first-seen order. The embedded tiny/medium models use a
synthetic surjective map ``(a*t + 3) mod size`` with ``a`` the smallest odd number >= 7 that is
coprime with ``size`` (7 for tiny's 200; 9 for 99092, which 7 divides).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEAD = -1
"""Compressed id of a position that breaks n-grams (image tokens, or before the sequence)."""
_INT64_MAX = np.iinfo(np.int64).max


# --- token map ----------------------------------------------------------------------------


def synthetic_multiplier(size: int) -> int:
    """The ``a`` of the synthetic map: the smallest odd number >= 7 coprime with ``size``."""
    a = 7
    while math.gcd(a, size) != 1:
        a += 2
    return a


def synthetic_token_map(vocab_size: int, size: int) -> np.ndarray:
    """``token_map[t] = (a*t + 3) mod size``; surjective onto ``size`` ids when vocab >= size."""
    if vocab_size < size:
        raise ValueError(
            f"a synthetic token map cannot cover {size} compressed ids from vocab {vocab_size}"
        )
    t = np.arange(vocab_size, dtype=np.int64)
    return (synthetic_multiplier(size) * t + 3) % size


_SENTINEL = "\ue000"
# Unicode White_Space (what the published chain's strip removes); Python's str.strip would also
# remove U+001C..U+001F, which are not White_Space.
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000"
)


def normalize_token_text(text: str) -> str:
    """The published normalization chain for one decoded vocab entry: NFKC, NFD, strip accents
    (every mark, general category M*), lowercase (per character), collapse runs of
    space/tab/CR/LF to one space, protect a lone space, strip White_Space."""
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M"))
    s = "".join(c.lower() for c in s)  # per character: no final-sigma context rule
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        s = _SENTINEL
    s = s.strip(_WHITE_SPACE)
    return s.replace(_SENTINEL, " ")


def token_map_from_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> np.ndarray:
    """The real token map from a ``tokenizers.Tokenizer``: distinct keys numbered in first-seen
    order.

    A token's key is its normalized text; a token that normalizes to nothing keeps its decoded
    text, and one that decodes to U+FFFD (a partial byte) is keyed by its raw token string. Keys
    share one namespace, as in the published map: the DeepSeek-V4 ``tokenizer.json`` gives
    exactly the V4.1 config's 99,092 compressed ids this way.
    """
    n = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[t] for t in range(n)], skip_special_tokens=False)
    ids: dict[str, int] = {}
    out = np.zeros(n, dtype=np.int64)
    for t, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(t) or ""
        else:
            key = normalize_token_text(text) or text
        out[t] = ids.setdefault(key, len(ids))
    return out


# --- prime layout and multipliers ---------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    r = math.isqrt(n)
    f = 3
    while f <= r:
        if n % f == 0:
            return False
        f += 2
    return True


@lru_cache(maxsize=64)
def _primes(vocab: int, n_layers: int, max_ngram: int, n_heads: int) -> tuple[tuple[int, ...], ...]:
    used: set[int] = set()
    layers = []
    for _ in range(n_layers):
        cols = []
        for _order in range(2, max_ngram + 1):
            start = vocab - 1
            for _h in range(n_heads):
                p = start + 1
                while p in used or not _is_prime(p):
                    p += 1
                used.add(p)
                cols.append(p)
                start = p
        layers.append(tuple(cols))
    return tuple(layers)


def engram_primes(config: Any) -> np.ndarray:
    """Moduli ``[n_engram_layers, (max_ngram-1)*n_heads]``, order-major, head-minor, all
    distinct."""
    return np.array(
        _primes(
            config.engram_vocab_size,
            len(config.engram_layer_ids),
            config.engram_max_ngram_size,
            config.engram_n_heads,
        ),
        dtype=np.int64,
    ).reshape(len(config.engram_layer_ids), -1)


def engram_row_counts(config: Any) -> list[int]:
    """Rows of each Engram table: the sum of that layer's primes."""
    return [int(r.sum()) for r in engram_primes(config)]


def engram_offsets(config: Any) -> np.ndarray:
    """Exclusive cumulative sum of each layer's primes (the column's first table row)."""
    p = engram_primes(config)
    return np.cumsum(p, axis=1) - p


def engram_multipliers(config: Any) -> np.ndarray:
    """Odd hash multipliers ``[n_engram_layers, max_ngram]`` from ``default_rng(10007 *
    layer_id)``."""
    bound = max(1, (_INT64_MAX // config.engram_compressed_vocab_size) // 2)
    out = []
    for layer_id in config.engram_layer_ids:
        r = np.random.default_rng(10007 * layer_id).integers(
            0, bound, size=config.engram_max_ngram_size, dtype=np.int64
        )
        out.append(2 * r + 1)
    return np.stack(out).astype(np.int64)


@dataclass(frozen=True)
class EngramLayout:
    """Everything hashing needs: moduli, offsets, multipliers and the compressed pad id."""

    layer_ids: tuple[int, ...]
    primes: np.ndarray
    offsets: np.ndarray
    multipliers: np.ndarray
    pad_id: int
    max_ngram: int
    n_heads: int

    @classmethod
    def from_config(cls, config: Any, token_map: np.ndarray) -> EngramLayout:
        """Build the layout; the pad id is ``token_map[engram_pad_token_id]``."""
        return cls(
            tuple(config.engram_layer_ids),
            engram_primes(config),
            engram_offsets(config),
            engram_multipliers(config),
            int(token_map[config.engram_pad_token_id]),
            config.engram_max_ngram_size,
            config.engram_n_heads,
        )

    @property
    def history_len(self) -> int:
        """Compressed ids a request must remember: ``max_ngram - 1``."""
        return self.max_ngram - 1


def empty_history(layout: EngramLayout) -> np.ndarray:
    """The history of a fresh request: all DEAD."""
    return np.full(layout.history_len, DEAD, dtype=np.int64)


def hash_ids(
    layout: EngramLayout, cids: Sequence[int] | np.ndarray, history: np.ndarray | None = None
) -> np.ndarray:
    """Table row ids ``[S, n_engram_layers, cols]`` for compressed ids ``cids`` (DEAD = -1).

    ``history`` holds the ``max_ngram - 1`` compressed ids before ``cids[0]``, newest first
    (DEAD where missing); None means the sequence starts at ``cids[0]``.
    """
    c = np.asarray(cids, dtype=np.int64)
    hist = empty_history(layout) if history is None else np.asarray(history, dtype=np.int64)
    h = layout.history_len
    ext = np.concatenate([hist[::-1], c])
    return _hash_rows(layout, ext, np.arange(c.shape[0]) + h)


def _hash_rows(layout: EngramLayout, ext: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Row ids ``[len(at), n_layers, cols]`` of the ids at ``ext[at]``, each with its
    predecessors just before it in ``ext``."""
    blocked = np.zeros(at.shape[0], dtype=bool)
    terms = []
    for k in range(layout.max_ngram):
        src = ext[at - k]
        blocked = blocked | (src == DEAD)
        terms.append(np.where(blocked, layout.pad_id, src))
    n_layers = len(layout.layer_ids)
    out = np.zeros((at.shape[0], n_layers, layout.primes.shape[1]), dtype=np.int64)
    for li in range(n_layers):
        prods = [t * layout.multipliers[li, k] for k, t in enumerate(terms)]
        roll = prods[0]
        for n in range(2, layout.max_ngram + 1):
            roll = roll ^ prods[n - 1]
            cols = slice((n - 2) * layout.n_heads, (n - 1) * layout.n_heads)
            out[:, li, cols] = roll[:, None] % layout.primes[li, cols] + layout.offsets[li, cols]
    return out


def hash_ids_batch(
    layout: EngramLayout, cids: np.ndarray, cu_seqlens: np.ndarray, histories: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``hash_ids`` and ``advance_history`` of a whole ragged batch at once.

    ``cids [T]`` are the compressed ids of every request's rows end to end (request ``i`` holds
    ``cids[cu[i]:cu[i+1]]``), ``histories [n, max_ngram - 1]`` each request's history newest
    first. Returns the row ids ``[T, n_engram_layers, cols]`` and the advanced histories
    ``[n, max_ngram - 1]``; equal to calling ``hash_ids`` / ``advance_history`` per request.
    """
    ext, at, cu, hist = _extended(layout, cids, cu_seqlens, histories)
    return _hash_rows(layout, ext, at), _advanced(ext, cu, hist, layout.history_len)


def _extended(layout: EngramLayout, cids, cu_seqlens, histories):
    """Each request's history (oldest first) then its rows, end to end: ``(ext, at, cu, hist)``
    with row ``j`` of request ``i`` at ``ext[at[j]]``, ``at[j] = j + (i + 1) * h``, and its k-th
    predecessor k places before."""
    c = np.asarray(cids, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    hist = np.asarray(histories, dtype=np.int64)
    n, h = hist.shape[0], layout.history_len
    total = int(cu[n]) if n else 0
    lens = cu[1 : n + 1] - cu[:n]
    req = np.repeat(np.arange(n), lens)
    ext = np.empty(total + n * h, dtype=np.int64)
    at = np.arange(total) + (req + 1) * h
    ext[at] = c[:total]
    hist_at = (cu[:n] + np.arange(n) * h)[:, None] + np.arange(h)[None, :]
    ext[hist_at] = hist[:, ::-1]
    return ext, at, cu, hist


def _advanced(ext: np.ndarray, cu: np.ndarray, hist: np.ndarray, h: int) -> np.ndarray:
    n = hist.shape[0]
    end = cu[1 : n + 1] + (np.arange(n) + 1) * h
    return ext[end[:, None] - 1 - np.arange(h)[None, :]] if n else hist.copy()


def advance_histories(
    layout: EngramLayout, cids: np.ndarray, cu_seqlens: np.ndarray, histories: np.ndarray
) -> np.ndarray:
    """The advanced histories of ``hash_ids_batch`` alone (no row ids): ``[n, max_ngram - 1]``."""
    hist = np.asarray(histories, dtype=np.int64)
    n, h = hist.shape[0], layout.history_len
    cu = np.asarray(cu_seqlens, dtype=np.int64)[: n + 1]
    if n and h and int(cu[n]) == n and int(cu[0]) == 0 and bool((cu[1:] > cu[:-1]).all()):
        # one row per request (a decode step): the new id in front, the oldest one dropped
        out = np.empty_like(hist)
        out[:, 0] = np.asarray(cids, dtype=np.int64)[:n]
        out[:, 1:] = hist[:, : h - 1]
        return out
    ext, _at, cu, hist = _extended(layout, cids, cu_seqlens, histories)
    return _advanced(ext, cu, hist, layout.history_len)


def advance_history(
    layout: EngramLayout, history: np.ndarray, cids: Sequence[int] | np.ndarray
) -> np.ndarray:
    """History after accepting ``cids`` (in position order): the latest ids, newest first."""
    ext = np.concatenate(
        [np.asarray(history, dtype=np.int64)[::-1], np.asarray(cids, dtype=np.int64)]
    )
    return ext[-layout.history_len :][::-1].copy()


# --- tables -------------------------------------------------------------------------------


class EngramTable:
    """One Engram table (FP8 E4M3 rows + E8M0 per-32 scales), read row by row.

    Backed by a safetensors file memory-mapped as raw bytes (only the requested rows are
    touched; one gather per read, never a copy of the table), or by in-memory tensors.
    """

    def __init__(self, codes: Any, scales: Any, rows: int, width: int):
        self._codes = codes
        self._scales = scales
        self.rows = rows
        self.width = width

    @classmethod
    def from_tensors(cls, codes: torch.Tensor, scales: torch.Tensor) -> EngramTable:
        """A table held in memory (tests, freshly initialized models)."""
        return cls(codes, scales, codes.shape[0], codes.shape[1])

    @classmethod
    def open(cls, path: str | Path, prefix: str, handle: Any | None = None) -> EngramTable:
        """Map ``{prefix}.embed.weight`` / ``.embed.scale`` of a safetensors file (no copy).

        The file is mapped once as bytes and each tensor viewed at its header offsets; both are
        one byte per element (E4M3 codes, E8M0 scales). ``handle`` (an open ``safe_open``) is
        accepted for callers that hold one; the mapping does not need it.
        """
        path = Path(path)
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + header_len

        def view(name: str) -> np.ndarray:
            meta = header[name]
            lo, hi = meta["data_offsets"]
            return mm[base + lo : base + hi].reshape(meta["shape"][0], -1)

        codes = view(f"{prefix}.embed.weight")
        scales = view(f"{prefix}.embed.scale")
        return cls(codes, scales, codes.shape[0], codes.shape[1])

    def read(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(``float8_e4m3fn`` ``[*rows.shape, width]``, ``float8_e8m0fnu`` ``[*rows.shape,
        width/32]``)."""
        flat = np.asarray(rows, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"Engram row id out of range [0, {self.rows})")
        shape = tuple(np.asarray(rows).shape)
        if isinstance(self._codes, torch.Tensor):
            idx = torch.from_numpy(flat)
            codes, scales = self._codes[idx], self._scales[idx]
        else:  # memory-mapped bytes: one gather touches only the requested rows
            codes = torch.from_numpy(np.ascontiguousarray(self._codes[flat])).view(
                torch.float8_e4m3fn
            )
            scales = torch.from_numpy(np.ascontiguousarray(self._scales[flat])).view(
                torch.float8_e8m0fnu
            )
        return codes.reshape(*shape, self.width), scales.reshape(*shape, self.width // 32)


class EngramHost:
    """Host-side Engram row preparation for one model: token map, layout and tables."""

    def __init__(
        self, config: Any, token_map: np.ndarray, tables: Sequence[EngramTable] | None = None
    ):
        if int(token_map.max()) + 1 != config.engram_compressed_vocab_size:
            raise ValueError(
                f"token map has {int(token_map.max()) + 1} compressed ids but "
                f"engram_compressed_vocab_size "
                f"is {config.engram_compressed_vocab_size}"
            )
        self.config = config
        self.token_map = np.asarray(token_map, dtype=np.int64)
        self.layout = EngramLayout.from_config(config, self.token_map)
        self.tables = list(tables) if tables is not None else []

    def compress(
        self, token_ids: Sequence[int] | np.ndarray, text_mask: np.ndarray | None = None
    ) -> np.ndarray:
        """Compressed ids of final token ids; non-text positions (``text_mask`` False) are DEAD."""
        c = self.token_map[np.asarray(token_ids, dtype=np.int64)]
        if text_mask is not None:
            c = np.where(np.asarray(text_mask, dtype=bool), c, DEAD)
        return c

    def prepare(
        self,
        token_ids: Sequence[int] | np.ndarray,
        history: np.ndarray | None = None,
        text_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Row ids ``[S, n_layers, cols]`` for a forward's final token ids, and the advanced
        history."""
        hist = (
            empty_history(self.layout) if history is None else np.asarray(history, dtype=np.int64)
        )
        c = self.compress(token_ids, text_mask)
        return hash_ids(self.layout, c, hist), advance_history(self.layout, hist, c)

    def prepare_batch(
        self, token_ids: np.ndarray, cu_seqlens: np.ndarray, histories: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``prepare`` of a whole ragged batch (request ``i`` holds ``token_ids[cu[i]:cu[i+1]]``
        with history ``histories[i]``): row ids ``[T, n_layers, cols]``, advanced histories."""
        c = self.token_map[np.asarray(token_ids, dtype=np.int64)]
        return hash_ids_batch(self.layout, c, cu_seqlens, histories)

    def advance_batch(
        self, token_ids: np.ndarray, cu_seqlens: np.ndarray, histories: np.ndarray
    ) -> np.ndarray:
        """The advanced histories of ``prepare_batch`` without its row ids."""
        c = self.token_map[np.asarray(token_ids, dtype=np.int64)]
        return advance_histories(self.layout, c, cu_seqlens, histories)

    def gather(self, layer_index: int, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the rows of Engram layer ``layer_index`` (position in ``engram_layer_ids``)."""
        return self.tables[layer_index].read(rows)
