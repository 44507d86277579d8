"""What ``ReduceOp.AVG`` computes on each backend, replayed on the CPU.

gloo sums the ranks' float tensors, then divides by the world size (measured here by
tests/test_lesson_facts.py). NCCL, which this machine cannot run, pre-multiplies: for float32
its ``ncclAvg`` becomes ``ncclDevPreMulSum`` with the scalar ``float(1.0/nRanks)`` (NCCL's
src/enqueue.cc), so each rank's input is scaled by 1/n rounded to float32 once, and the ring
adds the scaled inputs, starting from a different rank for each chunk. Chapters 03 and 11 teach
both; chapter 11's cell that checks FSDP2's average is run here on what NCCL would report.
"""

from itertools import permutations
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHAPTER_11 = ROOT / "notebooks" / "11_making_a_model_fit.ipynb"


def nccl_ring_average(inputs: list[torch.Tensor]) -> torch.Tensor:
    """NCCL's float32 AVG as a ring reduce-scatter computes it: element c of the result starts
    from rank c+1's scaled input and adds the next ranks' in ring order, ending with rank c's."""
    n = len(inputs)
    scale = torch.tensor(1.0 / n, dtype=torch.float32)  # the double 1/n, rounded to float32 once
    scaled = [x.to(torch.float32) * scale for x in inputs]
    out = torch.empty_like(scaled[0])
    for c in range(out.numel()):
        total = scaled[(c + 1) % n][c]
        for step in range(2, n + 1):
            total = total + scaled[(c + step) % n][c]
        out[c] = total
    return out


def gloo_average(inputs: list[torch.Tensor]) -> torch.Tensor:
    """gloo's AVG: the sum in rank order, then one division by the world size."""
    total = inputs[0].clone()
    for x in inputs[1:]:
        total = total + x
    return total / len(inputs)


def chapter_11_gradients(world_size: int = 3) -> list[torch.Tensor]:
    """rs_order.py's gradients: (1, 2, 2) rolled by the rank, so every element sums to 5."""
    return [torch.tensor([1.0, 2.0, 2.0]).roll(rank) for rank in range(world_size)]


def test_nccl_scales_by_one_third_rounded_to_float32():
    scale = torch.tensor(1.0 / 3, dtype=torch.float32).item()
    assert f"{scale:.10f}" == "0.3333333433"  # a little above 1/3: float32 rounds it up
    assert scale != 1.0 / 3


def test_chapter_11_example_gives_two_different_averages():
    g = chapter_11_gradients()
    nccl, gloo = nccl_ring_average(g), gloo_average(g)
    assert [f"{v:.10f}" for v in nccl.tolist()] == ["1.6666667461"] * 3
    assert [f"{v:.10f}" for v in gloo.tolist()] == ["1.6666666269"] * 3
    assert torch.equal(nccl, torch.nextafter(gloo, torch.full_like(gloo, 2.0)))  # the next float32 up


def test_nccl_average_does_not_depend_on_the_ring_order_here():
    """Chapter 11 states the NCCL value without naming an algorithm (ring, tree, PAT): for its
    example every order of the three scaled inputs gives the same bits."""
    scale = torch.tensor(1.0 / 3, dtype=torch.float32)
    values = [torch.tensor(v) * scale for v in (1.0, 2.0, 2.0)]
    sums = {((a + b) + c).item() for a, b, c in permutations(values)}
    assert [f"{v:.10f}" for v in sums] == ["1.6666667461"]


def test_two_ranks_average_alike_on_both_backends():
    """Chapter 11's fit.py compares DDP (divide, then sum) with FSDP2 (AVG) bit for bit on 2
    ranks: halving is exact, so NCCL, gloo and DDP all give the same bits."""
    g = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    ddp = g[0] / 2 + g[1] / 2
    assert torch.equal(nccl_ring_average(g), gloo_average(g))
    assert torch.equal(gloo_average(g), ddp)


def the_cell(cell_id: str) -> str:
    return next(c.source for c in nbformat.read(CHAPTER_11, as_version=4).cells if c.id == cell_id)


def run_cell_on(backend: str, average) -> None:
    """Run chapter 11's cell on the reports rs_order.py's ranks would send on ``backend`` if
    their FSDP2 average were ``average``."""
    g = chapter_11_gradients()
    reports = {r: {"mine": g[r], "averaged": average(g), "backend": backend} for r in range(3)}
    launched = SimpleNamespace(reports=reports)
    course = SimpleNamespace(launch=lambda *args, **kwargs: launched)
    exec(the_cell("c20c"), {"torch": torch, "spike_course": course, "WORKERS": Path("workers")})


@pytest.mark.parametrize("backend, average", [("gloo", gloo_average), ("nccl", nccl_ring_average)])
def test_chapter_11_cell_passes_on_each_backend(backend, average):
    run_cell_on(backend, average)


@pytest.mark.parametrize("backend, other", [("gloo", nccl_ring_average), ("nccl", gloo_average)])
def test_chapter_11_cell_refuses_the_other_backends_bits(backend, other):
    with pytest.raises(AssertionError, match=backend):
        run_cell_on(backend, other)
