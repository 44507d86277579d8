"""Facts about PyTorch that the lectures state, checked on the installed version.

A lecture that says what a backend can or cannot do should fail here, quickly, the day an
upgrade changes it, rather than mislead a learner.
"""

import pytest

from spike_course import launch

pytestmark = pytest.mark.processes  # the tests start ranks

AVERAGE = """
import torch
import torch.distributed as dist

from spike_course import runtime

ctx = runtime.setup()
mean = torch.tensor([float(ctx.rank + 1)], device=ctx.device)  # rank 0: 1.0, rank 1: 2.0
dist.all_reduce(mean, op=dist.ReduceOp.AVG)
# reduce-scatter: rank r keeps the mean of everyone's element r (FSDP2 averages gradients so)
pieces = torch.tensor([1.0, 10.0], device=ctx.device) + ctx.rank
mine = torch.empty(1, device=ctx.device)
dist.reduce_scatter_single(mine, pieces, op=dist.ReduceOp.AVG)
runtime.report(backend=ctx.backend, all_reduce=mean.item(), reduce_scatter=mine.item())
runtime.teardown()
"""


def test_gloo_averages_with_reduce_op_avg(worker):
    """Chapter 03: gloo has ReduceOp.AVG for all_reduce and reduce_scatter (torch 2.14)."""
    result = launch(worker(AVERAGE), nproc=2, echo=False)
    assert {r["backend"] for r in result.reports.values()} == {"gloo"}
    assert [result.reports[r]["all_reduce"] for r in range(2)] == [1.5, 1.5]  # (1 + 2) / 2
    assert [result.reports[r]["reduce_scatter"] for r in range(2)] == [1.5, 10.5]
