"""Chapter 15's healing drill: the replica groups of a torchft job, one killed and started again.

A torchft lighthouse runs in this process. Group 0 trains throughout; group 1 is started once for
each entry of ``deaths`` and dies where that entry says (``--die-after N --die-where ...`` of the
chapter's ``replica.py``), then once more, to the end. Each group is a launch of its own (one
rank), as each would be a workload of its own on the cluster. Once the last life of group 1 has
stepped together with group 0, the drill writes the job's length, ``margin`` steps on, to the file
both groups read, so that they stop at the same step; it writes one on any way out, so that no
group trains on for ever.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .launcher import LaunchResult, launch

FOREVER = 10**6  # steps: the groups run until the drill writes the job's length


@dataclass
class Life:
    """One start of a group: its launch, the steps it logged as it went and, if it finished,
    its final weights and the device type it trained on."""
    result: LaunchResult
    steps: list
    weights: list | None
    device: str | None


@dataclass
class Drill:
    survivor: Life
    lives: list  # group 1's starts, in order: one per death, then the one that finished


def run(script, folder, deaths=(), margin: int = 5, timeout: float = 120) -> Drill:
    # The lighthouse logs every quorum (ten a second) into the cell otherwise. Its Rust logger reads
    # the variable when torchft is first imported: set it before.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer  # only the drill needs torchft

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    length = folder / "length"
    for stale in [length, *folder.glob("group*.json*")]:  # an earlier drill's logs would be read as this one's
        stale.unlink(missing_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)

    def group(replica, life, *extra):
        out = folder / f"group{replica}_{life}.json"
        result = launch(script, nproc=1, launcher="warm", echo=False, progress=False, check=False,
                        timeout=timeout, args=["--replica", replica, "--lighthouse", lighthouse.address(),
                                               "--out", out, "--steps", FOREVER, "--steps-file", length, *extra])
        return _life(result, out)

    try:
        with ThreadPoolExecutor(2) as pool:
            survivor = pool.submit(group, 0, 0)
            try:
                # Group 1 starts once group 0 has stepped, so that each of its starts has a peer to heal from.
                _first(folder / "group0_0.json.steps", lambda step: True, timeout, [survivor])
                lives = [group(1, life, "--die-after", after, "--die-where", where)
                         for life, (after, where) in enumerate(deaths)]
                last = pool.submit(group, 1, len(deaths))
                together = _first(folder / f"group1_{len(deaths)}.json.steps", lambda step: step["groups"] == 2,
                                  timeout, [survivor, last])
                if together:
                    length.write_text(str(together["done"] + margin))
            finally:
                if not length.exists():
                    length.write_text("0")  # whatever went wrong, the groups stop at their next step
            return Drill(survivor.result(), [*lives, last.result()])
    finally:
        lighthouse.shutdown()


def _first(steps_file: Path, wanted, timeout: float, groups):
    """The first step logged in ``steps_file`` that is ``wanted``; None if a group ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(g.done() for g in groups):
        found = [step for step in _logged(steps_file) if wanted(step)]
        if found:
            return found[0]
        time.sleep(0.02)
    return None


def _logged(steps_file: Path) -> list:
    try:
        lines = steps_file.read_text().split("\n")[:-1]  # a line still being written waits
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines]


def _life(result: LaunchResult, out: Path) -> Life:
    final = json.loads(out.read_text()) if out.exists() else {}
    return Life(result, _logged(Path(f"{out}.steps")), final.get("weights"), final.get("device"))
