"""The GPU suite's outcome from the report its conftest writes test by test (scripts/gpu_run.sh tests): counts,
each failure with its message, the slowest tests, and every collected test file that never reported (a run cut by
its time limit). Exit status 1 when anything failed or did not report.

    python scripts/gpu_tests_summary.py COLLECTED REPORT
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path


def main(collected_path: str, report_path: str) -> int:
    collected = [line.strip() for line in Path(collected_path).read_text().splitlines() if "::" in line]
    rows = [line.split("\t") for line in Path(report_path).read_text().splitlines() if line.strip()]
    outcomes = Counter(row[0] for row in rows)
    reported = {row[2] for row in rows}
    print("=== GPU suite: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())))
    bad = [row for row in rows if row[0] in ("failed", "error")]
    for row in bad:
        print(f"FAILED {row[2]} ({row[1]} s): {row[3] if len(row) > 3 else ''}")
    missing = [nodeid for nodeid in collected if nodeid not in reported]
    totals = Counter(nodeid.split("::")[0] for nodeid in collected)
    for path, n in sorted(Counter(nodeid.split("::")[0] for nodeid in missing).items()):
        print(f"NOT REPORTED {path}: {n} of {totals[path]} tests")
    print("slowest: " + ", ".join(f"{row[2]} {row[1]} s" for row in sorted(rows, key=lambda r: -float(r[1]))[:8]))
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
