"""``v41plan explain SPEC [--kv-cache-dtype bf16|fp4] [--index-cache-dtype fp8|fp4] [--json]``.

Prints a spec's layers (segment, role, ratio, owners, candidates, Engram) and the byte geometry
of one format pair. ``--json`` prints one object whose names are a stable interface:

- ``layers``: ``[{index, segment, role, ratio, kv_owner, topk_owner, uses_candidates, engram}]``
- ``geometry``: ``{page_tokens, page_bytes, page_unit_bytes, state_bytes, image_bytes,
  units_per_image, global_kv_bytes_per_token, alignment_bytes, ring_rows, ring_row_bytes, planes:
  [{name, kind, owner, ratio, row_bytes,
  rows_per_page, bytes_per_page, offset}], state_fields: [{name, dtype, shape, offset,
  payload_bytes, bytes, in_checkpoint}]}`` (a state field's ``bytes`` is what it occupies,
  padded to the alignment; an image is the sum of the carried fields' ``bytes``)
- ``speculative``: null, or (a spec with a DSpark draft, BF16 main) the second layout's
  ``{speculative_tokens, draft_layers, ring_rows, state_bytes, image_bytes, units_per_image,
  state_fields, layout_id}``
- ``layout_id``, plus ``name``, ``spec_sha256``, ``kv_cache_dtype``, ``index_cache_dtype``,
  ``decoder_start``, ``replay`` and ``capture``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from v41plan.cli.args import Refused, spec_arg
from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, CacheSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``v41plan explain``."""
    p.add_argument(
        "spec", help="spec file (specs/deepseek_v41_flash.yaml) or compiled spec name (tiny)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="bf16",
        help="main pool format, one of %(choices)s",
    )
    p.add_argument(
        "--index-cache-dtype",
        choices=INDEX_CACHE_DTYPES,
        default="fp8",
        help="index plane format, one of %(choices)s",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (default: a readable table)"
    )


def explain_dict(cs: CacheSpec, kv_cache_dtype: str, index_cache_dtype: str) -> dict[str, Any]:
    """The ``--json`` object of a compiled spec for one format pair."""
    g = cs.geometry(kv_cache_dtype, index_cache_dtype)
    return {
        "name": cs.name,
        "spec_sha256": cs.spec_sha256,
        "kv_cache_dtype": kv_cache_dtype,
        "index_cache_dtype": index_cache_dtype,
        "decoder_start": cs.last_kv_source,
        "layers": [
            {
                "index": layer.index,
                "segment": layer.segment,
                "role": layer.role,
                "ratio": layer.ratio,
                "kv_owner": layer.kv_owner,
                "topk_owner": layer.topk_owner,
                "uses_candidates": layer.uses_candidates,
                "engram": layer.engram,
            }
            for layer in cs.layers
        ],
        "geometry": {
            "page_tokens": g.page_tokens,
            "alignment_bytes": g.alignment_bytes,
            "page_bytes": g.page_bytes,
            "page_unit_bytes": g.page_unit_bytes,
            "state_bytes": g.state_bytes,
            "image_bytes": g.image_bytes,
            "units_per_image": g.units_per_image,
            "global_kv_bytes_per_token": _number(g.global_kv_bytes_per_token),
            "ring_rows": g.ring_rows,
            "ring_row_bytes": g.ring_row_bytes,
            "planes": [
                {
                    "name": p.name,
                    "kind": p.kind,
                    "owner": p.owner,
                    "ratio": p.ratio,
                    "row_bytes": p.row_bytes,
                    "rows_per_page": p.rows_per_page,
                    "bytes_per_page": p.bytes_per_page,
                    "offset": p.offset,
                }
                for p in g.planes
            ],
            "state_fields": _fields(g),
        },
        "layout_id": g.layout_id,
        "speculative": _speculative(cs, kv_cache_dtype, index_cache_dtype),
        "replay": {
            "encoder_swa_bounded_replay": cs.replay.encoder_swa_bounded_replay,
            "decoder_swa_bounded_replay": cs.replay.decoder_swa_bounded_replay,
            "hash_block_tokens": cs.replay.hash_block_tokens,
            "replay_history_tokens": cs.replay.replay_history_tokens,
            "min_final_prefill_rows": cs.replay.min_final_prefill_rows,
        },
        "capture": {
            "batch_sizes": list(cs.capture.batch_sizes),
            "query_buckets": list(cs.capture.query_buckets),
        },
    }


def _fields(g) -> list[dict[str, Any]]:
    return [
        {
            "name": f.name,
            "dtype": f.dtype,
            "shape": list(f.shape),
            "offset": f.offset,
            "payload_bytes": f.nbytes,
            "bytes": f.field_bytes,
            "in_checkpoint": f.in_checkpoint,
        }
        for f in g.state_fields
    ]


def _speculative(cs: CacheSpec, kv: str, ix: str) -> dict[str, Any] | None:
    """The DSpark layout of the pair, or None (no draft, or a main format it refuses)."""
    g = cs.speculative_geometries.get((kv, ix))
    if g is None:
        return None
    return {
        "speculative_tokens": g.speculative_tokens,
        "draft_layers": g.draft_layers,
        "ring_rows": g.ring_rows,
        "state_bytes": g.state_bytes,
        "image_bytes": g.image_bytes,
        "units_per_image": g.units_per_image,
        "state_fields": _fields(g),
        "layout_id": g.layout_id,
    }


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _owner(x: int | None) -> str:
    return "-" if x is None else str(x)


def explain_text(d: dict[str, Any]) -> str:
    """The readable table of an ``explain_dict`` object."""
    g = d["geometry"]
    out = [
        (
            f"spec {d['name']}  main {d['kv_cache_dtype']}  index {d['index_cache_dtype']}  "
            f"decoder from layer {d['decoder_start']}"
        ),
        "",
        "layer  segment  role     ratio  kv_owner  topk_owner  candidates  engram",
    ]
    for layer in d["layers"]:
        out.append(
            f"{layer['index']:>5}  {layer['segment']:<7}  {layer['role']:<7}  {layer['ratio']:>5}"
            f"  {_owner(layer['kv_owner']):>8}  {_owner(layer['topk_owner']):>10}"
            f"  {'yes' if layer['uses_candidates'] else '-':>10}"
            f"  {'yes' if layer['engram'] else '-':>6}"
        )
    out += [
        "",
        (
            f"PAGE {g['page_tokens']} tokens: main region {g['page_bytes']:,} B, "
            f"PAGE unit {g['page_unit_bytes']:,} B, alignment {g['alignment_bytes']} B"
        ),
        "plane               owner  ratio  row_bytes  rows/page  bytes/page     offset",
    ]
    for p in g["planes"]:
        out.append(
            f"{p['name']:<18}  {p['owner']:>5}  {p['ratio']:>5}  {p['row_bytes']:>9}"
            f"  {p['rows_per_page']:>9}  {p['bytes_per_page']:>10,}  {p['offset']:>9,}"
        )
    out += [
        "",
        f"STATE {g['state_bytes']:,} B (ring {g['ring_rows']} rows x {g['ring_row_bytes']} B)",
        "field         dtype     shape              offset        bytes  in image",
    ]
    for f in g["state_fields"]:
        shape = "x".join(str(s) for s in f["shape"])
        out.append(
            f"{f['name']:<12}  {f['dtype']:<8}  {shape:<15}  {f['offset']:>9,}  {f['bytes']:>11,}"
            f"  {'yes' if f['in_checkpoint'] else 'no':>8}"
        )
    out += [
        "",
        f"checkpoint image {g['image_bytes']:,} B = {g['units_per_image']} PAGE units",
        f"global KV {g['global_kv_bytes_per_token']} B per token",
        f"layout {d['layout_id']}",
    ]
    sp = d.get("speculative")
    if sp is not None:
        ring = next(f for f in sp["state_fields"] if f["name"] == "swa_rings")
        out += [
            "",
            (
                f"DSpark layout ({sp['speculative_tokens']} speculative tokens, "
                f"{sp['draft_layers']} draft rings): STATE {sp['state_bytes']:,} B "
                f"(was {g['state_bytes']:,}), rings {'x'.join(map(str, ring['shape']))} "
                f"({ring['bytes']:,} B), image {sp['image_bytes']:,} B = "
                f"{sp['units_per_image']} PAGE units"
            ),
            f"layout {sp['layout_id']}",
        ]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Load the spec (a broken file is refused at its ``file:line:col``) and print its layers
    and bytes."""
    cs = spec_arg(args.spec)
    key = (args.kv_cache_dtype, args.index_cache_dtype)
    if key not in cs.geometries:
        declared = ", ".join(f"{kv}/{ix}" for kv, ix in cs.geometries)
        raise Refused(
            f"{cs.spec_path} does not compile the pair {key[0]}/{key[1]}; declared: {declared}"
        )
    d = explain_dict(cs, *key)
    print(json.dumps(d, indent=2) if args.json else explain_text(d))
    return 0
