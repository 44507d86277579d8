"""Exercise checks for chapter 06: fully sharded data parallel (ZeRO-1 by hand)."""

from __future__ import annotations

from ._common import CheckFailed, close, passed


def check_zero1(results: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Check a hand-written ZeRO stage 1 against DDP trained on the same batches.

    ``results[rank]`` (what ``launch(...).results`` gives) holds: "zero1", the flat
    parameters of the rank's model after training; "ddp", the flat parameters of the DDP
    reference; "owned", the (start, end) slice of the flat parameters the rank steps;
    "optimizer_numel", how many elements of momentum the rank's optimizer keeps; and
    optionally "initial", the flat parameters before training.
    """
    ranks = sorted(results)
    if not ranks:
        raise CheckFailed("no rank reported anything: did the worker call runtime.report(...)?")
    total = results[ranks[0]]["ddp"].numel()
    world = len(ranks)
    not_gathered = ("the updated parameters were not all-gathered after the step: every rank "
                    "must all_gather the updated slices and copy them into its full model "
                    "before the next forward.")

    for rank in ranks:
        held = int(results[rank]["optimizer_numel"])
        if world > 1 and held >= total:
            raise CheckFailed(
                f"rank {rank} keeps optimizer state for {held:,} elements, the whole model "
                f"({total:,}): it steps the whole model, so the optimizer state is not sharded "
                f"(that is plain DDP memory). Give the optimizer only this rank's slice "
                f"flat[start:end] (about {total // world:,} elements) and step only that.")

    spans = sorted(tuple(int(i) for i in results[rank]["owned"]) for rank in ranks)
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise CheckFailed(
                f"the owned slices {spans} do not tile [0, {total:,}) without gaps or overlaps: "
                "rank r should own [r * shard_size, min((r + 1) * shard_size, total)).")
        position = end
    if position != total:
        raise CheckFailed(f"the owned slices {spans} stop at {position:,}, not at {total:,}: "
                          "round the shard size up (ceil(total / world_size)).")

    flat = {rank: results[rank]["zero1"].detach().double() for rank in ranks}
    for rank in ranks:
        initial = results[rank].get("initial")
        if initial is not None and close(flat[rank], initial, rtol, atol):
            raise CheckFailed(f"rank {rank}: the model's parameters never changed: the optimizer "
                              f"stepped its own copy of the slice, but {not_gathered}")
    for rank in ranks[1:]:
        if not close(flat[rank], flat[ranks[0]], rtol, atol):
            differ = (flat[rank] - flat[ranks[0]]).abs().max().item()
            raise CheckFailed(f"ranks {ranks[0]} and {rank} end with different parameters (max "
                              f"difference {differ:.2e}): {not_gathered}")

    for rank in ranks:
        zero1, ddp = flat[rank], results[rank]["ddp"].detach().double()
        if close(zero1, ddp, rtol, atol):
            continue
        start, end = (int(i) for i in results[rank]["owned"])
        error = (zero1 - ddp).abs().max().item()
        if close(zero1[start:end], ddp[start:end], rtol, atol):
            raise CheckFailed(
                f"rank {rank}: its own slice [{start:,}, {end:,}) matches DDP but the rest of "
                f"its model does not (max error {error:.2e}): {not_gathered}")
        raise CheckFailed(
            f"rank {rank}: the parameters differ from DDP (max error {error:.2e}). Average the "
            "gradients over ranks (all_reduce, then divide by the world size) before the step, "
            "and give the optimizer the gradient of its own slice.")
    passed(f"ZeRO-1 by hand on {world} ranks matches DDP; each rank keeps optimizer state for "
           f"{max(int(results[r]['optimizer_numel']) for r in ranks):,} of {total:,} elements")
