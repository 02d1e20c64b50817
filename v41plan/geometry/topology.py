"""The layer/plane topology graph of a spec and the cross-entity checks run on it.

``build_layer_graph`` resolves every backbone layer's role by walking the layers in order and
records the result as a networkx ``DiGraph``:

- ``layer.<i>`` (kind ``layer``): one per backbone layer, carrying every ``LayerInfo`` field;
- ``main.<o>`` / ``index.<o>`` (kind ``plane``): each Full owner's global main-KV rows and its
  index keys (one logical index plane; the fp4 format stores it as two byte planes);
- ``topk.<t>`` (kind ``selection``): the top-k selection an index source produces each forward;
- ``candidates.<c>`` (kind ``candidates``): the blocks the candidate source keeps.

Edges run from writer to reader: ``layer.o -> main.o -> layer.i`` for every layer reading
owner ``o``'s KV, ``layer.o -> index.o -> layer.r`` for Reindex layers scoring ``o``'s keys,
``layer.t -> topk.t -> layer.i`` for Reuse layers inheriting ``t``'s selection, and
``layer.c -> candidates.c -> layer.r`` for Reindex layers rescoring inside the candidates. A
layer reading its own planes draws no edge (that happens inside the layer), so the graph is a
DAG in layer order; the planner's liveness and stage tables are built on top of it.

Every rule the walk refuses raises a located ``SpecError``; without a ``Locator`` (a graph
built from a ``CacheSpec``) the location is the spec file's first line. The roles agree with
``v41plan.geometry.derive.resolve_layers`` (tested).
"""

from __future__ import annotations

import networkx as nx

from v41plan.geometry.errors import Locator
from v41plan.geometry.runtime import CacheSpec, LayerInfo, ModelDims

M = ("model",)


def build_layer_graph(
    source: CacheSpec | ModelDims,
    *,
    locator: Locator | None = None,
    decoder_replay: bool | None = None,
) -> nx.DiGraph:
    """Resolve roles and build the layer/plane graph of a spec's backbone.

    ``source`` is a compiled ``CacheSpec`` or bare ``ModelDims``; ``decoder_replay`` (taken
    from the ``CacheSpec`` when not given, else True) turns on the Engram placement rule.
    Graph attributes: ``decoder_start`` (the last KV source), ``candidate_source`` (-1 when
    none), ``num_hidden_layers``.
    """
    if isinstance(source, CacheSpec):
        dims = source.dims
        loc = locator or Locator(source.spec_path)
        if decoder_replay is None:
            decoder_replay = source.replay.decoder_swa_bounded_replay
    else:
        dims = source
        loc = locator or Locator("<dims>")
    if decoder_replay is None:
        decoder_replay = True

    n = dims.num_hidden_layers
    ratios = dims.compress_ratios
    kv_sources = dims.kv_source_layer_ids
    index_sources = set(dims.index_source_layer_ids)
    engram = set(dims.engram_layer_ids)
    decoder_start = max(kv_sources)
    cand = dims.candidate_source_layer_id

    g = nx.DiGraph(decoder_start=decoder_start, candidate_source=cand, num_hidden_layers=n)
    kv_owner: int | None = None
    topk_owner: int | None = None
    cand_owner: int | None = None
    for i in range(n):
        r = ratios[i]
        segment = "decoder" if i >= decoder_start else "encoder"
        if r == 0:
            _add_layer(g, LayerInfo(i, segment, "window", 0, None, None, False, i in engram))
            continue
        if i in kv_sources:
            kv_owner = i
        if kv_owner is None:
            raise loc.error(
                (*M, "compress_ratios", i),
                f"layer {i} has ratio {r} but no preceding KV owner",
                f"make layer {i} or an earlier ratio-{r} layer a KV source",
            )
        if ratios[kv_owner] != r:
            raise loc.error(
                (*M, "compress_ratios", i),
                f"layer {i} has ratio {r} but its preceding KV owner {kv_owner} has ratio "
                f"{ratios[kv_owner]}",
                f"make layer {i} or an earlier ratio-{r} layer after {kv_owner} a KV source",
            )
        if i in index_sources:
            topk_owner = i
        if topk_owner is None or topk_owner < kv_owner:
            before = "no index source" if topk_owner is None else f"index source {topk_owner}"
            raise loc.error(
                (*M, "index_source_layer_ids"),
                f"layer {i} would read top-k of {before}, before its KV owner {kv_owner}",
                f"add {kv_owner} to index_source_layer_ids; the top-k owner must be at or "
                "after the KV owner",
            )
        if i == cand:
            cand_owner = kv_owner
        if cand_owner is not None and kv_owner != cand_owner:
            raise loc.error(
                (*M, "kv_source_layer_ids", kv_sources.index(kv_owner)),
                f"layer {i} is at or after candidate source {cand} but reads KV owner "
                f"{kv_owner}, not {cand_owner}",
                f"candidates index owner {cand_owner}'s rows; move the candidate source to "
                f"{kv_owner} or later, or drop KV source {kv_owner}",
            )
        role = "full" if i == kv_owner else "reindex" if i == topk_owner else "reuse"
        # A selection uses the candidates when scored inside them, or inherited from one that was.
        selected_by = i if role == "reindex" else topk_owner
        uses_candidates = cand >= 0 and selected_by > cand
        _add_layer(
            g,
            LayerInfo(i, segment, role, r, kv_owner, topk_owner, uses_candidates, i in engram),
        )
        _add_reads(g, i, role, r, kv_owner, topk_owner, cand if uses_candidates else None)

    if decoder_replay:
        for j, e in enumerate(dims.engram_layer_ids):
            if e >= decoder_start:
                raise loc.error(
                    (*M, "engram_layer_ids", j),
                    f"Engram layer {e} is in the decoder, which starts at layer {decoder_start}",
                    f"decoder replay runs the decoder on the tail only; move it before layer "
                    f"{decoder_start} or turn decoder_swa_bounded_replay off",
                )
    return g


def _add_layer(g: nx.DiGraph, info: LayerInfo) -> None:
    g.add_node(f"layer.{info.index}", kind="layer", **info.__dict__)


def _add_plane(g: nx.DiGraph, name: str, kind: str, owner: int, ratio: int) -> str:
    if name not in g:
        g.add_node(name, kind=kind, owner=owner, ratio=ratio)
        g.add_edge(f"layer.{owner}", name, op="write")
    return name


def _add_reads(
    g: nx.DiGraph, i: int, role: str, r: int, kv: int, topk: int, cand: int | None
) -> None:
    """Planes a layer writes (as an owner) and reads (from earlier layers)."""
    layer = f"layer.{i}"
    main = _add_plane(g, f"main.{kv}", "plane", kv, r)
    index = _add_plane(g, f"index.{kv}", "plane", kv, r)
    if role in ("full", "reindex"):
        _add_plane(g, f"topk.{i}", "selection", i, r)
    if i != kv:
        g.add_edge(main, layer, op="read")
    if role == "reindex":
        g.add_edge(index, layer, op="read")
        if cand is not None:
            g.add_edge(_add_plane(g, f"candidates.{cand}", "candidates", cand, r), layer, op="read")
    if role == "reuse":
        g.add_edge(f"topk.{topk}", layer, op="read")


def layers_from_graph(g: nx.DiGraph) -> tuple[LayerInfo, ...]:
    """The ``LayerInfo`` of every backbone layer, in layer order."""
    fields = LayerInfo.__dataclass_fields__
    return tuple(
        LayerInfo(**{k: g.nodes[f"layer.{i}"][k] for k in fields})
        for i in range(g.graph["num_hidden_layers"])
    )


def readers(g: nx.DiGraph, plane: str) -> list[int]:
    """Layers that read ``plane`` (``main.20``, ``topk.24`` ...) from another layer, sorted."""
    return sorted(g.nodes[v]["index"] for v in g.successors(plane))
