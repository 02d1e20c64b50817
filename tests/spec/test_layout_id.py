"""The layout id changes whenever a byte meaning changes, and only then."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from v41plan.geometry.derive import derive_geometry, load_cache_spec_unchecked

ROOT = Path(__file__).resolve().parents[2]


def test_layout_id_tracks_every_byte_meaning():
    """Formats, PAGE, layers, dims, window, history and image fields each change the id."""
    dims = load_cache_spec_unchecked(str(ROOT / "specs" / "tiny40.yaml")).dims

    def lid(d=dims, page=32, kv="bf16", ix="fp8", image=("swa_rings", "cursor")):
        return derive_geometry(d, page, kv, ix, image).layout_id

    variants = [
        lid(),
        lid(kv="fp4"),
        lid(ix="fp4"),
        lid(page=64),
        lid(d=dataclasses.replace(dims, head_dim=96)),
        lid(d=dataclasses.replace(dims, qk_rope_head_dim=8)),
        lid(d=dataclasses.replace(dims, index_head_dim=64)),
        lid(d=dataclasses.replace(dims, sliding_window=16)),
        lid(d=dataclasses.replace(dims, engram_max_ngram_size=3)),
        lid(d=dataclasses.replace(dims, kv_source_layer_ids=(2, 8, 20))),
        lid(image=("swa_rings", "tail_values", "tail_scores", "cursor")),
    ]
    assert len(set(variants)) == len(variants)
    # Order of the declared image fields is not a byte meaning.
    assert lid(image=("cursor", "swa_rings")) == lid()
    # Widths the cache does not store are not either.
    assert lid(d=dataclasses.replace(dims, index_topk=8, num_attention_heads=8)) == lid()
