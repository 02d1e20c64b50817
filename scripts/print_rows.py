"""Print a benchmark report's rows as a short table: ``python scripts/print_rows.py FILE [KEY...]``.

Each row's name (or its ``kernel``/``variant`` fields), ``ms`` and ``of_floor``, or its error;
extra KEYs add columns. For reading device-run reports at a glance."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[0])
        return 2
    with open(argv[0]) as f:
        rows = json.load(f).get("rows", [])
    for r in rows:
        name = r.get("name") or " ".join(str(r.get(k)) for k in ("kernel", "variant") if k in r)
        if "error" in r:
            print(f"{name[:88]:88s} ERROR {r['error'][:60]}")
            continue
        for k in r.get("kernel_table", ()):
            print(f"    {k['us']:9.1f} us {k['calls']:5.1f} x {k['kernel'][:70]}")
        extra = " ".join(f"{k}={r.get(k)}" for k in argv[1:])
        ms, fl = r.get("ms"), r.get("of_floor")
        ms_s = f"{ms:9.4f}" if isinstance(ms, (int, float)) else f"{'-':>9}"
        fl_s = f"{fl:6.3f}" if isinstance(fl, (int, float)) else f"{'-':>6}"
        print(f"{name[:88]:88s} {ms_s} ms  of_floor {fl_s} {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
