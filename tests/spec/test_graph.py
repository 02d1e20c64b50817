"""The layer/plane graph: agreement with ``derive.resolve_layers`` and its edges."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import networkx as nx
import pytest

from v41plan.geometry.derive import load_cache_spec_unchecked, resolve_layers
from v41plan.geometry.errors import SpecError
from v41plan.geometry.spec import compile_spec
from v41plan.geometry.topology import build_layer_graph, layers_from_graph, readers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def flash():
    """V4.1-Flash through the located front end (spec path ``specs/deepseek_v41_flash.yaml``)."""
    return compile_spec(ROOT / "specs" / "deepseek_v41_flash.yaml")


@pytest.mark.parametrize("name", ["deepseek_v41_flash", "tiny", "tiny40", "medium"])
def test_graph_agrees_with_derive(name):
    """Roles, owners, candidates, segments and Engram flags equal ``resolve_layers``."""
    cs = load_cache_spec_unchecked(str(ROOT / "specs" / f"{name}.yaml"))
    g = build_layer_graph(cs)
    assert layers_from_graph(g) == resolve_layers(cs.dims)
    assert nx.is_directed_acyclic_graph(g)


def test_flash_edges(flash):
    """Owner -> plane -> reader edges of V4.1-Flash."""
    g = build_layer_graph(flash)
    assert g.graph["decoder_start"] == 20 and g.graph["candidate_source"] == 20
    planes = sorted(n for n, d in g.nodes(data=True) if d["kind"] == "plane")
    assert planes == sorted(f"{k}.{o}" for k in ("main", "index") for o in (2, 8, 14, 20))
    assert readers(g, "main.2") == [3, 4, 5, 6, 7]
    assert readers(g, "main.20") == list(range(21, 40))
    assert readers(g, "index.20") == [24, 28, 32, 36]
    assert readers(g, "candidates.20") == [24, 28, 32, 36]
    assert readers(g, "topk.24") == [25, 26, 27]
    assert readers(g, "topk.20") == [21, 22, 23]
    assert list(g.predecessors("main.14")) == ["layer.14"]
    assert g.edges["layer.14", "main.14"]["op"] == "write"
    assert g.edges["main.14", "layer.15"]["op"] == "read"
    # Window layers read no global plane.
    assert g.in_degree("layer.0") == 0 and g.in_degree("layer.1") == 0


def test_segments_and_engram(flash):
    """Encoder 0-19, decoder 20-39; Engram on 1 and 14."""
    layers = layers_from_graph(build_layer_graph(flash))
    assert [x.index for x in layers if x.segment == "encoder"] == list(range(20))
    assert [x.index for x in layers if x.engram] == [1, 14]


def test_topk_owner_before_kv_owner(flash):
    """Top-k owner at or after the KV owner: reachable only past the front end's subset rule,
    so checked here on bare dims (KV source 20 not an index source)."""
    dims = dataclasses.replace(flash.dims, index_source_layer_ids=(2, 8, 14, 24, 28, 32, 36))
    with pytest.raises(SpecError) as info:
        build_layer_graph(dims)
    assert str(info.value) == (
        "<dims>:1:1: layer 20 would read top-k of index source 14, before its KV owner 20 "
        "(add 20 to index_source_layer_ids; the top-k owner must be at or after the KV owner)"
    )


def test_graph_from_cache_spec_uses_its_path(flash):
    """Errors on a graph built from a CacheSpec name the spec file."""
    bad = dataclasses.replace(flash, dims=dataclasses.replace(flash.dims, engram_layer_ids=(1, 21)))
    with pytest.raises(SpecError, match=r"^specs/deepseek_v41_flash.yaml:1:1: Engram layer 21"):
        build_layer_graph(bad)
    assert build_layer_graph(bad, decoder_replay=False).nodes["layer.21"]["engram"]
