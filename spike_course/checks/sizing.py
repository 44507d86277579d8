"""Exercise check for chapter 13: a job's plan (GPU count, mesh, micro-batch) and its
predictions (model states and activations per rank, step time, hours), compared with the
plan laid out on the fake process group at the target world size and with the cost model."""

from __future__ import annotations

import math

from ._common import CheckFailed, passed
from ._guard import borrowing_refused

CLUSTER = {"gpus_per_node": 8, "gpu_memory": 180e9, "usable": 0.9, "peak": 2.25e15, "mfu": 0.40,
           "max_gpus": 256}
# (name, shape = (layers, dim, hidden, heads, vocab, max_seq_len), seq, tokens, deadline in hours).
# The first is the exercise's own; the others are the check's, so that a plan written for the
# first alone fails: a 1B model that one GPU trains in time, and a 78B model at 8k tokens
# whose activations need tensor parallel.
SCENARIOS = [
    ("the exercise's 13B model", (40, 5120, 13824, 40, 32000, 4096), 4096, 260e9, 168),
    ("a 1B model", (16, 2048, 5632, 16, 32000, 2048), 2048, 20e9, 72),
    ("a 78B model at 8k tokens", (80, 8192, 28672, 64, 32000, 8192), 8192, 50e9, 240),
]
KEYS = ("gpus", "dp", "tp", "micro_batch", "states_bytes", "activation_bytes", "step_seconds", "hours")
STATE_BYTES = 16  # per parameter: fp32 parameter, fp32 gradient, Adam's two fp32 moments


def _layout_bytes(shape, dp, tp) -> tuple[int, list]:
    """Parameter bytes rank 0 holds with the model on meta laid out on a (dp, tp) mesh of the
    fake process group (tensor parallel as chapter 05 split the model, FSDP2 over dp), and
    rank 0's tp group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..models import TinyTransformer

    layers, dim, hidden, heads, vocab, max_seq = shape
    if dist.is_initialized():
        raise CheckFailed("a process group is still initialised in this kernel: call "
                          "dist.destroy_process_group() (or restart the kernel) and run the check again.")
    dist.init_process_group("fake", rank=0, world_size=dp * tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = TinyTransformer(vocab, dim, layers, heads, hidden, max_seq)
        if tp > 1:
            parallelize_module(model, mesh["tp"], {"tok_embeddings": RowwiseParallel(),
                                                   "pos_embeddings": RowwiseParallel(),
                                                   "output": ColwiseParallel()})
            col, row = ColwiseParallel(), RowwiseParallel()
            for block in model.layers:
                parallelize_module(block, mesh["tp"], {
                    "attention.wq": col, "attention.wk": col, "attention.wv": col, "attention.wo": row,
                    "feed_forward.w1": col, "feed_forward.w3": col, "feed_forward.w2": row})
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        return sum(t.numel() * t.element_size() for t in local), mesh["tp"].mesh.tolist()
    finally:
        dist.destroy_process_group()


def _near(value, want, rtol) -> bool:
    return math.isclose(float(value), float(want), rel_tol=rtol, abs_tol=0.0)


def _slip(got, mistakes, rtol) -> str | None:
    """The message of the first (value, message) of ``mistakes`` whose value ``got`` equals."""
    return next((message for value, message in mistakes if _near(got, value, rtol)), None)


def _facts(shape, seq):
    from ..costmodel import activation_bytes, transformer_params

    layers, dim, hidden, heads, vocab, max_seq = shape
    params = transformer_params(layers, dim, hidden, vocab, max_seq)

    def acts(batch, precision="bf16"):
        return activation_bytes(batch, seq, dim, hidden, layers, heads, vocab, precision)

    return params, acts


def _plan(plan_job, name, shape, seq, tokens, deadline) -> dict:
    where = f"plan_job for {name}"
    try:
        plan = plan_job(shape, seq, tokens, deadline, dict(CLUSTER))
    except NotImplementedError:
        raise CheckFailed("plan_job still raises NotImplementedError: write it first.") from None
    except Exception as error:  # the learner's own error, named with the case that raised it
        raise CheckFailed(f"{where} raised {type(error).__name__}: {error}. Every case of the check has "
                          "a plan that meets its deadline on this cluster (Hint 1).") from None
    if not isinstance(plan, dict) or any(key not in plan for key in KEYS):
        missing = [k for k in KEYS if not isinstance(plan, dict) or k not in plan]
        raise CheckFailed(f"{where} returned {type(plan).__name__} without {missing}: return a dict with "
                          f"the keys {', '.join(KEYS)}.")
    for key in ("gpus", "dp", "tp", "micro_batch"):
        if not isinstance(plan[key], int) or isinstance(plan[key], bool) or plan[key] < 1:
            raise CheckFailed(f"{where}: {key} = {plan[key]!r}; it must be a whole number >= 1.")
    return plan


def check_job_plan(plan_job) -> None:
    """Check chapter 13's exercise: ``plan_job(shape, seq, tokens, deadline_hours, cluster)``
    returns the GPU count, the (dp, tp) mesh, the micro-batch and four predictions, for the
    exercise's model and for two more the check picks."""
    from .. import costmodel

    with borrowing_refused("plan_job", (costmodel.memory_plan, costmodel.fit_suggestions),
                           "Add up the states and activations yourself (Hint 2).", answers=[plan_job]):
        for scenario in SCENARIOS:
            _check_one(plan_job, *scenario)
    passed(f"plan_job's plans and predictions, for {len(SCENARIOS)} jobs, match the fake-group layout "
           "and the cost model, fit, and meet their deadlines with no node to spare")


def _check_one(plan_job, name, shape, seq, tokens, deadline) -> None:
    plan = _plan(plan_job, name, shape, seq, tokens, deadline)
    gpus, dp, tp, micro = plan["gpus"], plan["dp"], plan["tp"], plan["micro_batch"]
    where = f"{name} (plan: {gpus} GPUs, dp {dp} x tp {tp}, micro-batch {micro})"
    _check_mesh(where, gpus, dp, tp)
    params, acts = _facts(shape, seq)
    states = _check_states(where, plan, shape, params)
    _check_activations(where, plan, acts, states)
    hours = _check_time(where, plan, params, seq, tokens, deadline)
    _check_no_spare(where, plan, params, acts, hours, deadline)


def _check_mesh(where, gpus, dp, tp) -> None:
    """The mesh multiplies to the request, tp stays inside a node, the request is whole nodes."""
    per_node = CLUSTER["gpus_per_node"]
    if dp * tp != gpus:
        raise CheckFailed(f"{where}: the mesh has dp x tp = {dp * tp} ranks, but the job asks for {gpus} GPUs. "
                          "torchrun starts one rank per GPU, and init_device_mesh refuses a mesh that does "
                          "not multiply to the world size (Hint 1).")
    if tp > per_node:
        raise CheckFailed(f"{where}: tensor parallel across nodes. A tp group of {tp} spans more than one "
                          f"node of {per_node} GPUs, so its all-reduces, four per layer on the critical path, go "
                          "over InfiniBand at less than half of NVLink's bandwidth, where async TP cannot hide them "
                          "(section 3 of the lecture, 'Where tensor parallel stops paying').")
    if per_node % tp:
        raise CheckFailed(f"{where}: tp = {tp} does not divide the {per_node} GPUs of a node, so some tp "
                          "groups straddle two nodes (lecture section 2: tp groups are consecutive ranks).")
    if gpus > CLUSTER["max_gpus"]:
        raise CheckFailed(f"{where}: the cluster lends at most {CLUSTER['max_gpus']} GPUs to one job.")
    if gpus > per_node and gpus % per_node:
        raise CheckFailed(f"{where}: {gpus} GPUs are not whole nodes; a multi-node job asks for pods of "
                          f"{per_node} GPUs (lecture section 4).")


def _check_states(where, plan, shape, params) -> float:
    """The model states per rank against the plan laid out on the fake group; returns them."""
    gpus, dp, tp, per_node = plan["gpus"], plan["dp"], plan["tp"], CLUSTER["gpus_per_node"]
    held, tp_group = _layout_bytes(shape, dp, tp)
    assert len({rank // per_node for rank in tp_group}) == 1, tp_group  # the check's own layout
    measured = 4 * held  # gradients and Adam's two moments have the fp32 parameters' shards
    even = STATE_BYTES * params / gpus  # the ZeRO-3 formula: every parameter split over all GPUs
    low, high = min(measured, even) - 1, max(measured, even) + 1  # padding, replicated norms
    got = float(plan["states_bytes"])
    if not low <= got <= high:
        slack = (high - low) / measured
        mistakes = [(0.5, "the optimizer's bytes are forgotten: Adam keeps two moments per parameter, "
                          "as many bytes again as the parameters and gradients together"),
                    (0.25, "only the parameters are counted: gradients and Adam's moments are missing"),
                    (0.75, "the gradients are forgotten"),
                    (tp, "the states are not divided by tp: tensor parallel splits the parameters too"),
                    (dp, "the states are not divided by dp: FSDP shards them over the dp ranks")]
        for factor, message in mistakes:
            if factor != 1 and abs(got / measured - factor) <= slack * factor + 1e-9:
                raise CheckFailed(f"{where}: states_bytes = {got / 1e9:.3f} GB, the layout on the fake group "
                                  f"holds {measured / 1e9:.3f} GB per rank: {message} (Hint 2).")
        raise CheckFailed(f"{where}: states_bytes = {got / 1e9:.3f} GB per rank, but the plan laid out on "
                          f"the fake group holds {measured / 1e9:.3f} GB (the formula gives "
                          f"{even / 1e9:.3f} GB) (Hint 2).")
    return measured


def _check_activations(where, plan, acts, measured) -> None:
    """One micro-batch's activations on one rank, and whether the plan fits."""
    gpus, dp, tp, micro = plan["gpus"], plan["dp"], plan["tp"], plan["micro_batch"]
    want = acts(micro) / tp
    got = float(plan["activation_bytes"])
    if not _near(got, want, 1e-9):
        mistakes = [(acts(micro * dp) / tp, "counted for the global batch (one micro-batch per dp rank): "
                                            "each rank holds the activations of its own micro-batch only"),
                    (acts(micro * gpus) / tp, "counted for every GPU's micro-batch at once: each rank holds "
                                              "its own micro-batch's activations only"),
                    (acts(micro), "not divided by tp: tensor parallel (with sequence parallel) splits "
                                  "the activations over the tp group"),
                    (acts(micro, "fp32") / tp, "counted in fp32: the job computes in bf16")]
        message = _slip(got, mistakes, 1e-9)
        if message:
            raise CheckFailed(f"{where}: activation_bytes = {got / 1e9:.3f} GB, expected {want / 1e9:.3f} "
                              f"GB per rank: {message} (Hint 2).")
        raise CheckFailed(f"{where}: activation_bytes = {got / 1e9:.3f} GB, the cost model gives "
                          f"{want / 1e9:.3f} GB for one micro-batch of {micro} on one rank (Hint 2).")
    budget = CLUSTER["usable"] * CLUSTER["gpu_memory"]
    if measured + want > budget:
        raise CheckFailed(f"{where}: does not fit: {(measured + want) / 1e9:.0f} GB per GPU of states and "
                          f"activations, more than the {budget / 1e9:.0f} GB usable of a B200 (chapter 11: "
                          "USABLE). The job would stop with an out-of-memory error at its first step (Hint 1).")


def _check_time(where, plan, params, seq, tokens, deadline) -> float:
    """Step time and hours, 6 N tokens / (GPUs x peak x MFU), and the deadline; returns the hours."""
    gpus, dp, tp, micro = plan["gpus"], plan["dp"], plan["tp"], plan["micro_batch"]
    rate = CLUSTER["peak"] * CLUSTER["mfu"]
    step_tokens = micro * seq * dp
    want_step = 6 * params * step_tokens / (gpus * rate)
    got = float(plan["step_seconds"])
    if not _near(got, want_step, 1e-6):
        mistakes = [(want_step * CLUSTER["mfu"], "the GPUs' peak is used as their speed: at the measured MFU "
                                                  "they deliver only that share of it"),
                    (want_step / dp, "one micro-batch per step: each of the dp ranks processes its own "
                                     "micro-batch, so a step trains on dp of them"),
                    (want_step * gpus, "the step's work is not shared among the GPUs"),
                    (want_step * tp, "tensor parallel's GPUs are not counted as sharing the work of "
                                     "their micro-batch")]
        message = _slip(got, mistakes, 1e-6)
        if message:
            raise CheckFailed(f"{where}: step_seconds = {got:.4g} s, expected {want_step:.4g} s: "
                              f"{message} (Hint 2).")
        raise CheckFailed(f"{where}: step_seconds = {got:.4g} s; 6 N x the step's tokens / (GPUs x peak x "
                          f"MFU) gives {want_step:.4g} s (Hint 2).")
    want_hours = want_step * tokens / step_tokens / 3600
    if not _near(plan["hours"], want_hours, 1e-6):
        raise CheckFailed(f"{where}: hours = {float(plan['hours']):.4g}, but {tokens:.3g} tokens in steps of "
                          f"{step_tokens:,} tokens at {want_step:.4g} s each take {want_hours:.4g} h (Hint 2).")
    if want_hours > deadline:
        raise CheckFailed(f"{where}: misses the deadline: {want_hours:.0f} h for a deadline of {deadline} h "
                          "(Hint 1).")
    return want_hours


def _check_no_spare(where, plan, params, acts, hours, deadline) -> None:
    """No node (or, inside one node, no half of the GPUs) to spare."""
    gpus, tp, per_node = plan["gpus"], plan["tp"], CLUSTER["gpus_per_node"]
    budget = CLUSTER["usable"] * CLUSTER["gpu_memory"]
    fewer = gpus - per_node if gpus > per_node else gpus // 2
    if fewer >= tp and fewer % tp == 0:
        fits = STATE_BYTES * params / fewer + acts(1) / tp <= budget
        if fits and hours * gpus / fewer <= deadline:
            raise CheckFailed(f"{where}: {fewer} GPUs would also meet the {deadline} h deadline "
                              f"({hours * gpus / fewer:.0f} h) and fit: the request asks for more than "
                              "the job needs, and a bigger request waits longer in the queue (Hint 1).")
