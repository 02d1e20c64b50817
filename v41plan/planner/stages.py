"""Stage tables: which rows run which sub-step of which layer, per phase.

The table is derived, not written down: the readers of every piece of data and the replay
rules are declared below, and a backward liveness pass over a networkx graph of
(layer, sub-step) nodes gives, for each phase and layer, the row set each sub-step must run on.

Row sets are nested, per request: ``all`` (every row of the forward) contains ``tail`` (the
last W rows, positions ``[max(forward_start, forward_end - W), forward_end)``) contains ``last``
(the last row) contains ``none``.

Declared readers (the liveness sinks and edges):

- The model output (the LM head) reads each finishing request's last row; with decoder replay
  off every prefill row's output is defined (one backbone, hidden-state export); decode reads
  every row (verification samples each).
- Later forwards read every Full owner's compressed KV and index keys at every position.
- Decode reads each layer's last W ring rows; a prefill forward reads a layer's ring rows from
  earlier forwards unless that layer's window is floored inside the forward.
- A layer's attention at rows X reads: its input (the previous layer's output) at X; its own
  window KV over the windows of X (``tail`` when floored at the tail start, else ``all`` unless
  X is the last row alone); the compressed KV/index keys of its KV owner; the selection of its
  top-k owner and of the candidate source (same rows). Its FFN reads its attention at the same
  rows; the ring write (window KV) and an owner's compression read the previous layer's output.

Replay rules: under decoder replay every decoder layer's window starts at the tail
(``swa_replay_start``) in a prefill forward; under encoder replay an encoder-replay rebuild's
windows start at the forward's first row (every layer not floored at the tail). Decode never
floors.

This module imports networkx only inside ``derive_stage_table``: the generated
``stages.py`` builds a ``StageTable`` from literals and loads on the GPU image unchanged.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

ROW_SETS: tuple[str, ...] = ("none", "last", "tail", "all")
"""Row sets, ordered by inclusion."""
PHASES: tuple[str, ...] = ("prefill_nonfinal", "prefill_final", "decode")
"""Phases of a request in a forward."""
SUB_STEPS: tuple[str, ...] = ("ring_write", "compress", "attention", "ffn")
"""Sub-steps of a layer: window KV + ring write; compressed KV + index keys (Full owners only);
query, index selection and attention; FFN."""
FLOORS: tuple[str, ...] = ("none", "tail", "forward_start")
"""Window floors: none; the tail start (decoder replay); the forward start (encoder replay
rebuild requests only)."""

_RANK = {name: i for i, name in enumerate(ROW_SETS)}
# Phases that may follow a forward of each phase in the same slot.
_SUCCESSORS = {
    "prefill_nonfinal": ("prefill_nonfinal", "prefill_final"),
    "prefill_final": ("decode",),
    "decode": ("decode",),
}


def _max(*sets: str) -> str:
    return max(sets, key=_RANK.__getitem__) if sets else "none"


@dataclass(frozen=True)
class GraphStage:
    """A run of consecutive layers the executor compiles or runs as one unit."""

    name: str
    """``backbone`` (one graph), ``early``/``late`` (multi-layer graphs) or ``layer<N>``."""
    first_layer: int
    """First layer (inclusive)."""
    last_layer: int
    """Last layer (inclusive)."""


@dataclass(frozen=True)
class StageTable:
    """The derived stage table of a spec under a pair of replay switches."""

    spec_name: str
    """Spec the table was derived from."""
    spec_sha256: str
    """sha256 of the spec file (a generated table is used only for the spec it came from)."""
    num_layers: int
    """Backbone layers."""
    decoder_replay: bool
    """Decoder SWA bounded replay on."""
    encoder_replay: bool
    """Encoder SWA bounded replay on."""
    last_kv_source: int
    """First decoder layer (the last KV source)."""
    owners: tuple[int, ...]
    """Full owners (layers with a compress sub-step)."""
    rows: tuple[tuple[tuple[str, ...], ...], ...]
    """``rows[phase][layer][sub_step]``: a ``ROW_SETS`` name (indices as
    ``PHASES``/``SUB_STEPS``)."""
    floors: tuple[tuple[str, ...], ...]
    """``floors[phase][layer]``: the layer's window floor (a ``FLOORS`` name)."""
    stage_bounds: tuple[tuple[str, int, int], ...]
    """Graph stages in layer order as ``(name, first_layer, last_layer)``."""

    @property
    def stages(self) -> tuple[GraphStage, ...]:
        """Graph stages in layer order."""
        return tuple(GraphStage(*b) for b in self.stage_bounds)

    def row_set(self, phase: str, layer: int, sub_step: str) -> str:
        """Row set of ``sub_step`` of ``layer`` in ``phase``."""
        return self.rows[PHASES.index(phase)][layer][SUB_STEPS.index(sub_step)]

    def floor(self, phase: str, layer: int) -> str:
        """Window floor of ``layer`` in ``phase``."""
        return self.floors[PHASES.index(phase)][layer]

    def ranges(self, phase: str, include_none: bool = False) -> list[dict]:
        """Compact view: runs of consecutive layers with one row set per sub-step.

        Each entry is ``{"layers": [first, last], "sub_step": name, "rows": set}``, ordered by
        layer then sub-step; ``none`` runs are left out unless ``include_none`` (``compress``
        of non-owners always is).
        """
        p = PHASES.index(phase)
        out: list[dict] = []
        for s, sub in enumerate(SUB_STEPS):
            layer = 0
            while layer < self.num_layers:
                rs = self.rows[p][layer][s]
                end = layer
                while (
                    end + 1 < self.num_layers
                    and self.rows[p][end + 1][s] == rs
                    and (sub != "compress" or (end + 1 in self.owners) == (layer in self.owners))
                ):
                    end += 1
                if rs != "none" or (include_none and sub != "compress"):
                    if sub == "compress":
                        for o in (x for x in self.owners if layer <= x <= end):
                            out.append({"layers": [o, o], "sub_step": sub, "rows": rs})
                    else:
                        out.append({"layers": [layer, end], "sub_step": sub, "rows": rs})
                layer = end + 1
        out.sort(key=lambda e: (e["layers"][0], SUB_STEPS.index(e["sub_step"])))
        return out


def _window(rows: str, floored_at_tail: bool) -> str:
    """Rows of this forward the windows of ``rows`` cover."""
    if rows == "none":
        return "none"
    if rows == "last" or (rows == "tail" and floored_at_tail):
        return "tail"
    return "all"


def layer_graph(layers, candidate_source: int = -1) -> nx.DiGraph:
    """The networkx DiGraph of (layer, sub_step) nodes; edges point from producer to reader.

    Edge attribute ``read`` says how the reader's rows map to the producer's: ``same`` (the same
    rows), ``window`` (the windows of the reader's rows) or ``global`` (every position).
    """
    import networkx as nx

    g = nx.DiGraph()
    owners = {layer.index for layer in layers if layer.role == "full"}
    for layer in layers:
        i = layer.index
        for sub in SUB_STEPS:
            if sub != "compress" or i in owners:
                g.add_node((i, sub))
        if i > 0:
            for sub in ("ring_write", "attention") + (("compress",) if i in owners else ()):
                g.add_edge((i - 1, "ffn"), (i, sub), read="same")
        g.add_edge((i, "ring_write"), (i, "attention"), read="window")
        g.add_edge((i, "attention"), (i, "ffn"), read="same")
        if layer.kv_owner is not None:
            g.add_edge((layer.kv_owner, "compress"), (i, "attention"), read="global")
        if layer.topk_owner is not None and layer.topk_owner != i:
            g.add_edge((layer.topk_owner, "attention"), (i, "attention"), read="same")
    for layer in layers:
        if layer.uses_candidates and 0 <= candidate_source != layer.index:
            g.add_edge((candidate_source, "attention"), (layer.index, "attention"), read="same")
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("layer graph has a cycle: a layer reads a later layer")
    return g


def _floors(layers, phase: str, decoder_replay: bool, encoder_replay: bool) -> tuple[str, ...]:
    """Window floor of every layer in ``phase`` (the declared replay rules)."""
    out = []
    for layer in layers:
        if phase == "decode":
            out.append("none")
        elif layer.segment == "decoder" and decoder_replay:
            out.append("tail")
        elif encoder_replay:  # a rebuild's fresh rings hold nothing below its first row
            out.append("forward_start")
        else:
            out.append("none")
    return tuple(out)


def _liveness(g, layers, phase, floors, decoder_replay, persisted) -> dict:
    """Backward pass: demanded rows of every node, from the sinks of ``phase``."""
    import networkx as nx

    last = layers[-1].index
    if phase == "decode" or not decoder_replay:
        output = "all"
    else:
        output = "last" if phase == "prefill_final" else "none"
    demand: dict = {}
    for node in reversed(list(nx.topological_sort(g))):
        i, sub = node
        need = []
        if node == (last, "ffn"):
            need.append(output)
        if sub == "compress":
            need.append("all")  # later forwards read every position
        if sub == "ring_write":
            need.append(persisted[i])
        for _, reader, data in g.out_edges(node, data=True):
            r = demand[reader]
            if data["read"] == "same":
                need.append(r)
            elif data["read"] == "window":
                need.append(_window(r, floors[i] == "tail"))
            elif r != "none":
                need.append("all")
        demand[node] = _max(*need)
    return demand


def derive_stage_table(
    spec, *, decoder_replay: bool | None = None, encoder_replay: bool | None = None
) -> StageTable:
    """Derive the stage table of ``spec`` (a ``CacheSpec``); switches default to the spec's."""
    dec = spec.replay.decoder_swa_bounded_replay if decoder_replay is None else decoder_replay
    enc = spec.replay.encoder_swa_bounded_replay if encoder_replay is None else encoder_replay
    layers = spec.layers
    g = layer_graph(layers, spec.dims.candidate_source_layer_id)
    n = len(layers)
    floors = {p: _floors(layers, p, dec, enc) for p in PHASES}
    persisted = {p: ["none"] * n for p in PHASES}
    demand: dict = {}
    # Fixpoint over phases: a phase's ring writes persist what its successors read. Persisted
    # demands only grow (none -> tail), so this ends after at most 3 * n + 1 rounds.
    changed = True
    while changed:
        changed = False
        for p in ("decode", "prefill_final", "prefill_nonfinal"):
            demand[p] = _liveness(g, layers, p, floors[p], dec, persisted[p])
        for p in PHASES:
            for i in range(n):
                reads = any(
                    demand[s][(i, "attention")] != "none" and floors[s][i] != "tail"
                    for s in _SUCCESSORS[p]
                )
                want = "tail" if reads else "none"
                if _RANK[want] > _RANK[persisted[p][i]]:
                    persisted[p][i] = want
                    changed = True
    rows = tuple(
        tuple(tuple(demand[p].get((i, sub), "none") for sub in SUB_STEPS) for i in range(n))
        for p in PHASES
    )
    owners = tuple(layer.index for layer in layers if layer.role == "full")
    return StageTable(
        spec_name=spec.name,
        spec_sha256=spec.spec_sha256,
        num_layers=n,
        decoder_replay=dec,
        encoder_replay=enc,
        last_kv_source=max(spec.dims.kv_source_layer_ids),
        owners=owners,
        rows=rows,
        floors=tuple(floors[p] for p in PHASES),
        stage_bounds=tuple(
            (g.name, g.first_layer, g.last_layer) for g in graph_stages(rows, owners)
        ),
    )


def graph_stages(rows, owners) -> tuple[GraphStage, ...]:
    """Group consecutive layers with the same rows in every phase into graph stages.

    A Full owner whose compression runs on more rows than its attention/FFN is its own stage:
    a replay cuts its rows between graphs.
    """
    n = len(rows[0])

    def signature(i: int) -> tuple:
        sig = []
        for p in range(len(PHASES)):
            ring, comp, attn, ffn = rows[p][i]
            wider = i in owners and _RANK[comp] > _RANK[_max(ring, attn, ffn)]
            sig.append((ring, attn, ffn, comp if wider else "covered"))
        return tuple(sig)

    runs: list[list[int]] = []
    for i in range(n):
        if runs and signature(runs[-1][0]) == signature(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) == 1:
        return (GraphStage("backbone", 0, n - 1),)
    out = []
    used: dict[str, int] = {}
    for run in runs:
        if len(run) == 1:
            name = f"layer{run[0]}"
        else:
            everything = all(
                rows[p][i][s] == "all" for p in range(len(PHASES)) for i in run for s in (0, 2, 3)
            )
            name = "early" if everything else "late"
            used[name] = used.get(name, 0) + 1
            if used[name] > 1:
                name = f"{name}{used[name]}"
        out.append(GraphStage(name, run[0], run[-1]))
    return tuple(out)


def generated_stage_table(spec_name: str, decoder_replay: bool, encoder_replay: bool):
    """The stage table emitted into ``v41plan/generated/<spec>/stages.py`` for the switches, or
    None when that module does not exist."""
    try:
        mod = importlib.import_module(f"v41plan.generated.{spec_name}.stages")
    except ModuleNotFoundError:
        return None
    return getattr(mod, "STAGE_TABLES", {}).get((decoder_replay, encoder_replay))


_CACHE: dict = {}


def stage_table(
    spec, *, decoder_replay: bool | None = None, encoder_replay: bool | None = None
) -> StageTable:
    """The stage table for ``spec`` and switches: the generated one when it matches, else derived
    (and cached per spec object and switches)."""
    dec = spec.replay.decoder_swa_bounded_replay if decoder_replay is None else decoder_replay
    enc = spec.replay.encoder_swa_bounded_replay if encoder_replay is None else encoder_replay
    key = (id(spec), spec.name, dec, enc)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    table = None
    gen = generated_stage_table(spec.name, dec, enc)
    if gen is not None and gen.spec_sha256 == spec.spec_sha256:
        table = gen
    if table is None:
        table = derive_stage_table(spec, decoder_replay=dec, encoder_replay=enc)
    _CACHE[key] = (spec, table)
    return table
