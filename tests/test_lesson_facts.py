"""Facts about PyTorch that the lectures state, checked on the installed version.

A lecture that says what a backend can or cannot do should fail here, quickly, the day an
upgrade changes it, rather than mislead a learner: gloo's ReduceOp.AVG (chapter 03), the
order in which FSDP2 averages gradients (chapter 11), the import torch.distributed.checkpoint
needs (chapter 06), the flight recorder's older variable names (chapter 10) and ZeRO-1's
traffic in the cost model (chapter 06).
"""

import os
import subprocess
import sys

import pytest
import torch

from spike_course import costmodel, launch

pytestmark = pytest.mark.processes  # the tests start ranks or fresh interpreters

AVERAGE = """
import torch
import torch.distributed as dist

from spike_course import runtime

ctx = runtime.setup(device="cpu")  # gloo, also on a GPU node: the fact is gloo's
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


RS_ORDER = '''
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from spike_course import runtime

ctx = runtime.setup(seed=0)
model = torch.nn.Linear(3, 1, bias=False).to(ctx.device)  # weight (1, 3): dim 0 pads to 3 ranks
fully_shard(model, mesh=init_device_mesh(ctx.device.type, (ctx.world_size,)))
x = torch.tensor([[1.0, 2.0, 2.0]]).roll(ctx.rank, dims=1).to(ctx.device)
model(x).sum().backward()  # d/dw of w.x is x: rank r's gradient is (1, 2, 2) rolled by r
runtime.report(mine=x.cpu(), averaged=model.weight.grad.full_tensor().cpu(), backend=ctx.backend)
runtime.teardown()
'''


def test_fsdp2_averages_float32_gradients_as_its_backend_averages(tmp_path):
    """Chapter 11: gloo sums, then divides; on a GPU node NCCL scales each input by 1/3 in
    float32, then sums (tests/test_backend_arithmetic.py replays it)."""
    script = tmp_path / "rs_order.py"
    script.write_text(RS_ORDER)
    result = launch(script, nproc=3, echo=False)
    g = [result.reports[r]["mine"] for r in range(3)]
    sum_then_divide = (g[0] + g[1] + g[2]) / 3
    third = torch.tensor(1 / 3)
    scaled_then_sum = g[0] * third + g[1] * third + g[2] * third
    assert not torch.equal(sum_then_divide, scaled_then_sum)  # the values tell the orders apart
    expected = {"gloo": sum_then_divide, "nccl": scaled_then_sum}[result.reports[0]["backend"]]
    for rank in range(3):
        assert torch.equal(result.reports[rank]["averaged"], expected)


def test_fsdp2_asks_for_avg_without_pre_or_post_divide_for_float32():
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    class Group:  # what the function reads of a process group
        def size(self):
            return 3

    pre, post, rs_op, _ = _get_gradient_divide_factors(Group(), None, torch.float32, "cpu")
    assert (pre, post, rs_op) == (None, None, ReduceOp.AVG)
    pre, post, rs_op, _ = _get_gradient_divide_factors(Group(), None, torch.float16, "cpu")
    assert rs_op == ReduceOp.SUM and pre is not None and post is not None  # fp16 splits the division


def fresh_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_dist_checkpoint_needs_its_own_import():
    done = fresh_python("import torch.distributed as dist\n"
                        "try:\n    dist.checkpoint\nexcept AttributeError as e:\n    print('AttributeError', e)\n"
                        "import torch.distributed.checkpoint as dcp\n"
                        "from torch.distributed.checkpoint.state_dict import get_state_dict\n"
                        "print('after import', dist.checkpoint is dcp)\n")
    assert done.returncode == 0, done.stderr
    assert "AttributeError module 'torch.distributed' has no attribute 'checkpoint'" in done.stdout
    assert "after import True" in done.stdout


FLIGHT_RECORDER = """
import tempfile, pickle, os
import torch, torch.distributed as dist
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
for _ in range(10):
    dist.all_reduce(torch.ones(1))
entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", [])
print("entries", len(entries))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("env, kept", [
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "4"}, 4),                               # the older name alone
    ({"TORCH_FR_BUFFER_SIZE": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "4"}, 3),  # the new name wins
])
def test_flight_recorder_reads_the_older_buffer_size_name(env, kept):
    clean = {k: "" for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    base = {k: v for k, v in os.environ.items() if k not in clean}
    done = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER], capture_output=True, text=True,
                          timeout=120, env={**base, **env})
    assert done.returncode == 0, done.stderr
    assert f"entries {kept}" in done.stdout, done.stdout + done.stderr


def test_flight_recorder_variable_names_in_the_installed_torch():
    """The older file-name variable is still read as an alias; the dump switch has one name."""
    import mmap

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    libraries = [os.path.join(lib, n) for n in os.listdir(lib) if n in ("libtorch_cpu.so", "libtorch_cuda.so")]
    if not libraries:
        pytest.skip("no libtorch_cpu.so / libtorch_cuda.so to read")

    def found(name):
        for path in libraries:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name + b"\0") >= 0:
                    return True
        return False

    for name in (b"TORCH_FR_DUMP_TEMP_FILE", b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE", b"TORCH_FR_BUFFER_SIZE",
                 b"TORCH_NCCL_TRACE_BUFFER_SIZE"):
        assert found(name), name
    assert not found(b"TORCH_FR_DUMP_ON_TIMEOUT")


def test_zero1_traffic_3_psi_by_hand_2_psi_with_reduce_scatter():
    n, nbytes, bw = 64, 2 * 7.5e9, 1.0

    def moved(*ops):
        return sum(costmodel.collective_time(op, nbytes, n, bw, alpha=0) for op in ops)

    ddp = moved("all_reduce")
    assert moved("all_reduce", "all_gather") / ddp == pytest.approx(1.5, abs=1e-12)
    assert moved("reduce_scatter", "all_gather") / ddp == pytest.approx(1.0, abs=1e-12)


def test_nvlink_vs_pcie_all_reduce_ratio():
    t = {link: costmodel.collective_time("all_reduce", 2**30, 8, costmodel.link_bandwidth(link))
         for link in ("nvlink5", "pcie5")}
    assert 13.9 < t["pcie5"] / t["nvlink5"] < 14.1
