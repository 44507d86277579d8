"""python failures_probe.py LOG PLAN SCRIPT ARGS...: run SCRIPT as ``__main__`` (as ``python
SCRIPT ARGS...`` would), strike it with the faults PLAN lists, and record its training state
around every optimizer step; what the chapter 15 checks' ranks run.

PLAN is a JSON list of faults, each with the ``rank`` it strikes, the ``step`` (optimizer steps
counted from 0) and ``what``:

* ``"slow"``: from step ``step`` to step ``until`` (excluded) the rank's compute takes ``times``
  its usual compute longer (a sleep as its first forward of the step begins), as a throttled
  GPU or a busy host would make it. Its compute is timed from the previous optimizer step to
  the step's first all-reduce (all the script does between the two, more than a watch's clock
  can hold), less the probe's sleep; the usual one is the median of its steps so far from step
  1, taken when its first slowdown begins. A multiple, not seconds: a host busy with other work
  stretches the compute several times, and slows the ranks as much, relative to their pace, as
  an idle one;
* ``"seed"``: before step 0 the rank's weights are drawn again from another seed, as a rank
  seeded differently would hold them;
* ``"weight"`` or ``"momentum"``: right after step ``step``, bit ``bit`` of element ``index`` of
  the rank's ``tensor``-th parameter, or of its momentum buffer, is flipped, as a failing
  memory cell would flip it.

One JSON line per reading in ``LOG/rank{R}.jsonl``, each with the step and a digest of the
weights and one of the optimizer's state: ``"stepped"`` right after step k, before its fault;
``"faulted"`` right after the fault; ``"guarded"`` as step k + 1 begins, after whatever the
script did between the two steps (its guard); ``"raised"`` (no digests) if the script ended with
an exception, and whether its own code raised it or something it called. The plan leaves
``sys.argv`` before the script runs, so the script cannot read it.

Standard library, torch and numpy (torch's) only. Recording reads the state and never changes it.
"""

import hashlib
import json
import os
import runpy
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        # The bytes as numpy's buffer (torch loads numpy): a Python list of them took 14 ms a
        # reading of this chapter's model, four readings a step, longer than the step's compute.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def _parameters(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _momenta(optimizer):
    return [optimizer.state[p]["momentum_buffer"] for p in _parameters(optimizer) if "momentum_buffer" in optimizer.state[p]]


class _Probe:
    def __init__(self, log: str, plan: list, rank: int):
        self.log, self.plan, self.steps = log, [f for f in plan if f["rank"] == rank], 0
        self.slowed = -1  # the last step whose compute was slowed: once a step, at its first forward
        self.free_at, self.computed = None, []  # when the last step ended; each step's compute seconds
        self.slept = 0.0
        self.usual = None  # the median compute, taken when the first slowdown begins

    def record(self, optimizer, when: str, step: int) -> None:
        reading = {"step": step, "when": when, "weights": _digest(_parameters(optimizer)),
                   "state": _digest(_momenta(optimizer))}
        with open(self.log, "a") as out:
            out.write(json.dumps(reading) + "\n")

    def before_forward(self, module, inputs) -> None:
        if self.slowed == self.steps:
            return
        self.slowed = self.steps
        times = sum(f["times"] for f in self.plan if f["what"] == "slow" and f["step"] <= self.steps < f["until"])
        if times:
            if self.usual is None:
                self.usual = statistics.median(self.computed)  # the plans slow no rank before step 2
            self.slept = times * self.usual
            time.sleep(self.slept)

    def before_all_reduce(self) -> None:
        if self.free_at is not None:  # the step's first: its gradients are computed
            self.computed.append(time.perf_counter() - self.free_at - self.slept)
            self.free_at, self.slept = None, 0.0

    def before_step(self, optimizer, args, kwargs) -> None:
        if self.steps:
            self.record(optimizer, "guarded", self.steps - 1)
        else:
            for fault in self.plan:
                if fault["what"] == "seed":
                    generator = torch.Generator().manual_seed(12345)
                    with torch.no_grad():
                        for p in _parameters(optimizer):
                            p.copy_(torch.randn(p.shape, generator=generator).to(p.device) * p.std())

    def after_step(self, optimizer, args, kwargs) -> None:
        self.free_at = time.perf_counter()
        step, self.steps = self.steps, self.steps + 1
        self.record(optimizer, "stepped", step)
        flips = [f for f in self.plan if f["step"] == step and f["what"] in ("weight", "momentum")]
        for fault in flips:
            tensors = _parameters(optimizer) if fault["what"] == "weight" else _momenta(optimizer)
            with torch.no_grad():
                tensors[fault["tensor"]].view(-1).view(torch.int32)[fault["index"]] ^= 1 << fault["bit"]
        if flips:
            self.record(optimizer, "faulted", step)


def main() -> None:
    log, plan, script, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    probe = _Probe(os.path.join(log, f"rank{rank}.jsonl"), json.loads(plan), rank)
    if any(fault["what"] == "slow" for fault in probe.plan):
        register_module_forward_pre_hook(probe.before_forward)
        all_reduce = dist.all_reduce

        def timed_all_reduce(*args, **kwargs):
            probe.before_all_reduce()
            return all_reduce(*args, **kwargs)
        dist.all_reduce = timed_all_reduce  # the script looks it up at each call (dist.all_reduce)
    register_optimizer_step_pre_hook(probe.before_step)
    register_optimizer_step_post_hook(probe.after_step)
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it: the script's own imports
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as error:  # noted, then raised on: the rank fails as it would have
        # Raised by the script's own code (a guard that stops the job), or deeper (torch, a bug)?
        by_script = traceback.extract_tb(error.__traceback__)[-1].filename == script
        with open(probe.log, "a") as out:
            out.write(json.dumps({"step": probe.steps - 1, "when": "raised", "by_script": by_script}) + "\n")
        raise


if __name__ == "__main__":
    main()
