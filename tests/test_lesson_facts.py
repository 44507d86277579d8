"""Facts about PyTorch that the lectures state, checked on the installed version.

A lecture that says what a backend can or cannot do should fail here, quickly, the day an
upgrade changes it, rather than mislead a learner: gloo's ReduceOp.AVG (chapter 03), the
order in which FSDP2 averages gradients (chapter 11), the import torch.distributed.checkpoint
needs (chapter 06), the flight recorder's older variable names (chapter 10) and ZeRO-1's
traffic in the cost model (chapter 06). Then what the course says about clusters: the
gradients' dtype that DDP reduces under autocast, where context_parallel_unshard lives and
the pieces of async TP (chapters 05, 11, 12), the torchft pieces chapter 15 uses, what chapter 16 says FSDP2 does and FP8 is, and the numbers that chapters 05, 08, 12 and
13 compute from the cost model, so that a change of the model that moves them fails here.
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


DDP_GRADIENT_DTYPE = """
import os, tempfile
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
seen = []
def record(state, bucket):  # the bucket DDP would all-reduce, unchanged
    seen.append(bucket.buffer().dtype)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done
model = DDP(torch.nn.Linear(8, 8))
model.register_comm_hook(None, record)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(torch.randn(4, 8))
out.float().sum().backward()
print("computed", out.dtype, "reduced", sorted({str(d) for d in seen}))
dist.destroy_process_group()
"""


def test_ddp_reduces_float32_gradients_under_bf16_autocast():
    """Chapters 08, 11 and 13 (costmodel.GRAD_BYTES = 4): autocast computes in bf16, but the
    gradients of float32 parameters are float32, and those are the buckets DDP all-reduces."""
    done = fresh_python(DDP_GRADIENT_DTYPE)
    assert done.returncode == 0, done.stderr
    assert "computed torch.bfloat16 reduced ['torch.float32']" in done.stdout, done.stdout
    assert costmodel.GRAD_BYTES == torch.tensor([], dtype=torch.float32).element_size()


def test_context_parallel_unshard_is_not_public_in_this_torch():
    """Chapter 12 imports it from _context_parallel: the public package exports only
    context_parallel, and the _attention module is a stub kept for older imports."""
    import inspect

    import torch.distributed.tensor.experimental as experimental
    from torch.distributed.tensor.experimental import _attention, _context_parallel

    assert "context_parallel" in experimental.__all__
    assert not hasattr(experimental, "context_parallel_unshard")
    assert callable(_context_parallel.context_parallel_unshard) and callable(_context_parallel.set_rotate_method)
    assert "Backward compatibility stub" in inspect.getsource(_attention)


def test_async_tp_pieces_are_where_chapter_05_says():
    """Async TP: an inductor pass (off by default) fuses all-gather + matmul and matmul +
    reduce-scatter into symmetric-memory ops; it has no all-reduce pattern to fuse."""
    import inspect

    import torch._inductor.config as inductor
    import torch.distributed._symmetric_memory  # noqa: F401  (registers the symm_mem ops)
    from torch._inductor.fx_passes import micro_pipeline_tp

    assert inductor._micro_pipeline_tp is False
    assert hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")
    assert hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter")
    source = inspect.getsource(micro_pipeline_tp.micro_pipeline_tp_pass)
    assert "find_all_gather_patterns" in source and "find_reduce_scatter_patterns" in source


# The numbers the cluster chapters state, from the cost model they compute them with.
CH13_TARGET = dict(layers=32, dim=4096, hidden=11008, vocab=32000, max_seq=4096)  # chapter 13's 7B-class model


def break_even(psi, seconds):
    """Tokens per GPU per step at which 6 psi tokens at 40% of a B200 take `seconds`."""
    return seconds * costmodel.B200_BF16_FLOPS * 0.4 / (6 * psi)


def test_a_ring_over_whole_dgx_nodes_has_every_nic():
    """Chapter 08: 400 GB/s per rank over whole nodes (2.25 times less than NVLink, not 18)."""
    nvlink, one_nic = costmodel.link_bandwidth("nvlink5"), costmodel.link_bandwidth("ib_ndr")
    assert nvlink / costmodel.group_bandwidth(64) == pytest.approx(2.25)
    assert nvlink / one_nic == pytest.approx(18)
    assert costmodel.group_bandwidth(8, ranks_per_node=1) == one_nic


def test_chapter_13_break_evens_over_eight_nodes():
    """Was DDP 13,256 and FSDP 17,853 tokens per GPU (one 50 GB/s NIC, bf16 gradients)."""
    psi = costmodel.transformer_params(*CH13_TARGET.values())
    nvlink, nodes = costmodel.link_bandwidth("nvlink5"), costmodel.group_bandwidth(64)
    evens = {"ddp 8": break_even(psi, costmodel.dp_comm_time(psi, 8, nvlink)),
             "ddp 64": break_even(psi, costmodel.dp_comm_time(psi, 64, nodes)),
             "fsdp 64": break_even(psi, costmodel.fsdp_comm_time(psi, 64, nodes, units=32)),
             "fsdp 512": break_even(psi, costmodel.fsdp_comm_time(psi, 512, nodes, units=32))}
    assert {k: round(v, -2) for k, v in evens.items()} == {"ddp 8": 1500, "ddp 64": 5800, "fsdp 64": 3100,
                                                           "fsdp 512": 4100}
    # a 4M-token batch over 512 GPUs (8,192 each) hides FSDP's traffic, over 1,024 (4,096 each) not
    fsdp_1024 = break_even(psi, costmodel.fsdp_comm_time(psi, 1024, costmodel.group_bandwidth(1024), units=32))
    assert 4 * 2**20 / 512 > evens["fsdp 512"] and 4 * 2**20 / 1024 < fsdp_1024


def test_chapter_13_calculator_example():
    """7B on 64 GPUs, one 4096-token sequence each: FSDP hides at tp 1 (was 642 ms exposed);
    at tp 8 each replica's shard crosses one NIC and about 110 ms wait per step."""
    params = 7e9
    layers, dim = costmodel.transformer_shape(params)
    compute_tp1 = costmodel.compute_time(params, 4096)
    fsdp_tp1 = costmodel.fsdp_comm_time(params, 64, costmodel.group_bandwidth(64), units=layers)
    assert round(compute_tp1 * 1e3) == 191 and round(fsdp_tp1 * 1e3) == 144
    compute_tp8 = costmodel.compute_time(params, 4096 / 8)
    fsdp_tp8 = costmodel.fsdp_comm_time(params / 8, 8, costmodel.group_bandwidth(8, ranks_per_node=1), units=layers)
    tp_comm = costmodel.tp_comm_time(4096, dim, layers, 8, costmodel.link_bandwidth("nvlink5"))
    exposed = fsdp_tp8 - compute_tp8 + tp_comm
    assert round(exposed * 1e3) == 110
    hours = {tp: (compute + wait) * 1e12 / (4096 * 64 // tp) / 3600
             for tp, compute, wait in ((1, compute_tp1, 0.0), (8, compute_tp8, exposed))}
    assert (round(hours[1]), round(hours[8])) == (203, 1135)


def test_tensor_parallel_across_nodes():
    """Chapter 13: tp 16 over two whole nodes costs about twice the compute (was 'more than
    ten times'); chapter 05: a tp group halved over two nodes is 4.5 to 18 times slower."""
    psi = costmodel.transformer_params(*CH13_TARGET.values())
    compute = costmodel.compute_time(psi, 4096) / 16
    comm = costmodel.tp_comm_time(4096, 4096, 32, 16, costmodel.group_bandwidth(16))
    assert round(comm / compute, 1) == 2.1
    nvlink = costmodel.link_bandwidth("nvlink5")
    assert [nvlink / costmodel.group_bandwidth(tp, ranks_per_node=tp // 2) for tp in (2, 8)] == [18.0, 4.5]


def test_grouped_query_attention_lets_context_parallel_cross_nodes():
    """Chapter 12: a ring step over one NIC hides from F m b / 2B tokens per rank, 18,000 with
    full attention, times KV heads / heads: 1,125 for Llama 3 405B (128 heads, 8 KV)."""
    full = costmodel.B200_BF16_FLOPS * 0.4 * 2 / (2 * costmodel.link_bandwidth("ib_ndr"))
    assert full == pytest.approx(18_000) and full * 8 / 128 == pytest.approx(1_125)
    assert 131_072 // 16 > 7 * full * 8 / 128  # Llama 3 405B's 8,192 tokens per rank over CP = 16


def test_the_torchft_pieces_chapter_15_names():
    """Chapter 15.3 says a returning group heals over HTTP by default (torchft 0.2) and that
    torchft has an NCCL process group for GPUs; 15.4 names DiLoCo with model fragments and a
    fragment_sync_delay, and LocalSGD, over the same Manager."""
    import inspect

    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: F401
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.coordination import LighthouseServer  # noqa: F401
    from torchft.local_sgd import DiLoCo, LocalSGD  # noqa: F401

    init = inspect.getsource(Manager.__init__)
    assert "checkpoint_transport = HTTPTransport" in init and HTTPTransport.__name__ == "HTTPTransport"
    assert {"model_fragments", "fragment_sync_delay", "outer_optimizer"} <= set(inspect.signature(DiLoCo).parameters)


def test_what_chapter_16_says_fsdp2_does():
    """Chapter 16.1 says FSDP2 reduce-scatters float32 gradients with ReduceOp.AVG (one division,
    inside the collective), frees its buffers with untyped_storage().resize_(0), keeps the root's
    parameters after the forward, and asks for more prefetching with two methods."""
    import inspect

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_state

    class TwoRanks:  # all the function asks of a process group
        def size(self):
            return 2

    pre, post, reduce_scatter_op, _ = _fsdp_collectives._get_gradient_divide_factors(TwoRanks(), None, torch.float32)
    assert (pre, post, reduce_scatter_op) == (None, None, torch.distributed.ReduceOp.AVG)
    assert "resize_(0)" in inspect.getsource(_fsdp_param.free_storage)
    assert "For the root, do not reshard after forward" in inspect.getsource(_fsdp_state)
    assert {"set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"} <= set(dir(FSDPModule))


def test_what_chapter_16_says_of_the_fp8_formats():
    """Chapter 16.2's text: e4m3 spans 2^-9 (about 0.002) to 448 with one NaN per sign and no
    infinity (448 instead of IEEE-style 240), a relative step of 2^-3 and a smallest normal of 2^-6;
    e5m2 reaches 57344 and has infinities; on the CPU an e4m3 cast clamps to 448 (infinity too)
    and an e5m2 cast past its largest value gives infinity."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    every = torch.arange(256, dtype=torch.uint8)
    values = every.view(e4m3).float()
    finite = values[values.isfinite()]
    smallest = finite[finite > 0].min().item()
    assert (torch.finfo(e4m3).max, smallest, torch.finfo(e4m3).smallest_normal) == (448, 2**-9, 2**-6)
    assert torch.finfo(e4m3).eps == 2**-3 and int(values.isnan().sum()) == 2 and not values.isinf().any()
    # IEEE-style e4m3 keeps the exponent field 1111 for infinities and NaNs: the rest tops out at 240
    assert values[(every >> 3) & 0b1111 < 0b1111].abs().max() == 240
    assert torch.finfo(e5m2).max == 57344 and int(every.view(e5m2).float().isinf().sum()) == 2
    assert torch.tensor([449.0, 1e4, float("inf"), -1e4]).to(e4m3).float().tolist() == [448, 448, 448, -448]
    assert torch.tensor([61440.0, 1e6]).to(e5m2).float().isinf().all()


@pytest.fixture
def fake_world():
    """This process as rank 0 of a fake process group of 2 ranks (nothing is sent), for the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    torch.distributed.destroy_process_group()


def test_what_chapter_16_says_of_torch_s_zero_bubble_schedules(fake_world):
    """Chapter 16.3's text: ZBV and DualPipeV refuse any number of stages a rank but two, and the
    schedules that run I and W apart refuse a stage compiled with torch.compile."""
    from torch.distributed.pipelining import PipelineStage, schedules

    def stage(index, module=None):
        return PipelineStage(torch.nn.Linear(1, 1) if module is None else module, index, 4, torch.device("cpu"))

    for schedule in (schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV):
        with pytest.raises(ValueError, match="requires exactly 2 stages per rank"):
            schedule([stage(0)], 4, loss_fn=lambda out, target: out.sum())
    for schedule in (schedules.ScheduleInterleavedZeroBubble, schedules.ScheduleZBVZeroBubble,
                     schedules.ScheduleDualPipeV):
        with pytest.raises(RuntimeError, match="not supported with stage modules that have used torch.compile"):
            schedule([stage(0, torch.compile(torch.nn.Linear(1, 1))), stage(3)], 4,
                     loss_fn=lambda out, target: out.sum())


def test_what_chapter_16_says_of_async_tp_s_compiler_pass(fake_world):
    """Chapter 16.4's text: enable_symm_mem_for_group says it is deprecated and need not be called,
    yet async TP's pass fuses an all-gather with its matrix product only after that call (the
    lecture shows it with torch's test switch, since the real call holds for the process)."""
    import warnings

    import torch.distributed._functional_collectives as funcol
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass
    from torch.distributed import _symmetric_memory
    from torch.fx.experimental.proxy_tensor import make_fx

    def fused(group):
        def block(x_shard, w):
            return funcol.all_gather_single(x_shard, 0, group) @ w

        graph = make_fx(block, tracing_mode="fake")(torch.randn(64, 32), torch.randn(32, 16)).graph
        micro_pipeline_tp_pass(graph)
        return any("fused_all_gather_matmul" in str(node.target) for node in graph.nodes)

    group = torch.distributed.new_group([0, 1])  # a group of this test's own to enable
    assert not fused(group)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _symmetric_memory.enable_symm_mem_for_group(group.group_name)
    assert "There is no need to call this function anymore" in str(said[0].message)
    assert fused(group)


def test_what_chapter_16_says_of_compiling_fsdp2():
    """Chapter 16.5's text: FSDP2 wraps its hooks in torch._dynamo.disable ("skipping FSDP hooks"),
    Module.compile() compiles __call__ (which runs the hooks), and the compiler's bucketing and
    reordering of collectives are off by default."""
    import inspect

    from torch._inductor import config as inductor
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_state

    assert 'reason="skipping FSDP hooks"' in inspect.getsource(_fsdp_common._dynamo_disable)
    for hook in ("_pre_forward", "_post_forward"):
        assert "@_dynamo_disable" in inspect.getsource(getattr(_fsdp_state.FSDPState, hook))
    assert "torch.compile(self._call_impl" in inspect.getsource(torch.nn.Module.compile)
    assert (inductor.bucket_all_gathers_fx, inductor.reorder_for_compute_comm_overlap) == ("none", False)


GLOO_FLOAT8 = """
import os, tempfile
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
shard = torch.ones(4).to(torch.float8_e4m3fn)
try:
    dist.all_gather_single(torch.empty(4, dtype=torch.float8_e4m3fn), shard)
    print("gathered as float8")
except RuntimeError as error:
    print("refused:", error)
out = torch.empty(4, dtype=torch.float8_e4m3fn)
dist.all_gather_single(out.view(torch.uint8), shard.view(torch.uint8))
print("as uint8 equal:", torch.equal(out.view(torch.uint8), shard.view(torch.uint8)))
dist.destroy_process_group()
"""


def test_gloo_refuses_float8_and_gathers_its_bytes_as_uint8():
    """Chapter 16.2's torchao worker: gloo has no FP8 type, so FSDP2's FP8 all-gather fails on
    it ('Invalid scalar type'); the worker gathers the same bytes viewed as uint8 there."""
    done = subprocess.run([sys.executable, "-c", GLOO_FLOAT8], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: Invalid scalar type" in done.stdout and "as uint8 equal: True" in done.stdout, done.stdout
