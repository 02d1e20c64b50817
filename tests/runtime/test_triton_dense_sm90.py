"""The fused dense kernels compile for sm_90 on a CPU machine (Triton's own ``ptxas``).

The interpreter tests run the kernels' arithmetic, not the GPU compiler: this runs
``scripts/check_dense_kernels_sm90.py --quick`` in a fresh process (without ``TRITON_INTERPRET``,
which ``test_triton_dense.py`` sets in this one) so a kernel only the compiler refuses fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_dense_kernels_sm90.py"


@pytest.mark.slow
def test_every_kernel_form_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # the quantizer, the expand, the output projection's inverse RoPE, the split site's two
    # kernels, the products and tf32x3 sites, the W8A8 linear (plain, grouped input, RoPE
    # epilogue, split-K, fp8 and bf16 prefill tiles, the grouped W8A16 wo_a at decode, split and
    # prefill tiles, the TMA prefill tile plain, with RoPE and in the bf16 mode) and its split
    # sum, the shared expert's gate/up SwiGLU (whole and split-K) and its split sum, the "mm"
    # mode's four (the quantizer's values, codes to values, RoPE rows, SwiGLU rows), the MoE's
    # gate/up and down GEMMs (fp8, bf16 at two K steps, prefetched, lanes in pairs with and
    # without prefetch, pairs by TMA) and the permuted rows' kernel, the permutation (expert loop
    # and one-hot), the router (one kernel; the split GEMV and its select), the sparse attention
    # at flash widths (64- and 32-head blocks), the index scorer's decode form (fp8 plane, flash
    # widths), the resident top-k select and the long-row select's two kernels
    assert "0 failed" in res.stdout and res.stdout.count("ok ") == 57
    # no kernel has its wgmma serialized by ptxas (the sparse attention's was, at 64 heads, until
    # its window keys became one tile) or a 64-bit integer division (a called routine)
    assert "wgmma-serialized" not in res.stdout and "div64" not in res.stdout
    # the decode sites' Sinkhorn loop multiplies by reciprocals: an IEEE division's check and
    # slow-path call are a branch region each, which kept the loop's divisions from
    # overlapping (0.31 us an iteration at flash widths on an H100)
    for line in res.stdout.splitlines():
        if line.startswith(("ok   mhc_site split", "ok   mhc_site products")):
            assert "loop-fchk" not in line, line
