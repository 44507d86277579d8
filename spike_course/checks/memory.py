"""Exercise checks for chapter 11: making a model fit (a memory budget on N ranks; predicting
a job's bytes per GPU with the cost model)."""

from __future__ import annotations

from ._common import CheckFailed, borrowed_names, largest_difference, passed


def _tensors_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def check_fits_budget(results: dict, budget: float) -> None:
    """Check exercise 1: every rank's bytes (parameters, gradients, Adam moments, activations
    saved for backward) are within ``budget``, and training ended bit for bit where the
    unconstrained run (DDP) ended.

    ``results[rank]`` (``launch(...).reports``) holds "ddp" and "fit" (each: "held", the
    bytes by kind after the last step; "saved", the bytes saved by its forward; "params",
    the full parameters after training; "dtypes"; "gathered", the parameter bytes still
    gathered after the forward, beyond the shards), "start" (the built model's full
    parameters before training), "initial" (the weights it should start from),
    "created_on" (the device type its weights were created on: "meta" if it was never
    whole), "buffers" and "expected_buffers" (the built model's buffers and the unconstrained
    model's), "shape" (TinyTransformer's arguments), "batch" and "seq".
    """
    import torch

    from ..costmodel import activation_bytes, transformer_params

    ranks = sorted(results)
    if not ranks:
        raise CheckFailed("no rank reported anything: did the worker call runtime.report(...)?")
    first = results[ranks[0]]
    shape, world = first["shape"], len(ranks)
    layers, dim, hidden = shape["n_layers"], shape["dim"], shape["hidden"]
    psi = transformer_params(layers, dim, hidden, shape["vocab_size"], shape["max_seq_len"])
    root = psi - layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim)  # embeddings, norm, output

    def activations(batch, **options):
        return activation_bytes(batch, first["seq"], dim, hidden, layers, shape["n_heads"],
                                shape["vocab_size"], **options)

    for rank in ranks:
        fit, ddp, batch = results[rank]["fit"], results[rank]["ddp"], results[rank]["batch"]
        if fit["dtypes"] != ["torch.float32"]:
            raise CheckFailed(
                f"rank {rank}: the parameters are {', '.join(fit['dtypes'])}: casting the model to "
                "bf16 (model.to(torch.bfloat16)) drops the fp32 master weights, and Adam's small "
                "updates are rounded away. Keep fp32 parameters (bf16 compute would be "
                "MixedPrecisionPolicy, but here the result must not change at all).")
        buffers, expected = results[rank]["buffers"], results[rank]["expected_buffers"]
        if buffers.keys() != expected.keys():
            raise CheckFailed(
                f"rank {rank}: the model build() returned has the buffers {sorted(buffers) or 'none'}, the "
                f"unconstrained one {sorted(expected)}: build the colleague's model (the class the "
                "unconstrained run uses), not another one with the same parameters.")
        if results[rank]["created_on"] != "meta":
            raise CheckFailed(
                f"rank {rank} created the whole model on {results[rank]['created_on']} (all "
                f"{4 * psi:,} bytes of parameters, on every rank) before sharding it: for a model that "
                "does not fit one GPU, that is the line that fails. Create it under "
                'with torch.device("meta"): (shapes, no memory), shard it, then model.to_empty(device=...) '
                "allocates only this rank's shards.")
        held, saved = fit["held"], fit["saved"]
        parameters, total = held["parameters"], sum(held.values()) + saved
        over = f"rank {rank} holds {total:,} bytes ({'over' if total > budget else 'within'} the budget of {budget:,.0f})"
        if parameters >= 4 * psi:
            raise CheckFailed(
                f"{over}: the parameters take {parameters:,} bytes on every rank, the whole model: "
                "nothing is sharded. Call fully_shard(block, mesh=mesh) on each block and then "
                "fully_shard(model, mesh=mesh) on the root, so each rank keeps 1/N of the "
                "parameters, gradients and Adam state.")
        if parameters > 4 * psi / world + 4 * world:
            raise CheckFailed(
                f"{over}: the parameters take {parameters:,} bytes, more than 1/{world} of the model "
                f"({4 * psi / world:,.0f}): the blocks are sharded but the root is not, so the "
                "embeddings, the final norm and the output layer stay whole on every rank (and each "
                "block, left as a root of its own, stays gathered after its forward). Call "
                "fully_shard(model, mesh=mesh) after the blocks.")
        if fit["gathered"] > 4 * root:
            raise CheckFailed(
                f"rank {rank}: after the forward it still held {fit['gathered']:,} bytes of gathered "
                "parameters, more than the root module's: the blocks are not FSDP units of their own, so "
                "the whole model is one unit, gathered whole for the forward and the backward. Call "
                "fully_shard(block, mesh=mesh) on every block before fully_shard(model, mesh=mesh).")
        if total > budget:
            if saved >= activations(batch):
                why = (f"the forward saved {saved:,} bytes for backward, as much as without any "
                       "checkpointing: checkpoint every block (checkpoint_blocks(model)), so each keeps "
                       "only its input and backward recomputes the rest.")
            else:
                why = f"model states {held} and {saved:,} bytes saved for backward."
            raise CheckFailed(f"{over}: {why}")
        known = {activations(b, checkpoint=c, precision=p) for b in range(1, batch + 1)
                 for c in (False, True) for p in ("fp32", "autocast", "bf16")}
        if saved < activations(batch, checkpoint=True) and saved not in known:
            raise CheckFailed(
                f"rank {rank}: the forward saved only {saved:,} bytes for backward, less than the "
                "blocks' inputs: the whole model is checkpointed in one call. Backward then recomputes "
                "the whole forward at once and holds all of its activations again, so the peak does not "
                "drop. Checkpoint each block (checkpoint_blocks(model)).")

        if not _tensors_equal(results[rank]["start"], results[rank]["initial"]):
            raise CheckFailed(
                f"rank {rank}: the model build() returned does not start from the weights `initial` "
                "(largest difference "
                f"{largest_difference(results[rank]['start'], results[rank]['initial'])[0]:.3g}). After "
                "to_empty() the shards hold whatever was in that memory: load the weights with "
                "set_model_state_dict(model, checkpoint, options=StateDictOptions("
                "full_state_dict=True, broadcast_from_rank0=True)) after to_empty: rank 0 sends each "
                "rank its shards.")

        if not _tensors_equal(buffers, expected):
            wrong = sorted(n for n in expected if not torch.equal(buffers[n], expected[n]))  # same names: checked above
            raise CheckFailed(
                f"rank {rank}: the buffer {', '.join(wrong)} of the model build() returned is not what the "
                "model computes in __init__. to_empty() allocates the buffers uninitialised, like the "
                "parameters, and set_model_state_dict cannot fill this one: a buffer registered with "
                "persistent=False is in no state dict. After to_empty, compute it again, as __init__ does "
                "(computing it before to_empty does not help: to_empty replaces it).")
        if not _tensors_equal(fit["params"], ddp["params"]):
            error = largest_difference(fit["params"], ddp["params"])[0]
            if saved in (activations(batch, checkpoint=True, precision="bf16"), activations(batch, precision="bf16")):
                why = ("the forward ran in bf16 (MixedPrecisionPolicy or autocast), which rounds every "
                       "product to 8 bits of mantissa. Stay in fp32: sharding and checkpointing fit the "
                       "budget without changing a single bit.")
            elif any(saved in (activations(b), activations(b, checkpoint=True)) for b in range(1, batch)):
                why = ("the forward saw a smaller batch than the unconstrained run: accumulating "
                       "micro-batches adds the gradients in another order, so the result differs by "
                       "rounding (or by a factor if the loss is not divided by the number of "
                       "micro-batches). Here keep the batch: sharding and checkpointing are enough.")
            else:
                why = ("train the same model on the same batches: start from `initial`, shard with "
                       "fully_shard, checkpoint per block, and change nothing else.")
            raise CheckFailed(f"rank {rank}: the parameters after training differ from the "
                              f"unconstrained run by up to {error:.3g}: {why}")
    worst = max(sum(results[r]["fit"]["held"].values()) + results[r]["fit"]["saved"] for r in ranks)
    unconstrained = sum(first["ddp"]["held"].values()) + first["ddp"]["saved"]
    passed(f"every rank holds at most {worst:,} bytes (budget {budget:,.0f}; unconstrained "
           f"{unconstrained:,}) and ends bit for bit where the unconstrained run ends")


def _plan_total(model, seq, micro_batch, shard, precision, checkpoint, states_factor=1.0,
                optimizer=True):
    """memory_plan's total, or what a mistaken variant of it gives."""
    from ..costmodel import MODEL_SHAPES, activation_bytes, transformer_params, zero_memory_breakdown

    layers, dim, hidden, heads, vocab, max_seq = MODEL_SHAPES[model]
    psi = transformer_params(layers, dim, hidden, vocab, max_seq)
    states = zero_memory_breakdown(psi, shard, 3, k=8 if optimizer else 0, param_bytes=4, grad_bytes=4)
    return states_factor * sum(states.values()) + activation_bytes(
        micro_batch, seq, dim, hidden, layers, heads, vocab, precision=precision, checkpoint=checkpoint)


# Jobs the check asks about: (model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint)
PEAK_JOBS = [
    ("Llama 3 8B", 4096, 64, 8, 4, 8, "bf16", True),
    ("Llama 3.2 1B", 2048, 128, 8, 2, 4, "autocast", False),
    ("tiny (chapter 11)", 16, 16, 2, 1, 2, "fp32", True),
    ("Llama 3 70B", 8192, 32, 8, 4, 8, "fp32", True),
]


def _peak_slips(job) -> dict:
    """{the slip, named: the total it predicts for ``job``} for the usual slips of exercise 2."""
    model, seq, global_batch, gpus, accumulation, shard, precision, checkpoint = job
    micro = global_batch // (gpus * accumulation)
    return {
        "the micro-batch is the global batch divided by the GPUs AND by the accumulation steps: "
        "one forward sees global_batch // (gpus * accumulation) sequences":
            _plan_total(model, seq, global_batch // gpus, shard, precision, checkpoint),
        "the global batch is spread over the GPUs: one forward sees global_batch // (gpus * "
        "accumulation) sequences, not the whole global batch":
            _plan_total(model, seq, global_batch, shard, precision, checkpoint),
        "the model states are sharded: each GPU holds 1/F of them (zero_memory_breakdown with "
        "dp_size = shard and stage 3)":
            _plan_total(model, seq, micro, shard, precision, checkpoint, states_factor=shard),
        "Adam's two moments are missing: k=8 bytes per parameter of optimizer state":
            _plan_total(model, seq, micro, shard, precision, checkpoint, optimizer=False),
        "the activations ignore checkpointing: pass checkpoint=checkpoint to activation_bytes":
            _plan_total(model, seq, micro, shard, precision, not checkpoint),
        "the activations are counted in fp32: pass precision=precision to activation_bytes":
            _plan_total(model, seq, micro, shard, "fp32", checkpoint),
        "mixed precision keeps fp32 master weights and gradients: 4 + 4 + 8 = 16 bytes per "
        "parameter, not 2 + 2 + 8":
            _plan_total(model, seq, micro, shard, precision, checkpoint, states_factor=12 / 16),
    }


def _check_own_sum(peak_bytes) -> None:
    """The exercise is to add up the parts: calling the cost model's whole plan (by its name
    or an alias) hands back the answer the check compares with."""
    from .. import costmodel

    used = borrowed_names(peak_bytes, forbidden=(costmodel.memory_plan, costmodel.fit_suggestions),
                          attributes=("memory_plan", "fit_suggestions"))
    if used:
        raise CheckFailed(f"peak_bytes calls {', '.join(used)}: the course's whole memory plan, which is "
                          "what this check compares with. Add up the model states and the activations "
                          "yourself, from the smaller pieces of the cost model.")


def check_peak_prediction(peak_bytes) -> None:
    """Check exercise 2: ``peak_bytes(model, seq, global_batch, gpus, accumulation, shard,
    precision, checkpoint)`` against ``costmodel.memory_plan`` on several jobs, naming the
    usual slip when they disagree."""
    from ..costmodel import memory_plan

    _check_own_sum(peak_bytes)
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
        slips = _peak_slips(job)
        for slip, value in slips.items():
            if value != expected and abs(got - value) <= 1e-9 * value:
                raise CheckFailed(f"for {job}: you predict {got / 1e9:,.6g} GB, the cost model "
                                  f"{expected / 1e9:,.6g} GB: {slip}.")
        raise CheckFailed(f"for {job}: you predict {got / 1e9:,.6g} GB, the cost model "
                          f"{expected / 1e9:,.6g} GB. Add the sharded states (16 bytes per parameter "
                          "over F ranks) and activation_bytes of one micro-batch.")
    passed(f"peak_bytes agrees with costmodel.memory_plan on {len(PEAK_JOBS)} jobs")
