"""Plant bugs one at a time and show that the CPU suite catches each.

    python scripts/plant_bugs.py [--only NAME ...] [--list]

Every bug is a one-line edit of a shared piece or path (a quantizer's scale rule, the mHC comb
orientation, a RoPE frequency lane, the attention sink, the decoder-tail window floor, a
checkpoint image span, the Engram history of a rebuild, a ring write bound). For each, the
tracked files are copied to a scratch directory, the edit is applied there (the checkout is
never touched), and the tests named for it run with ``pytest -x``: the bug is *caught* when
they fail. Prints one line per bug and exits 1 if any bug survives its tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    """One planted edit and the tests expected to catch it."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


BUGS = (
    Bug(
        "fp8_scale_not_pow2",
        "v41plan/model/quant.py",
        "s = pow2ceil(_amax(xb, FP8_AMAX_FLOOR) / E4M3_MAX).to(xb.dtype)",
        "s = (_amax(xb, FP8_AMAX_FLOOR) / E4M3_MAX).to(xb.dtype)",
        ("tests/model/test_formulas.py", "tests/model/test_golden.py"),
        "the FP8 activation scale is a power of two (ue8m0)",
    ),
    Bug(
        "mhc_comb_transposed",
        "v41plan/model/layers.py",
        'out = torch.einsum("nij,nid->njd", C, X.to(a))',
        'out = torch.einsum("nji,nid->njd", C, X.to(a))',
        ("tests/model/test_formulas.py", "tests/model/test_golden.py"),
        "C[i][j] is source i to destination j",
    ),
    Bug(
        "rope_lane_shifted",
        "v41plan/model/layers.py",
        "freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))",
        "freqs = 1.0 / (base ** (torch.arange(1, rd + 1, 2, dtype=torch.float32) / rd))",
        ("tests/model/test_formulas.py", "tests/model/test_golden.py"),
        "lane pair k turns at base^(-2k/rd)",
    ),
    Bug(
        "attention_sink_dropped",
        "v41plan/model/layers.py",
        "den = p.sum(-1) + torch.exp(s - m)",
        "den = p.sum(-1)",
        ("tests/model/test_formulas.py", "tests/model/test_golden.py"),
        "the per-head sink adds exp(sink) to the denominator",
    ),
    Bug(
        "decoder_tail_floor_lost",
        "v41plan/runtime/paged_model.py",
        'pr["swa_replay_start"][ba]\n                if info.segment == "decoder"',
        'pr["encoder_window_floor"][ba]\n                if info.segment == "decoder"',
        ("tests/runtime/test_replay_reference.py",),
        "a replayed tail row's window starts at the tail",
    ),
    Bug(
        "image_span_short",
        "v41plan/runtime/pools.py",
        "n = [int(x) for x in spans.nbytes]",
        "n = [int(x) - (i == 0) for i, x in enumerate(spans.nbytes)]",
        ("tests/runtime/test_runtime_replay.py",),
        "a checkpoint image carries every byte of the rings and the cursor",
    ),
    Bug(
        "rebuild_history_shifted",
        "v41plan/serving/batch.py",
        "win[lo:] = compress(raw) if compress is not None else raw",
        "win[lo:] = np.roll(compress(raw) if compress is not None else raw, 1)",
        ("tests/serving/test_batch.py",),
        "a rebuild's Engram history is the compressed ids before its forward start",
    ),
    Bug(
        "ring_keeps_two_rows_less",
        "v41plan/runtime/paged_model.py",
        'lo = pr["forward_end"][b] - W',
        'lo = pr["forward_end"][b] - W + 2',
        ("tests/runtime/test_runtime_parity.py",),
        "a forward leaves at least its last W - 1 window rows in the ring (what the next "
        "row's window reads)",
    ),
)


def tracked_files() -> list[str]:
    """The checkout's files as git lists them (untracked new files included)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [f for f in out.stdout.splitlines() if f and (ROOT / f).is_file()]


def copy_tree(dest: Path, files: list[str]) -> None:
    """Copy the tracked files (and ``../shared`` as a link, for the golden values)."""
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)
    shared = ROOT.parent / "shared"
    if shared.exists() and not (dest.parent / "shared").exists():
        (dest.parent / "shared").symlink_to(shared)


def plant(tree: Path, bug: Bug) -> None:
    """Apply the bug's edit in ``tree`` (it must match exactly once)."""
    p = tree / bug.path
    text = p.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the planted line is not in {bug.path} exactly once")
    p.write_text(text.replace(bug.old, bug.new))


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[bool, str, float]:
    """``(failed, last line, seconds)`` of ``pytest -x`` on ``tests`` inside ``tree``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tree, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return (
        proc.returncode != 0,
        (lines[-1] if lines else proc.stderr[-200:]),
        time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    """Plant every bug (or ``--only`` some), run its tests, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="bug names to plant (default: all)")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = ap.parse_args(argv)
    bugs = [b for b in BUGS if args.only is None or b.name in args.only]
    if args.list:
        for b in BUGS:
            print(f"{b.name:26} {b.path}: {b.why}")
        return 0
    files = tracked_files()
    survived = []
    print(f"{'bug':26} {'caught':>6} {'s':>5}  tests -> last line")
    with tempfile.TemporaryDirectory(prefix="v41plan-bugs-") as tmp:
        base = Path(tmp) / "base" / "repo"
        copy_tree(base, files)  # one snapshot: later edits of the checkout do not leak in
        for bug in bugs:
            tree = Path(tmp) / bug.name / "repo"
            shutil.copytree(base, tree, symlinks=True)
            if not (tree.parent / "shared").exists() and (base.parent / "shared").exists():
                (tree.parent / "shared").symlink_to((base.parent / "shared").resolve())
            plant(tree, bug)
            failed, last, secs = run_tests(tree, bug.tests)
            if not failed:
                survived.append(bug.name)
            print(f"{bug.name:26} {'yes' if failed else 'NO':>6} {secs:5.0f}  "
                  f"{' '.join(bug.tests)} -> {last}")  # fmt: skip
            shutil.rmtree(tree.parent)
    if survived:
        print(f"bugs the suite did not catch: {', '.join(survived)}")
        return 1
    print(f"every planted bug ({len(bugs)}) made its tests fail")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
