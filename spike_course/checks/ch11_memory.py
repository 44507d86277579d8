"""Exercise checks for chapter 11: making a model fit (a memory budget on N ranks; predicting
a job's bytes per GPU with the cost model).

Exercise 1's check reads each rank's report in the steps a learner takes: the model build()
returns, how it is sharded, what its forward saves for backward, the weights and buffers it
starts from, and where training ends. Most of its mistakes show in byte counts set against the
cost model; where two mistakes give the same bytes, what the worker saw of the model (its FSDP
units, what its forward computed in and on how many sequences) names the one that was made.
They sit in tables of known mistakes (name, how its readings show it, message); exercise 2's
usual slips are such a table too (PEAK_SLIPS)."""

from __future__ import annotations



from ._guard import borrowing_refused
from ._common import (CheckFailed, Mistake, largest_difference, launch_reports, name_the_first,
                      passed)


def _tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def _bytes(run: dict) -> int:
    """What a run held at its peak: its model states after the last step plus what its forward
    saved for backward."""
    return sum(run["held"].values()) + run["saved"]


class _Model:
    """The reported TinyTransformer's size, and the bytes the cost model predicts for it."""

    def __init__(self, shape: dict, seq: int):
        from ..costmodel import transformer_params

        self.shape, self.seq = shape, seq
        layers, dim, hidden = shape["n_layers"], shape["dim"], shape["hidden"]
        self.psi = transformer_params(layers, dim, hidden, shape["vocab_size"], shape["max_seq_len"])
        self.root = self.psi - layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim)  # embeddings, norm, output

    def activations(self, batch: int, **options) -> int:
        from ..costmodel import activation_bytes

        shape = self.shape
        return activation_bytes(batch, self.seq, shape["dim"], shape["hidden"], shape["n_layers"],
                                shape["n_heads"], shape["vocab_size"], **options)


class _Rank:
    """One rank's report of exercise 1, with the readings its known mistakes are recognised by.
    Each reading is computed when a step asks for it, as the report is read step by step."""

    def __init__(self, rank: int, report: dict, model: _Model, world: int, budget: float):
        self.rank, self.report, self.model, self.world, self.budget = rank, report, model, world, budget
        self.fit, self.ddp, self.batch = report["fit"], report["ddp"], report["batch"]
        self.blocks = [f"layers.{i}" for i in range(model.shape["n_layers"])]

    @property
    def parameters(self) -> int:
        return self.fit["held"]["parameters"]

    @property
    def saved(self) -> int:
        return self.fit["saved"]

    @property
    def total(self) -> int:
        return _bytes(self.fit)

    @property
    def holds(self) -> str:
        """How the messages about this rank's bytes begin."""
        within = "over" if self.total > self.budget else "within"
        return f"rank {self.rank} holds {self.total:,} bytes ({within} the budget of {self.budget:,.0f})"

    def activations(self, batch: int | None = None, **options) -> int:
        """The bytes a forward saves for backward, by the cost model: this rank's batch unless told."""
        return self.model.activations(self.batch if batch is None else batch, **options)

    def least_saved_per_block(self) -> int:
        """The least that a forward checkpointed per block saves, on the batch it saw, in a
        precision that fits what it computed in (autocast saves more than bf16 does)."""
        precisions = ("fp32",) if self.fit["computed_in"] == ["torch.float32"] else ("autocast", "bf16")
        return min(self.activations(self.fit["forward_batch"], checkpoint=True, precision=p) for p in precisions)

    @property
    def blocks_not_units(self) -> str:
        """The blocks that are not FSDP units of their own, named for a message ("" if none)."""
        return ", ".join(b for b in self.blocks if b not in self.report["units"])

    @property
    def wrong_buffers(self) -> list[str]:
        """The buffers that differ from the unconstrained model's (the same names: _check_built)."""
        import torch

        buffers, expected = self.report["buffers"], self.report["expected_buffers"]
        return sorted(n for n in expected if not torch.equal(buffers[n], expected[n]))

    @property
    def blocks_kept_gathered(self) -> str:
        """The blocks that are FSDP units but keep their parameters gathered after their forward."""
        return ", ".join(b for b in self.blocks if self.report["units"].get(b) is False)


# The model build() returned, before any byte is counted: its dtype, its class (told by its
# buffers, since the lecture's class has the same parameters), where its weights were made.
BUILD_MISTAKES = (
    Mistake("cast to bf16",
             lambda r: r.fit["dtypes"] != ["torch.float32"],
             lambda r: f"rank {r.rank}: the parameters are {', '.join(r.fit['dtypes'])}: casting the model to "
                       "bf16 (model.to(torch.bfloat16)) drops the fp32 master weights, and Adam's small "
                       "updates are rounded away. Keep fp32 parameters (bf16 compute would be "
                       "MixedPrecisionPolicy, but here the result must not change at all)."),
    Mistake("another class",
             lambda r: r.report["buffers"].keys() != r.report["expected_buffers"].keys(),
             lambda r: f"rank {r.rank}: the model build() returned has the buffers "
                       f"{sorted(r.report['buffers']) or 'none'}, the unconstrained one "
                       f"{sorted(r.report['expected_buffers'])}: build the colleague's model (the class the "
                       "unconstrained run uses), not another one with the same parameters."),
    Mistake("created whole",
             lambda r: r.report["created_on"] != "meta",
             lambda r: f"rank {r.rank} created the whole model on {r.report['created_on']} (all "
                       f"{4 * r.model.psi:,} bytes of parameters, on every rank) before sharding it: for a "
                       "model that does not fit one GPU, that is the line that fails. Create it under "
                       'with torch.device("meta"): (shapes, no memory), shard it, then '
                       "model.to_empty(device=...) allocates only this rank's shards."),
)

# Which fully_shard calls are missing or wrong, told by the bytes of fp32 parameters (4 each) a
# rank keeps, and by those still gathered after the forward. In this order: each test assumes that
# the ones before it were not seen (a rank that keeps the whole model also keeps more than 1/N of
# it). The gathered bytes are the same whether the blocks are no FSDP units (the root's unit holds
# them) or units that stay gathered (reshard_after_forward=False): the units the worker reports
# tell which.
SHARDING_MISTAKES = (
    Mistake("nothing sharded",
             lambda r: r.parameters >= 4 * r.model.psi,
             lambda r: f"{r.holds}: the parameters take {r.parameters:,} bytes on every rank, the whole "
                       "model: nothing is sharded. Call fully_shard(block, mesh=mesh) on each block and then "
                       "fully_shard(model, mesh=mesh) on the root, so each rank keeps 1/N of the "
                       "parameters, gradients and Adam state."),
    Mistake("root not sharded",
             lambda r: r.parameters > 4 * r.model.psi / r.world + 4 * r.world,
             lambda r: f"{r.holds}: the parameters take {r.parameters:,} bytes, more than 1/{r.world} of the "
                       f"model ({4 * r.model.psi / r.world:,.0f}): the blocks are sharded but the root is not, "
                       "so the embeddings, the final norm and the output layer stay whole on every rank (and "
                       "each block, left as a root of its own, stays gathered after its forward). Call "
                       "fully_shard(model, mesh=mesh) after the blocks."),
    # the root unit's own parameters stay gathered after the forward; a block's must not
    Mistake("blocks not sharded",
             lambda r: r.fit["gathered"] > 4 * r.model.root and r.blocks_not_units,
             lambda r: f"rank {r.rank}: after the forward it still held {r.fit['gathered']:,} bytes of gathered "
                       f"parameters, more than the root module's: the blocks {r.blocks_not_units} are not FSDP "
                       "units of their own, so they belong to the root's unit, gathered whole for the forward "
                       "and the backward. Each block is a unit of its own, made before the root's (hint 1)."),
    Mistake("blocks kept gathered",
             lambda r: r.fit["gathered"] > 4 * r.model.root and r.blocks_kept_gathered,
             lambda r: f"rank {r.rank}: after the forward it still held {r.fit['gathered']:,} bytes of gathered "
                       f"parameters, more than the root module's: the blocks {r.blocks_kept_gathered} are FSDP "
                       "units, but they keep their gathered parameters from their forward to their backward "
                       "(reshard_after_forward=False, chapter 06), so at the end of the forward every rank "
                       "holds them whole, as if they were not sharded. A block's unit should free them after "
                       "its forward, as fully_shard does by default (hint 2)."),
)

# Why a rank holds more than the budget, told by what its forward saved for backward.
OVER_BUDGET_CAUSES = (
    Mistake("no checkpointing",
             lambda r: r.saved >= r.activations(),
             lambda r: f"the forward saved {r.saved:,} bytes for backward, as much as without any "
                       "checkpointing: checkpoint every block (checkpoint_blocks(model)), so each keeps "
                       "only its input and backward recomputes the rest."),
)

# Checkpointing the whole model in one call saves only the model's input and what the loss keeps,
# less than per-block checkpointing saves on the batch the forward saw, in what it computed in (a
# forward in bf16 saves less than one in fp32, a micro-batch less than the batch: neither is this).
WHOLE_MODEL_CHECKPOINTED = Mistake(
    "whole model checkpointed",
    lambda r: r.saved < r.least_saved_per_block(),
    lambda r: f"rank {r.rank}: the forward saved only {r.saved:,} bytes for backward, less than "
              f"checkpointing every block saves ({r.least_saved_per_block():,}): the whole model is "
              "checkpointed in one call. Backward then recomputes the whole forward at once and holds all "
              "of its activations again, so the peak does not drop. Checkpoint each block (hint 1).")

# Why training ended elsewhere than the unconstrained run, told by what the worker saw of the
# forward: the dtypes its modules computed in, and how many sequences it saw. Not by the bytes it
# saved: a bf16 forward saves about what an fp32 forward of half the batch saves.
DRIFT_CAUSES = (
    Mistake("bf16 compute",
             lambda r: r.fit["computed_in"] != ["torch.float32"],
             lambda r: f"the forward computed in {', '.join(r.fit['computed_in'])} (MixedPrecisionPolicy or "
                       "autocast), and bf16 rounds every product to 8 bits of mantissa. Stay in fp32: "
                       "sharding and checkpointing fit the budget without changing a single bit (hint 1)."),
    Mistake("accumulated micro-batches",
             lambda r: r.fit["forward_batch"] < r.batch,
             lambda r: f"the forward saw {r.fit['forward_batch']} sequences, the unconstrained run's {r.batch}: "
                       "accumulating micro-batches adds the gradients in another order, so the result differs "
                       "by rounding (or by a factor if the loss is not divided by the number of "
                       "micro-batches). Here keep the batch: sharding and checkpointing are enough (hint 1)."),
)


def _check_built(r: _Rank) -> None:
    """build() returned the colleague's model in fp32, created on the meta device."""
    name_the_first(BUILD_MISTAKES, r)


def _check_sharded(r: _Rank) -> None:
    """Every block and then the root are FSDP units: each rank keeps 1/N of the parameters."""
    name_the_first(SHARDING_MISTAKES, r)


def _check_saved_for_backward(r: _Rank) -> None:
    """The rank fits the budget, and its forward saved what per-block checkpointing saves."""
    if r.total > r.budget:
        name_the_first(OVER_BUDGET_CAUSES, r, before=f"{r.holds}: ")
        raise CheckFailed(f"{r.holds}: model states {r.fit['held']} and {r.saved:,} bytes saved for backward.")
    name_the_first((WHOLE_MODEL_CHECKPOINTED,), r)


# After to_empty() the shards hold whatever was in that memory: the weights `initial` and the
# buffers __init__ computes must be put back, each its own way.
INITIALISATION_MISTAKES = (
    Mistake("weights left uninitialised",
            lambda r: not _tensors_equal(r.report["start"], r.report["initial"]),
            lambda r: f"rank {r.rank}: the model build() returned does not start from the weights `initial` (largest "
                      f"difference {largest_difference(r.report['start'], r.report['initial'])[0]:.3g}). After "
                      "to_empty() the shards hold whatever was in that memory: after to_empty the weights must "
                      "come from rank 0's full state dict, rank 0 sending each rank its shards (Hint 2 names "
                      "the call)."),
    Mistake("buffer left uninitialised",
            lambda r: not _tensors_equal(r.report["buffers"], r.report["expected_buffers"]),
            lambda r: f"rank {r.rank}: the buffer {', '.join(r.wrong_buffers)} of the model build() returned is not "
                      "what the model computes in __init__. to_empty() allocates the buffers uninitialised, like "
                      "the parameters, and set_model_state_dict cannot fill this one: a buffer registered with "
                      "persistent=False is in no state dict. After to_empty, compute it again, as __init__ does "
                      "(computing it before to_empty does not help: to_empty replaces it)."),
)


def _check_initialised(r: _Rank) -> None:
    """After to_empty() the model holds the weights `initial` and the buffers __init__ computes."""
    name_the_first(INITIALISATION_MISTAKES, r)


def _check_trained(r: _Rank) -> None:
    """Training ended bit for bit where the unconstrained run ended."""
    if _tensors_equal(r.fit["params"], r.ddp["params"]):
        return
    error = largest_difference(r.fit["params"], r.ddp["params"])[0]
    differ = f"rank {r.rank}: the parameters after training differ from the unconstrained run by up to {error:.3g}: "
    name_the_first(DRIFT_CAUSES, r, before=differ)
    raise CheckFailed(differ + "train the same model on the same batches: start from `initial`, shard with "
                      "fully_shard, checkpoint per block, and change nothing else.")


def check_fits_budget(results, budget: float) -> None:
    """Check exercise 1: every rank's bytes (parameters, gradients, Adam moments, activations
    saved for backward) are within ``budget``, and training ended bit for bit where the
    unconstrained run (DDP) ended.

    ``results[rank]`` (``launch(...).reports``) holds "ddp" and "fit" (each: "held", the
    bytes by kind after the last step; "saved", the bytes saved by its forward; "params",
    the full parameters after training; "dtypes"; "gathered", the parameter bytes still
    gathered after the forward, beyond the shards; "computed_in", the dtypes of its modules'
    outputs; "forward_batch", the sequences its last forward saw), "units" (the built
    model's FSDP units by name: whether each reshards after its forward), "start" (the
    built model's full parameters before training), "initial" (the weights it should start from),
    "created_on" (the device type its weights were created on: "meta" if it was never
    whole), "buffers" and "expected_buffers" (the built model's buffers and the unconstrained
    model's), "shape" (TinyTransformer's arguments), "batch" and "seq".
    """
    results = launch_reports(results, "the model's build in fit_budget.py")  # a launch (check=False) or its reports
    ranks = sorted(results)
    if not ranks:
        raise CheckFailed("no rank reported anything: did the worker call runtime.report(...)?")
    first = results[ranks[0]]
    model = _Model(first["shape"], first["seq"])
    for rank in ranks:  # every step on one rank before the next rank
        r = _Rank(rank, results[rank], model, len(ranks), budget)
        _check_built(r)
        _check_sharded(r)
        _check_saved_for_backward(r)
        _check_initialised(r)
        _check_trained(r)
    worst = max(_bytes(results[rank]["fit"]) for rank in ranks)
    passed(f"every rank holds at most {worst:,} bytes (budget {budget:,.0f}; unconstrained "
           f"{_bytes(first['ddp']):,}) and ends bit for bit where the unconstrained run ends")


def _plan_total(model, seq, micro_batch, shard, precision, checkpoint, states_factor=1.0,
                optimizer=True):
    """memory_plan's total, or what a mistaken variant of it gives (``shard``: the ranks the
    states are spread over)."""
    from ..costmodel import MODEL_SHAPES, activation_bytes, transformer_params, zero_memory_breakdown

    layers, dim, hidden, heads, vocab, max_seq = MODEL_SHAPES[model]
    psi = transformer_params(layers, dim, hidden, vocab, max_seq)
    states = zero_memory_breakdown(psi, shard, 3, k=8 if optimizer else 0, param_bytes=4, grad_bytes=4)
    return states_factor * sum(states.values()) + activation_bytes(
        micro_batch, seq, dim, hidden, layers, heads, vocab, precision=precision, checkpoint=checkpoint)


# Jobs the check asks about: (model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint)
PEAK_JOBS = [
    ("Llama 3 8B", 4096, 64, 8, 4, 8, "bf16", True),
    # HSDP: 8 GPUs, states sharded over groups of 2 (before the next job, where states over all
    # 8 GPUs instead of 4 would read like Adam's moments left out)
    ("Llama 3.2 1B", 1024, 64, 8, 1, 2, "bf16", True),
    ("Llama 3.2 1B", 2048, 128, 8, 2, 4, "autocast", False),
    ("tiny (chapter 11)", 16, 16, 2, 1, 2, "fp32", True),
    ("Llama 3 70B", 8192, 32, 8, 4, 8, "fp32", True),
]


class _Peak:
    """A job of PEAK_JOBS, what peak_bytes predicted for it, and what the cost model gives."""

    def __init__(self, job, got, expected):
        self.job, self.got, self.expected = job, got, expected

    def total(self, **change) -> float:
        """The cost model's total with ``change`` made to what it is made from (micro, shard_over,
        precision, checkpoint: each a value or a function of the job; states_factor, optimizer)."""
        model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint = self.job
        parts = dict(micro=global_batch // (gpus * accumulation), shard_over=shard, precision=precision,
                     checkpoint=checkpoint)
        parts.update({k: v(self.job) if callable(v) else v for k, v in change.items()})
        return _plan_total(model, seq, parts.pop("micro"), parts.pop("shard_over"), parts.pop("precision"),
                           parts.pop("checkpoint"), **parts)

    def gives(self, **change) -> bool:
        """Whether the prediction is the total with ``change`` made, where that is not the right one."""
        value = self.total(**change)
        return value != self.expected and abs(self.got - value) <= 1e-9 * value


# The usual slips of exercise 2: name -> (what the learner is told, the change to the cost
# model's total that the slip makes; see _Peak.total).
PEAK_SLIP_CHANGES = {
    "micro-batch not divided by the accumulation": (
        "the micro-batch is the global batch divided by the GPUs AND by the accumulation steps: one forward sees "
        "global_batch // (gpus * accumulation) sequences", dict(micro=lambda job: job[2] // job[3])),
    "the whole global batch in one forward": (
        "the global batch is spread over the GPUs: one forward sees global_batch // (gpus * accumulation) "
        "sequences, not the whole global batch", dict(micro=lambda job: job[2])),
    "states not sharded": (
        "the model states are sharded: each GPU holds 1/F of them (zero_memory_breakdown with dp_size = shard and "
        "stage 3)", dict(states_factor=lambda job: job[5])),
    "states sharded over every GPU": (
        "the states are sharded over a group of F = shard GPUs, not over all of them: with fewer (HSDP) each group "
        "holds its own replica", dict(shard_over=lambda job: job[3])),
    "no optimizer state": ("Adam's two moments are missing: k=8 bytes per parameter of optimizer state",
                           dict(optimizer=False)),
    "checkpointing ignored": ("the activations ignore checkpointing: pass checkpoint=checkpoint to activation_bytes",
                              dict(checkpoint=lambda job: not job[7])),
    "activations in fp32": ("the activations are counted in fp32: pass precision=precision to activation_bytes",
                            dict(precision="fp32")),
    "no fp32 master weights": ("mixed precision keeps fp32 master weights and gradients: 4 + 4 + 8 = 16 bytes per "
                               "parameter, not 2 + 2 + 8", dict(states_factor=12 / 16)),
}


def _peak_slip(name: str, what: str, change: dict) -> Mistake:
    return Mistake(name, lambda p: p.gives(**change),
                   lambda p: f"for {p.job}: you predict {p.got / 1e9:,.6g} GB, the cost model {p.expected / 1e9:,.6g} "
                             f"GB: {what}.")


PEAK_SLIPS = tuple(_peak_slip(name, what, change) for name, (what, change) in PEAK_SLIP_CHANGES.items())


def check_peak_prediction(peak_bytes) -> None:
    """Check exercise 2: ``peak_bytes(model, seq, global_batch, gpus, accumulation, shard,
    precision, checkpoint)`` against ``costmodel.memory_plan`` on several jobs, naming the
    usual slip when they disagree."""
    from ..costmodel import fit_suggestions, memory_plan

    # The exercise is to add up the parts: the cost model's whole plan hands back the answer.
    with borrowing_refused("peak_bytes", (memory_plan, fit_suggestions), "Add up the model states and "
                           "the activations yourself, from the smaller pieces of the cost model.",
                           answers=[peak_bytes]):
        _check_peaks(peak_bytes, memory_plan)
    passed(f"peak_bytes agrees with costmodel.memory_plan on {len(PEAK_JOBS)} jobs")


def _check_peaks(peak_bytes, memory_plan) -> None:
    for job in PEAK_JOBS:
        model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint = job
        micro = global_batch // (gpus * accumulation)
        expected = memory_plan(model, seq, micro, dp=gpus, shard=shard, precision=precision,
                               checkpoint=checkpoint)["total"]
        got = peak_bytes(*job)
        if got is None:
            raise CheckFailed("peak_bytes returned None: return the number of bytes")
        if abs(got - expected) <= 1e-9 * expected:
            continue
        name_the_first(PEAK_SLIPS, _Peak(job, got, expected))
        raise CheckFailed(f"for {job}: you predict {got / 1e9:,.6g} GB, the cost model "
                          f"{expected / 1e9:,.6g} GB. Add the sharded states (16 bytes per parameter "
                          "over F ranks) and activation_bytes of one micro-batch.")
