"""Closed-form costs, so that measurements have something to be compared with.

Sections (each chapter adds its own): collectives (alpha-beta times, bus bandwidth as
nccl-tests defines it, fitting alpha and beta), pipeline (bubble fraction), memory
(ZeRO/FSDP bytes per device). Pure python and numpy: no torch.
"""

from __future__ import annotations


# --- chapter 01: message passing (alpha-beta all-reduce times, bus bandwidth) ---

# Link speeds as published: both directions added. One direction carries half.
NVLINK5_BIDIR = 1800e9     # bytes/s per GPU, NVLink 5 (Blackwell, e.g. B200 in a DGX)
PCIE5_X16_BIDIR = 128e9    # bytes/s, a PCIe Gen 5 x16 slot

ALLREDUCE_ALGORITHMS = ("naive", "ring", "tree")

# busbw = algbw * factor(n), as nccl-tests defines it (its doc/PERFORMANCE.md): the factor
# turns "bytes of the buffer per second" into "bytes through each rank's link per second",
# a number that can be compared with the link speed whatever the number of ranks.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def allreduce_time(nbytes, world_size: int, algorithm: str, alpha: float, beta: float):
    """Seconds to all-reduce ``nbytes`` over ``world_size`` ranks in the alpha-beta model.

    A message of n bytes costs ``alpha + n * beta`` (latency in seconds, seconds per
    byte), and a rank's link carries one message at a time in each direction:

    naive: everyone sends to rank 0, which sends the sum back: 2(N-1)(alpha + n beta),
           since rank 0's link carries all 2(N-1) whole arrays one after the other.
    ring:  reduce-scatter then all-gather, 2(N-1) steps of one n/N chunk:
           2(N-1)(alpha + n beta / N): the bandwidth term hardly grows with N.
    tree:  binomial reduce then broadcast, 2 ceil(log2 N) rounds of the whole array:
           2 ceil(log2 N)(alpha + n beta): few latencies, but full-size messages.

    ``spike_course.mpi_sim`` reproduces these times exactly with its reference
    implementations. Real libraries do better than this "tree" (NCCL pipelines a double
    binary tree in chunks) and the reduction's arithmetic is not counted. ``nbytes`` may
    be a numpy array of sizes.
    """
    import math

    n = world_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {n!r}")
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes * beta)
    if algorithm == "ring":
        return 2 * (n - 1) * (alpha + nbytes / n * beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of "
                     f"{', '.join(ALLREDUCE_ALGORITHMS)}")


def algorithm_bandwidth(nbytes, seconds):
    """algbw: bytes of the buffer divided by the time the collective took (nccl-tests)."""
    return nbytes / seconds


def bus_bandwidth(nbytes, seconds, world_size: int, op: str = "all_reduce"):
    """busbw as nccl-tests reports it: algbw times a factor of the operation and world size.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and alltoall (n-1)/n; broadcast and
    reduce 1. ``nbytes`` is the size nccl-tests prints: the whole buffer (the output of
    an all_gather, the input of a reduce_scatter).
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(BUS_FACTORS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTORS[op](world_size)


# --- chapter 06: fully sharded data parallel (memory per device, ZeRO paper) ---

ZERO_STAGES = (0, 1, 2, 3)


def zero_memory_breakdown(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                          param_bytes: float = 2, grad_bytes: float = 2) -> dict:
    """Bytes per device of parameters, gradients and optimizer state under ZeRO ``stage``.

    Rajbhandari et al. (2019), section 3 and figure 1: with mixed-precision Adam a model
    of Psi parameters holds 2 Psi bytes of fp16/bf16 parameters, 2 Psi of gradients and
    K Psi of optimizer state (K = 12: fp32 master weights, momentum and variance).
    Stage 1 shards the optimizer state over the ``dp_size`` = N_d data-parallel ranks,
    stage 2 also the gradients, stage 3 also the parameters; stage 0 is plain data
    parallel. ``param_bytes``/``grad_bytes``/``k`` let the same formulas describe other
    precisions, e.g. fp32 Adam without a master copy: 4, 4 and k=8.
    Activations and temporary buffers are not counted (the paper's "residual states").
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size!r}")
    n = dp_size
    return {
        "parameters": param_bytes * num_params / (n if stage >= 3 else 1),
        "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
        "optimizer": k * num_params / (n if stage >= 1 else 1),
    }


def zero_memory(num_params: float, dp_size: int, stage: int, k: float = 12, *,
                param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device for model states under ZeRO ``stage`` (0-3), the paper's formulas:

    stage 0: (2 + 2 + K) Psi            stage 1: 4 Psi + K Psi / N_d
    stage 2: 2 Psi + (2 + K) Psi / N_d  stage 3: (2 + 2 + K) Psi / N_d

    e.g. Psi = 7.5e9, N_d = 64, K = 12 gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    """
    return sum(zero_memory_breakdown(num_params, dp_size, stage, k,
                                     param_bytes=param_bytes, grad_bytes=grad_bytes).values())


# --- chapter 08: communication and hardware (fitting, predictions, a decision guide) ---

# Assumptions of the predictions, stated once so a learner can change them.
NCCL_ALPHA = 1e-6        # seconds of latency per ring step inside a node (8 GPUs: ~15 us a call)
IB_NDR_PER_GPU = 50e9    # bytes/s per direction: one 400 Gb/s InfiniBand NIC per GPU (DGX B200)
B200_BF16_FLOPS = 2.25e15  # dense bf16 peak of one B200; datasheets' bigger figures assume sparsity
B200_MEMORY = 180e9      # bytes of HBM per GPU in a DGX B200 (1440 GB for 8)
DDP_BUCKET_BYTES = 25 * 2**20  # DDP all-reduces gradients in buckets of bucket_cap_mb=25
ACTIVATION_HEADROOM = 0.75     # model states may use this share of a GPU; activations need the rest


def fit_alpha_beta(sizes, seconds, relative: bool = True) -> tuple[float, float]:
    """Fit ``seconds = alpha + beta * size`` by least squares with alpha, beta >= 0.

    ``sizes`` in bytes, ``seconds`` measured times; returns (alpha in seconds, beta in
    seconds per byte), so 1/beta is the bandwidth the line implies. With ``relative``
    (the default) each point's error counts relative to its own time: timings span
    several orders of magnitude, and a plain fit would let the biggest messages decide
    everything and leave alpha as noise (or negative). A negative fitted value is not
    physical; the fit then returns the best line with that value pinned to 0.
    """
    import numpy as np

    x = np.asarray(sizes, dtype=float).ravel()
    y = np.asarray(seconds, dtype=float).ravel()
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need as many sizes as times, at least 2; got {x.size} and {y.size}")
    if np.any(x < 0) or np.any(y <= 0) or not np.all(np.isfinite(x + y)):
        raise ValueError("sizes must be >= 0 and times > 0 and finite")
    w = 1.0 / y if relative else np.ones_like(y)

    def loss(a, b):
        return float(np.sum((w * (a + b * x - y)) ** 2))

    a, b = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * y, rcond=None)[0]
    if a >= 0 and b >= 0:
        return float(a), float(b)
    candidates = [(float(np.sum(w**2 * y) / np.sum(w**2)), 0.0)]  # beta = 0: a constant
    if np.sum(w**2 * x**2) > 0:                                    # alpha = 0: through the origin
        candidates.append((0.0, max(0.0, float(np.sum(w**2 * x * y) / np.sum(w**2 * x**2)))))
    return min(candidates, key=lambda ab: loss(*ab))


def link_bandwidth(link: str) -> float:
    """Bytes per second in ONE direction per GPU of a named link.

    The published figures are bidirectional (both directions added); a ring collective
    sends and receives at once, so each direction carries half of it.
    """
    links = {"nvlink5": NVLINK5_BIDIR / 2, "pcie5": PCIE5_X16_BIDIR / 2, "ib_ndr": IB_NDR_PER_GPU}
    if link not in links:
        raise ValueError(f"unknown link {link!r}: choose one of {', '.join(links)}")
    return links[link]


def collective_time(op: str, nbytes: float, world_size: int, bandwidth: float,
                    alpha: float = NCCL_ALPHA) -> float:
    """Seconds of one ring collective: latency steps * alpha + bus bytes / bandwidth.

    ``nbytes`` is the size nccl-tests reports (the whole buffer); the bytes each GPU has
    to push through its link are ``nbytes`` times the bus-bandwidth factor of ``op``,
    which is why bus bandwidth is the number to compare with a link's speed.
    ``bandwidth`` is per direction (see :func:`link_bandwidth`).
    """
    n = world_size
    if n == 1:
        return 0.0
    factor = bus_bandwidth(1.0, 1.0, n, op)  # busbw/algbw, the nccl-tests factor
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * alpha + nbytes * factor / bandwidth


def dp_comm_time(num_params: float, world_size: int, bandwidth: float, grad_bytes: float = 2,
                 alpha: float = NCCL_ALPHA, bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """DDP: all-reduce every gradient once per step, in buckets (each pays its latency)."""
    from math import ceil

    nbytes = num_params * grad_bytes
    buckets = max(1, ceil(nbytes / bucket_bytes))
    return buckets * collective_time("all_reduce", nbytes / buckets, world_size, bandwidth, alpha)


def fsdp_comm_time(num_params: float, world_size: int, bandwidth: float, param_bytes: float = 2,
                   grad_bytes: float = 2, units: int = 1, alpha: float = NCCL_ALPHA) -> float:
    """FSDP (ZeRO-3): all-gather the parameters for forward, again for backward, and
    reduce-scatter the gradients: 3 x (N-1)/N of the model against DDP's 2 x (N-1)/N.
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
                     gpus_per_node: int = 8, mfu: float = 0.4) -> list[dict]:
    """Each strategy's memory per GPU, communication and compute per step, and a verdict.

    Model states use ZeRO's mixed-precision Adam formulas (:func:`zero_memory`, K=12) and
    must fit in ``ACTIVATION_HEADROOM`` of ``gpu_memory``; communication uses ring
    collectives over ``link`` inside a node and InfiniBand between nodes; compute is
    6 N T flops. The step time of DDP and FSDP is max(comm, compute), as they overlap the
    two; tensor parallel's all-reduces sit on the critical path (comm + compute); a
    pipeline's bubble is idle time. The strategy marked ``recommended`` is, among those that
    fit, the simplest within 10% of the fastest step. None is marked when nothing fits.
    """
    inside = link_bandwidth(link)
    across = min(inside, IB_NDR_PER_GPU) if num_gpus > gpus_per_node else inside
    node = min(num_gpus, gpus_per_node)
    budget = ACTIVATION_HEADROOM * gpu_memory
    layers, hidden = transformer_shape(num_params)
    compute = compute_time(num_params, tokens_per_gpu, mfu=mfu)
    rows = []

    def add(name, memory, comm, overlapped, why):
        step = max(comm, compute) if overlapped else comm + compute
        rows.append({"strategy": name, "memory": memory, "fits": memory <= budget, "comm": comm,
                     "compute": compute, "step": step, "why": why, "recommended": False})

    add("DDP", zero_memory(num_params, 1, 0), dp_comm_time(num_params, num_gpus, across), True,
        "a full replica per GPU; one gradient all-reduce per step, overlapped with backward")
    if num_gpus > gpus_per_node:
        add("HSDP", zero_memory(num_params, node, 3),
            fsdp_comm_time(num_params, node, inside, units=layers)
            + dp_comm_time(num_params / node, num_gpus // node, IB_NDR_PER_GPU), True,
            "sharded inside a node over the fast link, replicated across nodes: only a "
            "gradient shard crosses the network")
    add("FSDP", zero_memory(num_params, num_gpus, 3),
        fsdp_comm_time(num_params, num_gpus, across, units=layers), True,
        "everything sharded over all GPUs; 1.5x DDP's traffic" +
        (", all of it over the slower network between nodes" if num_gpus > gpus_per_node else ""))
    replicas = max(1, num_gpus // node)
    tp_why = f"each layer split over the {node} GPUs of a node; 4 activation all-reduces per layer " \
             "that nothing overlaps"
    if link == "pcie5":
        tp_why += "; over PCIe they stall every layer"
    add(f"TP{node} x FSDP", zero_memory(num_params / node, replicas, 3),
        tp_comm_time(tokens_per_gpu * node, hidden, layers, node, inside)
        + fsdp_comm_time(num_params / node, replicas, across, units=layers), False, tp_why)
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


# --- chapter 04: pipeline parallel (bubble fraction, ideal schedules) ---

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of one GPipe or 1F1B step: (p - 1) / (m + p - 1).

    With p equal stages and m micro-batches a step takes m + p - 1 "slots" per rank
    (forward plus backward of one micro-batch on one stage), of which each rank is
    busy for m: filling and draining the pipeline leaves p - 1 slots idle. 1F1B
    reorders the work (and holds fewer activations) but has the same bubble.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def _pipeline_order(schedule: str, rank: int, stages: int, microbatches: int) -> list:
    """The (phase, microbatch) actions one rank runs, in order."""
    m = microbatches
    if schedule == "gpipe":  # all forwards, then all backwards
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # 1F1B (PyTorch's Schedule1F1B): p - rank forwards to fill the pipeline, then
    # alternate one backward and one forward, then drain the remaining backwards.
    warmup = min(m, stages - rank)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(("B", backward))
        backward += 1
        if forward < m:
            order.append(("F", forward))
            forward += 1
    return order


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      t_forward=1.0, t_backward=2.0) -> list[dict]:
    """The ideal timeline of one step: every rank starts each action as soon as its
    inputs exist (free communication).

    ``t_forward``/``t_backward``: the time of one micro-batch's forward/backward on one
    stage, the same for all stages, or a list with one value per stage (rank).

    Returns event records ``{"rank", "microbatch", "phase" ("F"/"B"), "start", "end"}``,
    the same format a worker measures, so :func:`spike_course.viz.pipeline_schedule`
    draws both. Forward of micro-batch i on rank r waits for its forward on rank r-1;
    backward waits for the backward on rank r+1 (the last rank: for its own forward).
    """
    schedule = schedule.lower()
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    pipeline_bubble(stages, microbatches)  # validates the sizes
    orders = {r: _pipeline_order(schedule, r, stages, microbatches) for r in range(stages)}
    times = {}
    for phase, t in (("F", t_forward), ("B", t_backward)):
        t = list(t) if isinstance(t, (list, tuple)) else [t] * stages
        if len(t) != stages:
            raise ValueError(f"need one {phase} time per stage ({stages}), got {len(t)}")
        times[phase] = t
    done: dict = {}  # (rank, phase, microbatch) -> end time
    clock = {r: 0.0 for r in range(stages)}
    position = {r: 0 for r in range(stages)}
    events = []
    while any(position[r] < len(orders[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            if position[r] == len(orders[r]):
                continue
            phase, i = orders[r][position[r]]
            if phase == "F":
                needs = (r - 1, "F", i) if r > 0 else None
            else:
                needs = (r + 1, "B", i) if r < stages - 1 else (r, "F", i)
            if needs is not None and needs not in done:
                continue  # its input is not ready: another rank has to move first
            start = max(clock[r], done[needs] if needs else 0.0)
            end = start + times[phase][r]
            done[(r, phase, i)] = clock[r] = end
            events.append({"rank": r, "microbatch": i, "phase": phase, "start": start, "end": end})
            position[r] += 1
            progressed = True
        if not progressed:  # cannot happen for the two schedules above
            raise RuntimeError("the schedule deadlocks")
    return sorted(events, key=lambda e: (e["rank"], e["start"]))


def _as_event(event) -> dict:
    if isinstance(event, dict):
        return event
    rank, microbatch, phase, start, end = event[:5]
    return {"rank": rank, "microbatch": microbatch, "phase": phase, "start": start, "end": end}


def pipeline_idle_fraction(events, per_rank: bool = False):
    """Share of the step the ranks spent waiting, from event records (measured or ideal).

    The step runs from the first start to the last end over all ranks; each rank's idle
    time is that span minus its busy time. Returns the fraction over all ranks, or a
    dict rank -> fraction with ``per_rank=True``. Comparable with :func:`pipeline_bubble`.
    """
    events = [_as_event(e) for e in events]
    if not events:
        raise ValueError("no events")
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    busy: dict = {}
    for e in events:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + (e["end"] - e["start"])
    idle = {r: 1.0 - b / span for r, b in sorted(busy.items())}
    return idle if per_rank else sum(idle.values()) / len(idle)


def pipeline_peak_activations(events) -> dict:
    """Per rank, the most micro-batches whose forward has run but whose backward has not:
    the activations that rank holds at its worst moment (GPipe: m; 1F1B: at most p - rank)."""
    peaks: dict = {}
    by_rank: dict = {}
    for e in map(_as_event, events):
        by_rank.setdefault(e["rank"], []).append(e)
    for r, evs in sorted(by_rank.items()):
        held = peak = 0
        for e in sorted(evs, key=lambda e: e["start"]):
            held += 1 if e["phase"] == "F" else -1 if e["phase"] == "B" else 0
            peak = max(peak, held)
        peaks[r] = peak
    return peaks
