"""How often does each test fail? Run chosen notebooks and test files N times, one at a time.

    python benchmarks/flakiness.py --runs 10 notebooks/07_launching_at_scale.ipynb tests/test_browser.py

Each run is a fresh ``pytest ITEM`` process (nbval for notebooks, with the project's
pytest options), so nothing is shared between runs. The runs are interleaved (run 1 of
every item, then run 2, ...) so that a slow spell of the machine does not land on one item
alone. Prints failures out of N per item and the names of the failing tests; the output of
every failing run is kept under ``_build/flakiness/``. ``make flakiness`` runs the set the
course cares most about (the torchrun notebooks and the browser test).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "_build" / "flakiness"


def run_once(item: str) -> tuple[bool, list[str], float, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", item, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "SPIKE_COURSE_DATA": "synthetic"})
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    return done.returncode == 0, failed, time.perf_counter() - started, done.stdout + done.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", help="notebooks or test files (pytest node ids work too)")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)

    LOGS.mkdir(parents=True, exist_ok=True)
    failures = Counter()
    failing_tests = {item: Counter() for item in args.items}
    seconds = {item: [] for item in args.items}
    for run in range(1, args.runs + 1):
        for item in args.items:
            ok, failed, took, output = run_once(item)
            seconds[item].append(took)
            if not ok:
                failures[item] += 1
                failing_tests[item].update(failed or ["(no test named: see the log)"])
                log = LOGS / f"{Path(item).stem}.run{run}.log"
                log.write_text(output)
            print(f"run {run}/{args.runs} {item}: {'ok' if ok else 'FAILED'} in {took:.0f} s", flush=True)

    print(f"\n{'item':48s} {'failed':>8s} {'median s':>9s}  failing tests")
    for item in args.items:
        times = sorted(seconds[item])
        names = ", ".join(f"{name} x{n}" for name, n in failing_tests[item].most_common())
        print(f"{item:48s} {failures[item]:>3d}/{args.runs:<4d} {times[len(times) // 2]:9.0f}  {names}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
