"""python ring_probe.py LOG SCRIPT [SCRIPT ...]: load each SCRIPT as a module (not as ``__main__``:
its own demonstration does not run), call its ``matmul_reduce_scatter`` on inputs drawn here, and
record outside its reach what it did and what it returned. What chapter 16's exercise 4 check's
ranks run; several scripts, one after the other in one launch, are the tests' planted mistakes.

``LOG/{i}/rank{R}.json`` for the i-th script, written once its function has returned:

* ``events``: in order, ``"send"`` and ``"recv"`` (a transfer issued, seen by a dispatch mode as
  c10d's ``send`` and ``recv_``; ``"empty send"``, ``"empty recv"`` where it moves no byte), ``"wait"`` (a handle waited for: ``Work.wait``, which blocking
  sends and receives call too) and ``"product"`` (a matrix product: ``mm``, ``addmm``, ``bmm``);
* ``collectives``: any other c10d operation the answer ran (an all-reduce, a reduce-scatter);
* ``sent_bytes``: the bytes of every tensor it sent;
* ``tampered``: what of the probe's own functions, or of the torch and json functions it judges
  with, the answer replaced (the name of each); such an answer is recorded, not judged;
* ``changed``: whether it changed its inputs;
* ``shape`` of what it returned, and, where that is the rank's rows: ``error``, the largest
  distance from the exact sum of the rank's rows over the bound that float32 allows, and which
  wrong sum it is instead: another rank's rows (``rows_of``), or the right rows with one rank's
  partial product missing (``missing``) or counted twice (``twice``).

The ranks run on the CPU with gloo, also on a GPU node. Standard library, torch and
``spike_course.runtime`` only.
"""

import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from spike_course import runtime

ROWS, FEATURES, OUTPUTS = 64, 128, 96  # rows of the sequence a rank owns; its hidden features; outputs
TRANSFERS = {"c10d.send.default": "send", "c10d.recv_.default": "recv"}
PRODUCTS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
WORK = torch._C._distributed_c10d.Work


class _Recorder(TorchDispatchMode):
    """What the answer runs on this thread, in order: transfers issued, products, collectives."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in TRANSFERS:
            size = sum(t.numel() * t.element_size() for t in args[0])
            # an empty transfer hides nothing: it is not counted as one in flight
            self.record["events"].append(TRANSFERS[name] if size else "empty " + TRANSFERS[name])
            if name == "c10d.send.default":
                self.record["sent_bytes"] += size
        elif name in PRODUCTS:
            self.record["events"].append("product")
        elif name.startswith("c10d.") and name != "c10d.barrier.default":
            self.record["collectives"].append(name.split(".")[1])
        return func(*args, **(kwargs or {}))


def _inputs(rank, device):
    draw = torch.Generator().manual_seed(1600 + rank)
    h = torch.randn(ROWS * dist.get_world_size(), FEATURES, generator=draw).to(device)
    w = (torch.randn(FEATURES, OUTPUTS, generator=draw) / FEATURES ** 0.5).to(device)
    return h, w


def _sums(h, w, rank, world):
    """Every rank's partial products (float64) for this rank's rows, their exact sum, the exact
    sums of every rank's rows, and the bound float32 allows: each partial product within
    gamma_K of its magnitudes, their sum of world terms within gamma_(world-1) (any order)."""
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    exact = (h.double() @ w.double())
    everyone = torch.empty(world * exact.shape[0], exact.shape[1], dtype=torch.float64, device=h.device)
    dist.all_gather_single(everyone, exact)
    everyone = everyone.view(world, *exact.shape)
    magnitude = (h.abs().double() @ w.abs().double())
    dist.all_reduce(magnitude)
    gamma = lambda n: n * 2.0 ** -24 / (1 - n * 2.0 ** -24)  # noqa: E731
    bound = (gamma(FEATURES) + gamma(world - 1) * (1 + gamma(FEATURES))) * magnitude[rows]
    sums = everyone.sum(0)
    return everyone[:, rows], sums, bound


def _judge(out, partials, sums, bound, rank, world) -> dict:
    """How far the answer's rows are from the right sum, and which wrong sum they are."""
    rows = lambda q: sums[q * ROWS:(q + 1) * ROWS]  # noqa: E731
    distance = lambda expected: float(((out.double() - expected).abs() / bound).max())  # noqa: E731
    found = {"error": distance(rows(rank))}
    if found["error"] > 1:
        found["rows_of"] = next((q for q in range(world) if q != rank and distance(rows(q)) <= 1), None)
        found["missing"] = next((q for q in range(world) if distance(rows(rank) - partials[q]) <= 1), None)
        found["twice"] = next((q for q in range(world) if distance(rows(rank) + partials[q]) <= 1), None)
    return found


def _watched() -> dict:
    """What the probe records and judges with: its own functions and classes (and what they
    hold), and the torch and json functions they call. The answer runs in this process; one that
    replaced any of these is named (``tampered``), not judged."""
    found = {f"probe.{name}": value for name, value in vars(sys.modules[__name__]).items() if callable(value)}
    found.update({f"_Recorder.{name}": value for name, value in vars(_Recorder).items()})
    found.update({f"torch.{name}": getattr(torch, name) for name in ("equal", "empty", "randn", "Generator")})
    found.update({f"torch.Tensor.{name}": getattr(torch.Tensor, name)
                  for name in ("abs", "double", "max", "clone", "view", "sum", "__sub__", "__add__", "__truediv__",
                               "__matmul__", "__float__", "numel", "element_size")})
    found.update({f"dist.{name}": getattr(dist, name) for name in ("all_gather_single", "all_reduce", "barrier")})
    found["json.dump"] = json.dump
    return found


def _run(path, log, rank, world, device, watched) -> None:
    function = runpy.run_path(path, run_name="ring_probe_answer")["matmul_reduce_scatter"]
    h, w = _inputs(rank, device)
    partials, sums, bound = _sums(h, w, rank, world)
    given = (h.clone(), w.clone())
    record = {"events": [], "collectives": [], "sent_bytes": 0}
    original_wait, waited = WORK.wait, []

    def wait(work, *args, **kwargs):
        record["events"].append("wait")
        if any(work is done for done in waited):
            return True  # a gloo handle waited for again blocks until a timeout; NCCL's returns
        waited.append(work)
        return original_wait(work, *args, **kwargs)

    WORK.wait = wait
    try:
        with _Recorder(record):
            out = function(*given)
    finally:
        WORK.wait = original_wait
    replaced = sorted(name for name, value in _watched().items() if watched.get(name) is not value)
    if replaced:
        record["tampered"] = replaced  # nothing judged with what the answer replaced
        return _write(record, log, rank, watched["json.dump"])
    record["changed"] = not (torch.equal(given[0], h) and torch.equal(given[1], w))
    record["shape"] = list(out.shape) if isinstance(out, torch.Tensor) else repr(out)[:80]
    if isinstance(out, torch.Tensor) and record["shape"] == [ROWS, OUTPUTS]:
        record.update(_judge(out, partials, sums, bound, rank, world))
    dist.barrier()  # every rank done with this answer before the next one's transfers begin
    _write(record, log, rank, json.dump)


def _write(record, log, rank, dump) -> None:
    os.makedirs(log, exist_ok=True)
    with open(os.path.join(log, f"rank{rank}.json"), "w") as out_file:
        dump(record, out_file)


def main() -> None:
    log, *scripts = sys.argv[1:]
    del sys.argv[1:]  # the answer sees no argument of the probe's
    ctx = runtime.setup(device="cpu", seed=0)
    watched = _watched()  # before any answer is loaded: its module code runs at loading
    for number, script in enumerate(scripts):
        _run(script, os.path.join(log, str(number)), ctx.rank, ctx.world_size, ctx.device, watched)
    runtime.teardown()


if __name__ == "__main__":
    main()
