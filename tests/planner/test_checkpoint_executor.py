"""The span tables address the same bytes as the executor's pools (``Pools.image_addresses``).

The planner never imports torch; this test does, to cross-check the two views of an image.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.planner.helpers import spec
from v41plan.planner.checkpoint import CopyPlanner, ImageOp

torch = pytest.importorskip("torch")
pools_mod = pytest.importorskip("v41plan.runtime.pools")


@pytest.mark.parametrize("pair", [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")])
def test_store_spans_match_pool_image_addresses(pair):
    g = spec("tiny").geometry(*pair)
    pools = pools_mod.Pools(g, num_pages=8, num_slots=4)
    units = (5, 2)[: g.units_per_image]
    state_addr, unit_addr = pools.image_addresses(3, torch.tensor(units))
    spans = CopyPlanner(g, 8, 4).store(ImageOp(3, units, g.layout_id, g.image_bytes))
    base = pools.region_bases()
    names = CopyPlanner(g, 8, 4).regions
    src, dst = [], []
    for sr, so, dr, do, n in zip(
        spans.src_region,
        spans.src_offset,
        spans.dst_region,
        spans.dst_offset,
        spans.nbytes,
        strict=True,
    ):
        src.append(base[names[sr]] + so + np.arange(n))
        dst.append(base[names[dr]] + do + np.arange(n))
    # Same bytes, in the same image order.
    assert (np.concatenate(src) == state_addr.numpy()).all()
    assert (np.concatenate(dst) == unit_addr.numpy()).all()
