"""How long does a 2-rank hello-world take to start, run and exit?

    python benchmarks/launch_startup.py [--repeat 5]

Compares spike_course.launch's spawn mode, its torchrun mode and bare torchrun
(`python -m torch.distributed.run --standalone`) on the same all-reduce worker, and
prints the median and the spread of each. The foundation issue asks that spawn mode be
no slower than bare torchrun.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spike_course import launch

WORKER = """
import torch, torch.distributed as dist
from spike_course import runtime
ctx = runtime.setup()
value = torch.tensor([float(ctx.rank)])
dist.all_reduce(value)
print(f"rank {ctx.rank}: {value.item():g}")
runtime.teardown()
"""


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp()) / "hello.py"
    script.write_text(WORKER)
    bare = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    ways = {
        "launch, spawn mode": lambda: launch(script, nproc=2, echo=False),
        "launch, torchrun mode": lambda: launch(script, nproc=2, launcher="torchrun", echo=False),
        "bare torchrun": lambda: subprocess.run(bare, check=True, capture_output=True),
    }
    times = {name: [] for name in ways}
    for _ in range(args.repeat):  # interleaved, so a busy moment hurts every way alike
        for name, run in ways.items():
            times[name].append(timed(run))
    for name, seconds in times.items():
        print(f"{name:<22} median {statistics.median(seconds):5.2f} s   "
              f"min {min(seconds):5.2f} s   max {max(seconds):5.2f} s   ({args.repeat} runs)")


if __name__ == "__main__":
    main()
