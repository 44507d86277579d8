"""How long does a hello-world all-reduce take to start, run and exit, launched each way?

    python benchmarks/launch_startup.py [--repeat 5]

In one process and interleaved (a busy moment hurts every way alike), for 2 and 4 ranks:
``spike_course.launch`` with a warm start (ranks forked from the server that imported
torch once), with fresh interpreters, and bare torchrun (``python -m torch.distributed.run
--standalone``) on the same worker. Prints a Markdown table of the medians and of the
median ratio of each round's pair (issue 24 asks warm 2-rank <= 0.1x bare torchrun). The
warm start server's own start (once per kernel, in the background of a chapter's first
cell) is timed once, before the rounds.
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


def ways(script, nproc):
    bare = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script)]
    return {
        "warm": lambda: launch(script, nproc=nproc, echo=False),
        "fresh": lambda: launch(script, nproc=nproc, launcher="fresh", echo=False),
        "bare torchrun": lambda: subprocess.run(bare, check=True, capture_output=True),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp()) / "hello.py"
    script.write_text(WORKER)
    print(f"warm start server's own start (once per kernel): {timed(lambda: launch(script, echo=False)):.2f} s")
    times = {(nproc, way): [] for nproc in (2, 4) for way in ways(script, nproc)}
    for _ in range(args.repeat):
        for nproc in (2, 4):
            for way, run in ways(script, nproc).items():
                times[nproc, way].append(timed(run))
    print(f"\n| ranks | warm, s | fresh, s | bare torchrun, s | warm / bare torchrun | warm / fresh |")
    print("| --- | --- | --- | --- | --- | --- |")
    for nproc in (2, 4):
        warm, fresh, bare = (times[nproc, way] for way in ("warm", "fresh", "bare torchrun"))
        row = [statistics.median(t) for t in (warm, fresh, bare)]
        ratios = [statistics.median(w / other for w, other in zip(warm, others)) for others in (bare, fresh)]
        print(f"| {nproc} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {ratios[0]:.3f} | {ratios[1]:.3f} |")
    print(f"\nmedians of {args.repeat} interleaved runs each; ratios: median of the per-round ratios")
    for (nproc, way), seconds in times.items():
        print(f"{nproc} ranks, {way:<14} min {min(seconds):5.2f} s  max {max(seconds):5.2f} s")


if __name__ == "__main__":
    main()
