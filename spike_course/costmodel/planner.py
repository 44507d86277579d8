"""Closed-form step-time predictions and the parallelism decision guide (chapter 08):
each strategy's memory, communication and compute per step on DGX B200 nodes."""

from __future__ import annotations

from .collectives import GPUS_PER_NODE, NCCL_ALPHA, NICS_PER_NODE, collective_time, group_bandwidth, link_bandwidth
from .memory import B200_MEMORY, zero_memory


# Assumptions of the predictions, stated once so a learner can change them.
B200_BF16_FLOPS = 2.25e15  # dense bf16 peak of one B200; datasheets' bigger figures assume sparsity
DDP_BUCKET_BYTES = 25 * 2**20  # DDP all-reduces gradients in buckets of bucket_cap_mb=25
ACTIVATION_HEADROOM = 0.75     # model states may use this share of a GPU; activations need the rest
# Bytes per gradient on the wire. Chapter 11's recipe keeps float32 parameters and computes in
# bf16, and the gradients stay float32: DDP all-reduces them so (under autocast too) unless a
# compression hook (bf16_compress_hook) is registered, and FSDP2 with
# MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) reduce-scatters
# them so, while it gathers the parameters in bf16 (2 bytes).
GRAD_BYTES = 4


def dp_comm_time(num_params: float, world_size: int, bandwidth: float, grad_bytes: float = GRAD_BYTES,
                 alpha: float = NCCL_ALPHA, bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """DDP: all-reduce every gradient once per step, in buckets (each pays its latency)."""
    from math import ceil

    nbytes = num_params * grad_bytes
    buckets = max(1, ceil(nbytes / bucket_bytes))
    return buckets * collective_time("all_reduce", nbytes / buckets, world_size, bandwidth, alpha)


def fsdp_comm_time(num_params: float, world_size: int, bandwidth: float, param_bytes: float = 2,
                   grad_bytes: float = GRAD_BYTES, units: int = 1, alpha: float = NCCL_ALPHA) -> float:
    """FSDP (ZeRO-3): all-gather the parameters for forward, again for backward, and
    reduce-scatter the gradients: 3 x (N-1)/N of the model against DDP's 2 x (N-1)/N, in
    elements. In bytes, bf16 gathers and float32 reductions (the defaults) make it
    (2 + 2 + 4) x (N-1)/N per parameter, as many as DDP's 2 x 4 x (N-1)/N.
    ``units`` is the number of wrapped modules; each does its own three collectives."""
    gather = collective_time("all_gather", num_params * param_bytes / units, world_size, bandwidth, alpha)
    scatter = collective_time("reduce_scatter", num_params * grad_bytes / units, world_size, bandwidth, alpha)
    return units * (2 * gather + scatter)


def tp_comm_time(tokens: float, hidden: int, layers: int, tp_size: int, bandwidth: float,
                 act_bytes: float = 2, alpha: float = NCCL_ALPHA) -> float:
    """Megatron tensor parallel: each layer all-reduces its (tokens x hidden) activations
    after attention and after the MLP in forward, and the same two in backward."""
    one = collective_time("all_reduce", tokens * hidden * act_bytes, tp_size, bandwidth, alpha)
    return 4 * layers * one


def compute_time(num_params: float, tokens: float, flops: float = B200_BF16_FLOPS,
                 mfu: float = 0.4) -> float:
    """Forward plus backward of a dense transformer: about 6 flops per parameter per token,
    at ``mfu`` (model flops utilisation, 0.3-0.5 is good) of the GPU's peak."""
    return 6 * num_params * tokens / (flops * mfu)


def transformer_shape(num_params: float) -> tuple[int, int]:
    """(layers, hidden) of a Llama-like model of about ``num_params`` parameters:
    12 * layers * hidden**2 parameters with hidden = 128 * layers (7B: 32 x 4096)."""
    hidden = (num_params * 128 / 12) ** (1 / 3)
    layers = max(1, round(hidden / 128))
    return layers, int(round(hidden / 128) * 128) or 128


def plan_parallelism(num_params: float, tokens_per_gpu: float, num_gpus: int,
                     gpu_memory: float = B200_MEMORY, link: str = "nvlink5",
                     gpus_per_node: int = GPUS_PER_NODE, mfu: float = 0.4,
                     nics_per_node: int = NICS_PER_NODE) -> list[dict]:
    """Each strategy's memory per GPU, communication and compute per step, and a verdict.

    Model states use ZeRO's mixed-precision Adam formulas (:func:`zero_memory`, K=12) and
    must fit in ``ACTIVATION_HEADROOM`` of ``gpu_memory``; communication uses ring
    collectives over ``link`` inside a node and over the nodes' ``nics_per_node`` InfiniBand
    NICs between them (:func:`group_bandwidth`: a group over whole nodes uses all of them, a
    group with one rank per node one); compute is 6 N T flops. The step time of DDP and
    FSDP is max(comm, compute), as they overlap the two; tensor parallel's all-reduces sit
    on the critical path (comm + compute); a pipeline's bubble is idle time. The strategy
    marked ``recommended`` is, among those that fit, the simplest within 10% of the fastest
    step. None is marked when nothing fits.
    """
    inside = link_bandwidth(link)
    node = min(num_gpus, gpus_per_node)
    replicas = max(1, num_gpus // node)
    nodes = dict(gpus_per_node=gpus_per_node, nics_per_node=nics_per_node, link=link)
    everyone = group_bandwidth(num_gpus, **nodes)                     # all GPUs, whole nodes
    one_per_node = group_bandwidth(replicas, ranks_per_node=1, **nodes)  # GPU i of every node
    budget = ACTIVATION_HEADROOM * gpu_memory
    layers, hidden = transformer_shape(num_params)
    compute = compute_time(num_params, tokens_per_gpu, mfu=mfu)
    rows = []

    def add(name, memory, comm, overlapped, why):
        step = max(comm, compute) if overlapped else comm + compute
        rows.append({"strategy": name, "memory": memory, "fits": memory <= budget, "comm": comm,
                     "compute": compute, "step": step, "why": why, "recommended": False})

    add("DDP", zero_memory(num_params, 1, 0), dp_comm_time(num_params, num_gpus, everyone), True,
        "a full replica per GPU; one gradient all-reduce per step, overlapped with backward")
    if num_gpus > gpus_per_node:
        add("HSDP", zero_memory(num_params, node, 3),
            fsdp_comm_time(num_params, node, inside, units=layers)
            + dp_comm_time(num_params / node, replicas, one_per_node), True,
            "sharded inside a node over the fast link, replicated across nodes: each GPU "
            "all-reduces its gradient shard with its peers of the other nodes, through its own NIC")
    add("FSDP", zero_memory(num_params, num_gpus, 3),
        fsdp_comm_time(num_params, num_gpus, everyone, units=layers), True,
        "everything sharded over all GPUs; bf16 gathers and float32 reductions, as many bytes as "
        "DDP's all-reduce in many smaller collectives" +
        (", over the network between nodes" if num_gpus > gpus_per_node else ""))
    tp_why = f"each layer split over the {node} GPUs of a node; 4 activation all-reduces per layer " \
             "on the critical path (async TP, compiled on GPUs, hides part of them; not counted)"
    if link == "pcie5":
        tp_why += "; over PCIe they stall every layer"
    add(f"TP{node} x FSDP", zero_memory(num_params / node, replicas, 3),
        tp_comm_time(tokens_per_gpu * node, hidden, layers, node, inside)
        + fsdp_comm_time(num_params / node, replicas, one_per_node, units=layers), False, tp_why)
    stages = min(num_gpus, layers)
    microbatches = 4 * stages
    bubble = (stages - 1) / (microbatches + stages - 1)
    add(f"PP{stages}", zero_memory(num_params / stages, 1, 0), bubble / (1 - bubble) * compute, False,
        f"layers cut into {stages} stages; little traffic, but {bubble:.0%} of the time idle in the "
        f"bubble ({microbatches} micro-batches; counted as comm)")

    fitting = [r for r in rows if r["fits"]]
    if fitting:  # rows are in order of simplicity: take the first that is nearly the fastest
        best = min(r["step"] for r in fitting)
        next(r for r in fitting if r["step"] <= 1.1 * best)["recommended"] = True
    return rows


def recommend(rows) -> str:
    """One sentence saying which of ``plan_parallelism``'s rows to use, and why."""
    chosen = next((r for r in rows if r["recommended"]), None)
    if chosen is None:
        least = min(rows, key=lambda r: r["memory"])
        return (f"nothing fits: even {least['strategy']} needs {least['memory'] / 1e9:,.0f} GB of model "
                "states per GPU. Add GPUs, or shrink the states (8-bit optimizer, CPU offload).")
    ratio = chosen["comm"] / chosen["compute"]
    verdict = ("communication dominates: more tokens per GPU (gradient accumulation) or a faster "
               "link would pay off" if ratio > 1 else "compute dominates, as it should")
    return (f"{chosen['strategy']}: {chosen['why']}. Step about {chosen['step'] * 1e3:,.0f} ms, "
            f"comm/compute {ratio:.2f}: {verdict}.")
