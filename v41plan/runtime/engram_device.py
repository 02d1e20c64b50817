"""The Engram lookup on the device: row ids hashed from the step's token ids and each request's
history, table rows gathered from device-resident tables.

The same arithmetic as the host half (``v41plan.model.engram.hash_ids_batch``, kept as the
reference): compressed ids through the token map, the n-gram terms (a term and every longer one
blocked to the pad id behind a DEAD id), per layer the rolling XOR of ``term * multiplier``, modulo
each head's prime, plus its offset. int64 products wrap and ``%`` takes the divisor's sign on
both sides, so the ids are equal bit for bit. Pure tensor work on inputs ``prepare`` staged: no
host step between a step's token ids and its table rows, and capturable in a graph.
"""

from __future__ import annotations

import numpy as np
import torch

from v41plan.model.engram import DEAD, EngramHost

DEVICE_TABLE_BYTES = 2 << 30
"""Tables up to this size in all are copied to the device (larger ones stay on the host and the
host half gathers their rows)."""


def table_bytes(engram: EngramHost) -> int:
    """Bytes of every Engram table (codes and scales)."""
    return sum(t.rows * (t.width + t.width // 32) for t in engram.tables)


class DeviceEngram:
    """An ``EngramHost``'s layout and tables on ``device``."""

    def __init__(self, engram: EngramHost, device: torch.device | str):
        lay = engram.layout
        self.device = torch.device(device)
        self.history_len = lay.history_len
        self.max_ngram = lay.max_ngram
        self.n_heads = lay.n_heads
        self.pad_id = int(lay.pad_id)

        def dev(a) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a)).to(self.device)

        self.token_map = dev(engram.token_map.astype(np.int64))
        self.multipliers = dev(lay.multipliers.astype(np.int64))  # [L, max_ngram]
        self.primes = dev(lay.primes.astype(np.int64))  # [L, cols]
        self.offsets = dev(lay.offsets.astype(np.int64))  # [L, cols]
        self.codes: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        for tab in engram.tables:
            rows = np.arange(tab.rows)
            codes, scales = tab.read(rows)  # one read of the whole table, once
            self.codes.append(codes.view(torch.uint8).to(self.device))
            self.scales.append(scales.view(torch.uint8).to(self.device))

    def row_ids(
        self,
        token_ids: torch.Tensor,
        batch_ids: torch.Tensor,
        row0: torch.Tensor,
        history: torch.Tensor,
    ) -> torch.Tensor:
        """Table row ids ``[t, n_layers, cols]`` of every row.

        ``token_ids [t]``, ``batch_ids [t]`` (-1: a padding row, which gets row 0), ``row0 [b]``
        each request's first row, ``history [b, max_ngram - 1]`` each request's compressed ids
        before its first row, newest first (DEAD where missing)."""
        t = token_ids.shape[0]
        h = self.history_len
        real = batch_ids >= 0
        b = batch_ids.clamp(min=0)
        cids = self.token_map[token_ids.clamp(min=0)]
        rows = torch.arange(t, device=token_ids.device)
        offset = rows - row0[b]  # the row within its request
        blocked = torch.zeros(t, dtype=torch.bool, device=token_ids.device)
        terms = []
        for k in range(self.max_ngram):
            if k == 0:
                src = cids
            else:
                own = cids[(rows - k).clamp(min=0)]
                back = history[b, (k - 1 - offset).clamp(min=0, max=h - 1)]
                src = torch.where(offset >= k, own, back)
            blocked = blocked | (src == DEAD)
            terms.append(torch.where(blocked, self.pad_id, src))
        n_layers, cols = self.primes.shape
        out = torch.empty(t, n_layers, cols, dtype=torch.int64, device=token_ids.device)
        for li in range(n_layers):
            roll = terms[0] * self.multipliers[li, 0]
            for m in range(2, self.max_ngram + 1):
                roll = roll ^ (terms[m - 1] * self.multipliers[li, m - 1])
                c = slice((m - 2) * self.n_heads, (m - 1) * self.n_heads)
                out[:, li, c] = roll[:, None] % self.primes[li, c] + self.offsets[li, c]
        return torch.where(real[:, None, None], out, 0)

    def gather(self, layer_index: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """E4M3 and E8M0 bytes (``uint8``) of the rows ``ids [..., cols]`` of Engram layer
        ``layer_index``: ``[..., cols, width]`` and ``[..., cols, width / 32]``."""
        return self.codes[layer_index][ids], self.scales[layer_index][ids]
