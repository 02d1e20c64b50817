"""Set a device report's ``commit`` to the commit whose tree it ran (``provenance --check``).

    python scripts/fix_report_commit.py FILE [FILE...]

A device machine's copy of the tree can carry a stale ``.git``, so its reports may record the
wrong commit; the tree hash they record is right. This looks the hash up in the local history
(``v41plan.validation.provenance``) and writes that commit into the report, keeping what the
device recorded under ``provenance.commit_recorded``. Exits 1 if a tree matches no commit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    from v41plan.validation.provenance import ROOT, find_commit

    status = 0
    for name in argv:
        p = Path(name)
        report = json.loads(p.read_text())
        prov = report.get("provenance") or {}
        commit = find_commit(ROOT, prov.get("tree_sha256", ""))
        if not commit:
            print(f"{name}: no commit of the local history has tree {prov.get('tree_sha256')}")
            status = 1
            continue
        if report.get("commit") != commit[:7]:
            prov.setdefault("commit_recorded", report.get("commit"))
            report["commit"] = commit[:7]
            p.write_text(json.dumps(report, indent=1) + "\n")
        print(f"{name}: commit {commit[:7]}")
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
