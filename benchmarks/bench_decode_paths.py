"""Decode step by kernel path on the MEDIUM model (bf16, FULL CUDA graphs), in one process.

    python3 benchmarks/bench_decode_paths.py [--checkpoint DIR] [--batch-sizes 1,8,64]
        [--variants reference,backend,dense,grouped,resident,dense_compiled,compiled]
        [--out report.json]

Each variant is a ``RuntimeModel`` with one more of the fast paths switched on, in this order:

- ``reference``: the torch backend, the torch dense compositions, MoE dense over experts,
  dequantised bf16 weights (what ``kernel_backend="torch"`` ran before the fast paths);
- ``backend``: ``TritonBackend`` for the pool-touching ops (attention, scorer, scatters);
- ``dense``: plus the fused mHC site / expand / FP8 quantizer kernels (``TritonDense``);
- ``grouped``: plus the grouped MoE over the selected experts only (torch ``_grouped_mm``);
- ``resident``: plus weights kept as published (W8A8 Triton linears, W4A8 grouped MoE): the
  engine's ``auto`` choice on CUDA under eager execution;
- ``dense_compiled``: ``dense`` with ``compilation_level=3`` (the dense pieces, the dense MoE
  included, under Inductor);
- ``compiled``: ``resident`` with ``compilation_level=3``: the engine's ``auto`` choice under
  CUDA graphs;
- ``compiled_torch_attention`` / ``dense_compiled_torch_attention``: ``compiled`` /
  ``dense_compiled`` with the torch backend for the pool-touching ops (the fused-dense issue's
  batch-1 target is stated for that backend);
- ``compiled_split_two_launches``: ``compiled`` with each split-K linear summed by a second
  launch (``triton_gemm.SPLIT_ONE_LAUNCH`` off, ``GEMM_FLAGS``): its A/B in one process;
- ``compiled_pdl_on``: ``compiled`` with the decode-sized launches of the Triton kernels as
  dependent launches (``triton_common.PDL`` on): their A/B;
- ``compiled_separate_linears``: ``compiled`` with ``wq_a`` and ``wkv`` as two products
  (``resident.JOINT_LINEARS`` off): the joint product's A/B;
- ``compiled_one_stream``: ``compiled`` with the shared expert on the current stream, not on
  a side stream beside the routed experts (``resident.SHARED_EXPERT_STREAM`` off): its A/B;
- ``compiled_decode_tma``: ``compiled`` with the W8A8 decode launches reading their tiles by
  TMA descriptors (``triton_gemm.DECODE_TMA`` on; the same tiles, splits and sums): its A/B;
- ``compiled_no_site_codes``: ``compiled`` with the joint ``wq_a``/``wkv`` product and the
  grouped MoE quantizing their input in launches of their own, not taking the codes the mHC
  sites' epilogues make (``paged_model.SITE_CODES`` off): its A/B;
- ``compiled_unfolded_scales``: ``compiled`` with the routed experts' FP4 decode multiplying by
  ``2**126`` and then by the scale, not by their product in one instruction
  (``triton_moe.FOLDED_SCALES`` off): its A/B;
- ``compiled_decode_fp8_rows``: ``compiled`` with the W8A8 linears at 17-64 rows in the fp8
  mode, not the bf16 mode's 64-row tiles (``triton_gemm.DECODE_BF16_ROWS`` off): its A/B;
- ``compiled_unresolved``: ``compiled`` with the attention reading each selected id's page in
  the block loop, not resolved to plane offsets first (``triton_backend.RESOLVE_SELECTED``
  off): its A/B;
- ``compiled_fixed_splits``: ``compiled`` with the flash-decoding splits taking fixed shares of
  every block the shapes allow (``triton_backend.BALANCED_SPLITS`` off): its A/B;
- ``compiled_unresolved_fixed``: ``compiled`` with both attention flags above off;
- ``compiled_digit_select``: ``compiled`` with the index scorer's 32-key tiles and the digit
  select for every row (``TritonBackend.score_block`` 32, ``select_resident_max`` 0): the
  forms before the 64-key tiles and the resident select became the default, their A/B.

Variants run in the order given, each in a fresh engine, and a name may repeat (``compiled,
compiled_decode_fp8_rows,compiled``): a later variant of the process has run 0.2-0.3 ms faster at
batch 64 on an H100 whichever it was, so an A/B/A separates a change from that order; each row
records its ``run_index``.

Per variant and batch size: requests prefilled to ``--context`` tokens, then the same decode step
timed as the replay of its captured FULL graph (device events) and as a graph step (host
``prepare`` + replay); kernels per layer counted with ``torch.profiler`` over one eager forward,
and of them the dense ones: launched outside the kernel-backend ops and the grouped MoE's expert
product, which run inside the runtime's ``record_function`` ranges
(``RuntimeModel.label_backend_ops``), with their names per layer
(``dense_kernels_by_name_per_layer``) and by the model function that launched them
(``dense_kernels_by_site_per_layer``: ``labelled_sites`` ranges); graph tokens against eager tokens
(the capture is exact) and the logits against the reference variant's at the same step (each
variant prefilled the same tokens through its own kernels, so the pools differ by their roundings:
a stated figure, not a check). The ceilings are measured in this process and every row carries
``kernel_table``: the ``--kernel-table`` kernels with the most device time in a profiled graph
replay (per step: calls, microseconds), with ``kernel_busy_ms`` (the sum of all kernel durations;
replay minus busy is the launch and dependency gap), and ``floor_ms`` (``medium_model.step_floor``,
weights in their shipped formats) and ``of_floor`` = floor / replay. Writes
``$OUT/bench_decode_paths.json``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import ceilings_line, measure_ceilings
from medium_model import (
    decode_requests,
    decode_step,
    load_spec,
    load_weights,
    medium_report,
    pool_row_bytes,
    prefill_to_context,
    step_floor,
    time_device,
    time_host,
)
from report_io import write_report

from v41plan.runtime.kernels.backend import BACKEND_RANGE

VARIANTS = {
    "reference": ("torch", "torch", "dense", False, None),
    "backend": ("triton", "torch", "dense", False, None),
    "dense": ("triton", "triton", "dense", False, None),
    "grouped": ("triton", "triton", "grouped", False, None),
    "resident": ("triton", "triton", "grouped", True, None),
    "dense_compiled": ("triton", "triton", "dense", False, "inductor"),
    "compiled": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_torch_attention": ("torch", "triton", "grouped", True, "inductor"),
    "dense_compiled_torch_attention": ("torch", "triton", "dense", False, "inductor"),
    "compiled_split_two_launches": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_pdl_on": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_separate_linears": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_one_stream": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_decode_tma": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_no_site_codes": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_unfolded_scales": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_decode_fp8_rows": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_unresolved": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_fixed_splits": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_unresolved_fixed": ("triton", "triton", "grouped", True, "inductor"),
    "compiled_digit_select": ("triton", "triton", "grouped", True, "inductor"),
}
"""Variant name -> (kernel backend, dense kernels, MoE, resident weights, compile backend)."""

GEMM_FLAGS = {
    "compiled_split_two_launches": {"kernels.triton_gemm.SPLIT_ONE_LAUNCH": False},
    "compiled_pdl_on": {"kernels.triton_common.PDL": "on"},
    "compiled_separate_linears": {"resident.JOINT_LINEARS": False},
    "compiled_one_stream": {"resident.SHARED_EXPERT_STREAM": False},
    "compiled_decode_tma": {"kernels.triton_gemm.DECODE_TMA": True},
    "compiled_no_site_codes": {"paged_model.SITE_CODES": False},
    "compiled_unfolded_scales": {"kernels.triton_moe.FOLDED_SCALES": False},
    "compiled_decode_fp8_rows": {"kernels.triton_gemm.DECODE_BF16_ROWS": False},
    "compiled_unresolved": {"kernels.triton_backend.RESOLVE_SELECTED": False},
    "compiled_fixed_splits": {"kernels.triton_backend.BALANCED_SPLITS": False},
    "compiled_unresolved_fixed": {
        "kernels.triton_backend.RESOLVE_SELECTED": False,
        "kernels.triton_backend.BALANCED_SPLITS": False,
    },
    "compiled_digit_select": {
        "kernels.triton_backend.TritonBackend.score_block": 32,
        "kernels.triton_backend.TritonBackend.select_resident_max": 0,
    },
}
"""Variants that also set module flags (``module.NAME`` under ``v41plan.runtime``) for their
run, restored after it: the same step with a flag's other value, timed in the process that
times the default."""


def _backend_kernels() -> frozenset:
    """Names of the Triton kernels only backend ops launch (the attention path's modules and
    the grouped MoE's): the profile links some launches to no host event."""
    from triton.runtime.jit import JITFunction

    from v41plan.runtime.kernels import (
        triton_attention,
        triton_moe,
        triton_scatter,
        triton_scorer,
    )

    return frozenset(
        name
        for mod in (triton_attention, triton_moe, triton_scatter, triton_scorer)
        for name, obj in vars(mod).items()
        if isinstance(obj, JITFunction)
    )


BACKEND_KERNELS: frozenset = frozenset()
"""Filled by ``main`` (``_backend_kernels``) before the first profile."""


SITE_RANGE = "site."
"""Prefix of the ``record_function`` ranges ``labelled_sites`` puts around the model's own
functions (a dense kernel is charged to the innermost one it launched in)."""

SITE_METHODS = (
    "embed_rows", "frame", "layer_pre", "layer_attention", "layer_post", "head_rows",
    "_compress", "_attention", "_window_bounds", "_ring_write_from", "_within",
)  # fmt: skip


class _Labelled:
    """``obj`` with each callable attribute run inside a ``record_function`` range
    ``prefix + name``."""

    def __init__(self, obj, prefix):
        self._obj, self._prefix = obj, prefix

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if not callable(attr) or name.startswith("__"):
            return attr
        return _ranged(attr, self._prefix + name)


def _ranged(fn, label):
    def call(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)

    return call


def labelled_sites(m):
    """Put ``site.`` ranges around ``m``'s per-layer functions, its dense pieces and its dense
    kernels (instance attributes; ``unlabel_sites`` removes them)."""
    saved = {"pieces": m.pieces, "dense": m.dense}
    for name in SITE_METHODS:
        setattr(m, name, _ranged(getattr(m, name), SITE_RANGE + name))
    m.pieces = _Labelled(m.pieces, SITE_RANGE + "pieces.")
    m.dense = _Labelled(m.dense, SITE_RANGE + "dense.")
    return saved


def unlabel_sites(m, saved):
    """Undo ``labelled_sites``."""
    for name in SITE_METHODS:
        m.__dict__.pop(name, None)
    m.pieces, m.dense = saved["pieces"], saved["dense"]


def _kernels(fn) -> tuple[int, int | None, dict[str, int], dict[str, dict[str, int]]]:
    """(device kernels one call of ``fn`` launches, those launched inside a ``backend.`` range,
    the dense ones by name, the dense ones by the innermost ``site.`` range and name)
    (``torch.profiler``; copies and memsets apart). The second is None when the profile links
    no kernel to the host event that launched it. A kernel linked to no host event is the
    backend's when linked backend kernels carry its name or it is one of the backend modules'
    own kernels (``BACKEND_KERNELS``), else dense (site ``(unlinked)``)."""
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    # the device side of a record_function range is an annotation, not a kernel
    names = [
        e.name
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith((BACKEND_RANGE, SITE_RANGE))
    ]
    total = sum(1 for n in names if not n.startswith(("Memcpy", "Memset")))
    linked = inside = 0
    dense: Counter = Counter()
    by_site: dict[str, Counter] = {}
    linked_names: Counter = Counter()
    backend_names: set = set()
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        for k in getattr(e, "kernels", ()):
            if k.name.startswith(("Memcpy", "Memset")):
                continue
            linked += 1
            linked_names[k.name] += 1
            p, site = e, None
            while p is not None and not p.name.startswith(BACKEND_RANGE):
                if site is None and p.name.startswith(SITE_RANGE):
                    site = p.name[len(SITE_RANGE) :]
                p = p.cpu_parent
            if p is not None:
                inside += 1
                backend_names.add(k.name)
            else:
                dense[k.name[:100]] += 1
                by_site.setdefault(site or "(none)", Counter())[k.name[:80]] += 1
    # kernels the profile links to no host event: charged by name (a name the linked backend
    # kernels carry is the backend's; any other counts as dense, the conservative side)
    all_names = Counter(n for n in names if not n.startswith(("Memcpy", "Memset")))
    unlinked = all_names - linked_names
    backend_names |= BACKEND_KERNELS
    for name, count in unlinked.items():
        if name in backend_names:
            inside += count
        else:
            dense[name[:100]] += count
            by_site.setdefault("(unlinked)", Counter())[name[:80]] += count
    sites = {s: dict(c.most_common()) for s, c in by_site.items()}
    return total, (inside if linked else None), dict(dense.most_common()), sites


def _kernel_table(fn, steps: int, top: int) -> tuple[list[dict], float | None]:
    """``(the top kernels by device time per call of fn, kernel busy ms per call)`` from a
    profile of ``steps`` calls (a graph replay's kernels are traced one by one); ``([], None)``
    when the profiler records no kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            acc = by_name.setdefault(e.name, [0, 0.0])
            acc[0] += 1
            acc[1] += e.device_time
    if not by_name:
        return [], None
    busy_us = sum(v[1] for v in by_name.values()) / steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    table = [{"kernel": k[:120], "calls": v[0] / steps, "us": v[1] / steps} for k, v in ranked]
    return table, busy_us / 1e3


def _flag_owner(key: str) -> tuple:
    """(module or class, attribute name) of a flag ``module.NAME`` / ``module.Class.NAME``."""
    import importlib

    path, attr = key.rsplit(".", 1)
    try:
        return importlib.import_module(f"v41plan.runtime.{path}"), attr
    except ModuleNotFoundError:
        mod, cls = path.rsplit(".", 1)
        return getattr(importlib.import_module(f"v41plan.runtime.{mod}"), cls), attr


@contextlib.contextmanager
def module_flags(flags: dict):
    """Set module flags (``module.NAME`` or ``module.Class.NAME`` under ``v41plan.runtime`` ->
    value) for the body, restored after it."""
    where = {k: _flag_owner(k) for k in flags}
    saved = {k: getattr(mod, attr) for k, (mod, attr) in where.items()}
    try:
        for k, v in flags.items():
            setattr(*where[k], v)
        yield
    finally:
        for k, v in saved.items():
            setattr(*where[k], v)


def run_variant(name, spec, args, ceil, sizes, ref_logits) -> list[dict]:
    """Rows of one variant (see the module doc) with its ``GEMM_FLAGS`` set; fills
    ``ref_logits`` for the reference."""
    flags = GEMM_FLAGS.get(name, {})
    with module_flags(flags):
        rows = _run_variant(name, spec, args, ceil, sizes, ref_logits)
    for r in rows:
        r["gemm_flags"] = flags
    return rows


def _run_variant(name, spec, args, ceil, sizes, ref_logits) -> list[dict]:
    """``run_variant`` under the flags it set."""
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets
    from v41plan.runtime.kernels import torch_ref
    from v41plan.runtime.paged_model import RuntimeModel

    backend, dense, moe, resident, compile_backend = VARIANTS[name]
    t0 = time.perf_counter()
    cfg, weights, engram, load_report = load_weights(spec, args.checkpoint, resident=resident)
    if backend == "triton":
        from v41plan.runtime.kernels.triton_backend import TritonBackend

        kb = TritonBackend()
    else:
        kb = torch_ref.TorchBackend()
    max_bs = max(sizes)
    P = spec.replay.hash_block_tokens
    need = -(-(args.context + 8) // P)
    chunk = 8192
    m = RuntimeModel(
        spec, weights, engram, kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype, num_pages=max_bs * need + 8, num_slots=max_bs,
        max_tokens=max(chunk, max_bs), max_bs=max_bs, table_width=need + 1,
        dtype=torch.bfloat16, device="cuda", cfg=cfg, backend=kb, dense=dense, moe=moe,
        compile_backend=compile_backend,
    )  # fmt: skip
    del weights
    load_s = time.perf_counter() - t0
    row_bytes = pool_row_bytes(m.geometry)
    buckets = [b for b in capture_buckets(spec, max_bs, max_bs) if b[0] in sizes]
    runner = CudaGraphs(m, spec, buckets, "FULL")
    graphs0, compile0 = m.pieces.graphs, m.pieces.compile_s
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    compiled_graphs, compile_s = m.pieces.graphs - graphs0, m.pieces.compile_s - compile0

    reqs, ids = decode_requests(spec, max_bs, args.context)
    t0 = time.perf_counter()
    prefill_to_context(m, spec, reqs, ids, args.context, chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0

    rows = []
    for bs in sizes:
        plan, tok = decode_step(m, spec, reqs, ids, args.context, bs)
        snap, mirror = m.pools.backing.clone(), m.pools.cursor_host.copy()

        def restore(snap=snap, mirror=mirror):
            m.pools.backing.copy_(snap)
            m.pools.cursor_host[:] = mirror

        want = m.forward(plan, tok).logits.float().clone()
        restore()
        got = runner.run(m.prepare(plan, tok)).logits.float().clone()  # the graph's own buffer
        restore()
        graph_equal = bool(torch.equal(want.argmax(-1), got.argmax(-1)))
        graph_diff = float((want - got).abs().max())
        m.label_backend_ops()  # the runtime's own backend.* ranges
        saved = labelled_sites(m)
        kernels, backend_kernels, dense_names, dense_sites = _kernels(
            lambda plan=plan, tok=tok: m.forward(plan, tok)
        )
        unlabel_sites(m, saved)
        m.backend, m.pieces.ranged = kb, False
        restore()
        g = runner.graphs[m.prepare(plan, tok).key]
        replay_s = time_device(g.replay, args.iters)
        step_s = time_host(
            lambda plan=plan, tok=tok: runner.run(m.prepare(plan, tok)).logits, args.iters
        )
        restore()
        table, busy_ms, table_source = [], None, None
        if args.kernel_table:
            table, busy_ms = _kernel_table(g.replay, 3, args.kernel_table)
            table_source = "graph_replay"
            if not table:  # the profiler traced no kernel of the replay: the eager forward's
                restore()
                table, busy_ms = _kernel_table(
                    lambda plan=plan, tok=tok: m.forward(plan, tok), 1, args.kernel_table
                )
                table_source = "eager_forward"
        restore()
        del snap
        if name == "reference":
            ref_logits[bs] = want
        ref = ref_logits.get(bs)
        vs_ref = {}
        if ref is not None:
            err = (want - ref).norm() / ref.norm()
            vs_ref = {
                "logits_rel_l2_vs_reference": float(err),
                "argmax_equal_vs_reference": float(
                    (want.argmax(-1) == ref.argmax(-1)).float().mean()
                ),
            }
        fl = step_floor(cfg, plan, ceil, rows=row_bytes, index_cache_dtype=args.index_cache_dtype)
        rows.append(
            {
                "variant": name,
                "kernel_backend": backend,
                "dense_kernels": dense,
                "moe_impl": moe,
                "resident_weights": resident,
                "batch": bs,
                "context": args.context,
                "replay_ms": replay_s * 1e3,
                "graph_step_ms": step_s * 1e3,
                "kernels_per_layer": kernels / cfg.num_hidden_layers,
                "dense_kernels_per_layer": None
                if backend_kernels is None
                else (kernels - backend_kernels) / cfg.num_hidden_layers,
                "compilation_level": 3 if compile_backend else 0,
                "compiled_graphs": compiled_graphs,
                "compile_s": compile_s,
                "graph_tokens_equal_eager": graph_equal,
                "graph_max_logit_diff": graph_diff,
                **vs_ref,
                "dense_kernels_by_name_per_layer": {
                    k: v / cfg.num_hidden_layers for k, v in list(dense_names.items())[:40]
                },
                "dense_kernels_by_site_per_layer": {
                    site: {
                        "total": sum(c.values()) / cfg.num_hidden_layers,
                        **{k: v / cfg.num_hidden_layers for k, v in list(c.items())[:12]},
                    }
                    for site, c in sorted(dense_sites.items(), key=lambda sc: -sum(sc[1].values()))
                },
                "kernel_busy_ms": busy_ms,
                "kernel_table": table,
                "kernel_table_source": table_source,
                "floor_ms": fl["floor_s"] * 1e3,
                "bound": fl["bound"],
                "of_floor": fl["floor_s"] / replay_s,
                "weight_bytes": load_report["resident_bytes"],
                "checkpoint_bytes": load_report["checkpoint_bytes"],
                "load_s": load_s,
                "capture_s": capture_s,
                "prefill_s": prefill_s,
            }
        )
        print(
            f"{name:>14} {bs:>4} {rows[-1]['replay_ms']:>9.3f} {rows[-1]['graph_step_ms']:>9.3f} "
            f"{rows[-1]['kernels_per_layer']:>8.1f} "
            f"{rows[-1]['dense_kernels_per_layer'] or float('nan'):>8.1f} "
            f"{rows[-1]['floor_ms']:>8.3f} "
            f"{rows[-1]['of_floor']:>8.4f} {rows[-1]['graph_tokens_equal_eager']!s:>6} "
            f"{vs_ref.get('logits_rel_l2_vs_reference', float('nan')):>9.2e} "
            f"{vs_ref.get('argmax_equal_vs_reference', float('nan')):>6.2f}",
            flush=True,
        )
        sites = rows[-1]["dense_kernels_by_site_per_layer"]
        print(
            f"{'':>14} dense kernels per layer by site: "
            + ", ".join(f"{k} {v['total']:.2f}" for k, v in list(sites.items())[:10])
        )
        if table:
            replay_ms = rows[-1]["replay_ms"]
            print(f"{'':>14} kernels busy {busy_ms:.3f} ms of {replay_ms:.3f} ms replay")
            for t in table[:6]:
                print(f"{'':>14} {t['us']:>9.1f} us {t['calls']:>6.0f}x  {t['kernel'][:70]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="default: seeded random weights")
    ap.add_argument("--spec", default="medium", help="spec name or YAML (e.g. flash_slice)")
    ap.add_argument("--context", type=int, default=256, help="tokens each request holds")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument(
        "--kernel-table", type=int, default=12, help="kernels a row lists by device time (0: none)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_paths.py: needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"bench_decode_paths.py: unknown variant {bad[0]!r}; accepted: {', '.join(VARIANTS)}")
        return 2

    global BACKEND_KERNELS
    BACKEND_KERNELS = _backend_kernels()
    ceil = measure_ceilings()
    print(ceilings_line(ceil))
    spec = load_spec(args.spec)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    print(
        f"{'variant':>14} {'bs':>4} {'replay ms':>9} {'step ms':>9} {'k/layer':>8} {'dense':>8} "
        f"{'floor ms':>8} "
        f"{'of_floor':>8} {'g==e':>6} {'rel vs ref':>9} {'argmax':>6}"
    )
    rows: list[dict] = []
    ref_logits: dict = {}
    report = medium_report(spec, args, ceil, rows)
    for index, name in enumerate(names):
        try:
            got = run_variant(name, spec, args, ceil, sizes, ref_logits)
            for row in got:
                row["run_index"] = index  # a name may repeat: A, B, A times the order's effect
            rows.extend(got)
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the rest run
            import traceback

            traceback.print_exc()
            report.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
            gc.collect()
            torch.cuda.empty_cache()
        write_report(report, args.out, "bench_decode_paths.json")  # after every variant
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
