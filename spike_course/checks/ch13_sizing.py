"""Exercise check for chapter 13: a job's plan (GPU count, mesh, micro-batch) and its
predictions (model states and activations per rank, step time, hours), compared with the
plan laid out on the fake process group at the target world size and with the cost model."""

from __future__ import annotations

import math

from ._common import CheckFailed, Mistake, name_the_first, passed
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


_LAYOUTS: dict = {}  # (shape, dp, tp) -> what _layout_bytes found: the same mesh lays out the same


def _layout_bytes(shape, dp, tp) -> tuple[int, list]:
    """What _lay_out finds for this mesh, laid out once per kernel: a layout takes 0.2-2.7 s on 2
    cores, and a learner's plans, checked again and again, mostly keep their meshes."""
    key = (tuple(shape), dp, tp)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _lay_out(shape, dp, tp)
    return _LAYOUTS[key]


def _lay_out(shape, dp, tp) -> tuple[int, list]:
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


class _Plan:
    """One plan_job answer and what the check measures of it: the states per rank of the plan
    laid out on the fake group, the cost model's activations, step time and hours."""

    def __init__(self, plan, name, shape, seq, tokens, deadline):
        self.plan, self.shape, self.seq, self.tokens, self.deadline = plan, shape, seq, tokens, deadline
        self.gpus, self.dp, self.tp, self.micro = plan["gpus"], plan["dp"], plan["tp"], plan["micro_batch"]
        self.where = f"{name} (plan: {self.gpus} GPUs, dp {self.dp} x tp {self.tp}, micro-batch {self.micro})"
        self.params, self.acts = _facts(shape, seq)
        self.per_node, self.budget = CLUSTER["gpus_per_node"], CLUSTER["usable"] * CLUSTER["gpu_memory"]
        self._measured = None

    def got(self, key) -> float:
        return float(self.plan[key])

    @property
    def measured(self) -> float:
        """The model states per rank of the plan laid out on the fake group (laid out once; not
        a functools.cached_property, whose getter would call the check's code from outside the
        course and read as borrowing to the profile hook)."""
        if self._measured is None:
            held, tp_group = _layout_bytes(self.shape, self.dp, self.tp)
            assert len({rank // self.per_node for rank in tp_group}) == 1, tp_group  # the check's own layout
            self._measured = 4 * held  # gradients and Adam's two moments have the fp32 parameters' shards
        return self._measured

    @property
    def bounds(self) -> tuple[float, float]:
        """What a right answer may say: between the layout's states and the ZeRO-3 formula's (every
        parameter split over all GPUs), give or take a byte (padding, replicated norms)."""
        even = STATE_BYTES * self.params / self.gpus
        return min(self.measured, even) - 1, max(self.measured, even) + 1

    @property
    def slack(self) -> float:
        low, high = self.bounds
        return (high - low) / self.measured

    def states_off_by(self, factor) -> bool:
        """Whether the plan's states are ``factor`` x the layout's, within the layout's slack."""
        return factor != 1 and abs(self.got("states_bytes") / self.measured - factor) <= self.slack * factor + 1e-9

    @property
    def step_tokens(self) -> int:
        return self.micro * self.seq * self.dp

    @property
    def want_step(self) -> float:
        """6 N tokens / (GPUs x peak x MFU): one step's seconds."""
        return 6 * self.params * self.step_tokens / (self.gpus * CLUSTER["peak"] * CLUSTER["mfu"])

    @property
    def hours(self) -> float:
        return self.want_step * self.tokens / self.step_tokens / 3600

    @property
    def fewer(self) -> int:
        """The next smaller request: a node less, or inside one node half of its GPUs."""
        return self.gpus - self.per_node if self.gpus > self.per_node else self.gpus // 2


def _check_one(plan_job, name, shape, seq, tokens, deadline) -> None:
    p = _Plan(_plan(plan_job, name, shape, seq, tokens, deadline), name, shape, seq, tokens, deadline)
    name_the_first(MESH_MISTAKES, p, before=f"{p.where}: ")
    _check_states(p)
    _check_activations(p)
    _check_time(p)
    name_the_first((SPARE_NODE,), p, before=f"{p.where}: ")


# The mesh multiplies to the request, tp stays inside a node, the request is whole nodes.
MESH_MISTAKES = (
    Mistake("mesh does not multiply to the GPU count", lambda p: p.dp * p.tp != p.gpus,
            lambda p: f"the mesh has dp x tp = {p.dp * p.tp} ranks, but the job asks for {p.gpus} GPUs. torchrun "
                      "starts one rank per GPU, and init_device_mesh refuses a mesh that does not multiply to the "
                      "world size (Hint 1)."),
    Mistake("tensor parallel across nodes", lambda p: p.tp > p.per_node,
            lambda p: f"tensor parallel across nodes. A tp group of {p.tp} spans more than one node of "
                      f"{p.per_node} GPUs, so its all-reduces, four per layer on the critical path, go over "
                      "InfiniBand at less than half of NVLink's bandwidth, where async TP cannot hide them "
                      "(section 3 of the lecture, 'Where tensor parallel stops paying')."),
    Mistake("tp straddles nodes", lambda p: p.per_node % p.tp != 0,
            lambda p: f"tp = {p.tp} does not divide the {p.per_node} GPUs of a node, so some tp groups straddle "
                      "two nodes (lecture section 2: tp groups are consecutive ranks)."),
    Mistake("more GPUs than the cluster lends", lambda p: p.gpus > CLUSTER["max_gpus"],
            f"the cluster lends at most {CLUSTER['max_gpus']} GPUs to one job."),
    Mistake("not whole nodes", lambda p: p.gpus > p.per_node and p.gpus % p.per_node != 0,
            lambda p: f"{p.gpus} GPUs are not whole nodes; a multi-node job asks for pods of {p.per_node} GPUs "
                      "(lecture section 4)."),
)


def _states_slip(name, factor, what) -> Mistake:
    """States that are ``factor(p)`` x the layout's: ``what`` is left out."""
    return Mistake(name, lambda p: p.states_off_by(factor(p)),
                   lambda p: f"states_bytes = {p.got('states_bytes') / 1e9:.3f} GB, the layout on the fake group "
                             f"holds {p.measured / 1e9:.3f} GB per rank: {what} (Hint 2).")


STATE_SLIPS = (
    _states_slip("optimizer bytes forgotten", lambda p: 0.5, "the optimizer's bytes are forgotten: Adam keeps two "
                 "moments per parameter, as many bytes again as the parameters and gradients together"),
    _states_slip("only the parameters counted", lambda p: 0.25,
                 "only the parameters are counted: gradients and Adam's moments are missing"),
    _states_slip("gradients forgotten", lambda p: 0.75, "the gradients are forgotten"),
    _states_slip("states not divided by tp", lambda p: p.tp,
                 "the states are not divided by tp: tensor parallel splits the parameters too"),
    _states_slip("states not divided by dp", lambda p: p.dp,
                 "the states are not divided by dp: FSDP shards them over the dp ranks"),
)


def _check_states(p: _Plan) -> None:
    """The model states per rank against the plan laid out on the fake group."""
    low, high = p.bounds
    if not low <= p.got("states_bytes") <= high:
        name_the_first(STATE_SLIPS, p, before=f"{p.where}: ")
        raise CheckFailed(f"{p.where}: states_bytes = {p.got('states_bytes') / 1e9:.3f} GB per rank, but the plan "
                          f"laid out on the fake group holds {p.measured / 1e9:.3f} GB (the formula gives "
                          f"{STATE_BYTES * p.params / p.gpus / 1e9:.3f} GB) (Hint 2).")


def _activation_slip(name, value, what) -> Mistake:
    """Activations that are ``value(p)`` where one micro-batch's on one rank are expected."""
    return Mistake(name, lambda p: _near(p.got("activation_bytes"), value(p), 1e-9),
                   lambda p: f"activation_bytes = {p.got('activation_bytes') / 1e9:.3f} GB, expected "
                             f"{p.acts(p.micro) / p.tp / 1e9:.3f} GB per rank: {what} (Hint 2).")


ACTIVATION_SLIPS = (
    _activation_slip("activations of the global batch", lambda p: p.acts(p.micro * p.dp) / p.tp,
                     "counted for the global batch (one micro-batch per dp rank): each rank holds the activations "
                     "of its own micro-batch only"),
    _activation_slip("activations of every GPU", lambda p: p.acts(p.micro * p.gpus) / p.tp,
                     "counted for every GPU's micro-batch at once: each rank holds its own micro-batch's "
                     "activations only"),
    _activation_slip("activations not divided by tp", lambda p: p.acts(p.micro),
                     "not divided by tp: tensor parallel (with sequence parallel) splits the activations over the "
                     "tp group"),
    _activation_slip("activations in fp32", lambda p: p.acts(p.micro, "fp32") / p.tp,
                     "counted in fp32: the job computes in bf16"),
)

DOES_NOT_FIT = Mistake(
    "does not fit", lambda p: p.measured + p.acts(p.micro) / p.tp > p.budget,
    lambda p: f"does not fit: {(p.measured + p.acts(p.micro) / p.tp) / 1e9:.0f} GB per GPU of states and "
              f"activations, more than the {p.budget / 1e9:.0f} GB usable of a B200 (chapter 11: USABLE). The job "
              "would stop with an out-of-memory error at its first step (Hint 1).")


def _check_activations(p: _Plan) -> None:
    """One micro-batch's activations on one rank, and whether the plan fits."""
    want = p.acts(p.micro) / p.tp
    if not _near(p.got("activation_bytes"), want, 1e-9):
        name_the_first(ACTIVATION_SLIPS, p, before=f"{p.where}: ")
        raise CheckFailed(f"{p.where}: activation_bytes = {p.got('activation_bytes') / 1e9:.3f} GB, the cost model "
                          f"gives {want / 1e9:.3f} GB for one micro-batch of {p.micro} on one rank (Hint 2).")
    name_the_first((DOES_NOT_FIT,), p, before=f"{p.where}: ")


def _step_slip(name, factor, what) -> Mistake:
    """A step time ``factor(p)`` x the right one."""
    return Mistake(name, lambda p: _near(p.got("step_seconds"), p.want_step * factor(p), 1e-6),
                   lambda p: f"step_seconds = {p.got('step_seconds'):.4g} s, expected {p.want_step:.4g} s: {what} "
                             "(Hint 2).")


STEP_SLIPS = (
    _step_slip("peak instead of MFU", lambda p: CLUSTER["mfu"], "the GPUs' peak is used as their speed: at the "
               "measured MFU they deliver only that share of it"),
    _step_slip("one micro-batch per step", lambda p: 1 / p.dp, "one micro-batch per step: each of the dp ranks "
               "processes its own micro-batch, so a step trains on dp of them"),
    _step_slip("work not shared", lambda p: p.gpus, "the step's work is not shared among the GPUs"),
    _step_slip("tp's GPUs not sharing the work", lambda p: p.tp,
               "tensor parallel's GPUs are not counted as sharing the work of their micro-batch"),
)

MISSES_THE_DEADLINE = Mistake(
    "misses the deadline", lambda p: p.hours > p.deadline,
    lambda p: f"misses the deadline: {p.hours:.0f} h for a deadline of {p.deadline} h (Hint 1).")


def _check_time(p: _Plan) -> None:
    """Step time and hours, 6 N tokens / (GPUs x peak x MFU), and the deadline."""
    if not _near(p.got("step_seconds"), p.want_step, 1e-6):
        name_the_first(STEP_SLIPS, p, before=f"{p.where}: ")
        raise CheckFailed(f"{p.where}: step_seconds = {p.got('step_seconds'):.4g} s; 6 N x the step's tokens / "
                          f"(GPUs x peak x MFU) gives {p.want_step:.4g} s (Hint 2).")
    if not _near(p.plan["hours"], p.hours, 1e-6):
        raise CheckFailed(f"{p.where}: hours = {p.got('hours'):.4g}, but {p.tokens:.3g} tokens in steps of "
                          f"{p.step_tokens:,} tokens at {p.want_step:.4g} s each take {p.hours:.4g} h (Hint 2).")
    name_the_first((MISSES_THE_DEADLINE,), p, before=f"{p.where}: ")


# No node (or, inside one node, no half of the GPUs) to spare.
SPARE_NODE = Mistake(
    "a node to spare",
    lambda p: (p.fewer >= p.tp and p.fewer % p.tp == 0
               and STATE_BYTES * p.params / p.fewer + p.acts(1) / p.tp <= p.budget
               and p.hours * p.gpus / p.fewer <= p.deadline),
    lambda p: f"{p.fewer} GPUs would also meet the {p.deadline} h deadline ({p.hours * p.gpus / p.fewer:.0f} h) and "
              "fit: the request asks for more than the job needs, and a bigger request waits longer in the queue "
              "(Hint 1).")
