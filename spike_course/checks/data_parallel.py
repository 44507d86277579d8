"""Exercise checks for chapter 03: data parallel."""

from __future__ import annotations

from ._common import CheckFailed, all_close, close, largest_difference, launch_reports, passed


def _same_names_all_close(a: dict, b: dict, rtol: float, atol: float, factor: float = 1.0) -> bool:
    return a.keys() == b.keys() and all_close(a, b, factor, rtol, atol)


def check_flat_allreduce(job, reference: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Check exercise 1 of chapter 03: data parallel that averages every gradient with ONE
    all-reduce per step, against one process that saw every rank's batch.

    ``job`` is the launch of ``average_by_hand.py`` (``launch(..., check=False)``, so that a
    blank exercise reaches this check) or its ``reports``. Each rank and ``reference`` (one
    process that trained on the concatenated batches) report ``"initial"`` (parameters before
    the first step, after the broadcast), ``"grads"`` (the first step's gradients, after any
    averaging, just before ``optimizer.step``) and ``"final"`` (parameters at the end), each a
    dict name -> tensor; each rank also reports ``"local"`` (its own gradients of the first
    step, before averaging) and ``"collectives"`` (``CommDebugMode``'s counts of that
    averaging, by op name such as ``"allreduce_"``).
    """
    import torch

    ranks = launch_reports(job, "average_gradients_flat")
    for rank, got in sorted(ranks.items()):
        if "collectives" not in got or "local" not in got:
            raise CheckFailed(f"rank {rank} did not report 'local' and 'collectives': run the worker as given, "
                              "with only average_gradients_flat changed.")
        kept = [name for name in got["grads"] if torch.equal(got["grads"][name], got["local"][name])]
        if not kept:
            continue
        if not sum(got["collectives"].values()):
            raise CheckFailed(
                f"average_gradients_flat made no collective: rank {rank}'s gradients are its own batch's. "
                "Pack every .grad into one buffer, dist.all_reduce it, divide by the world size and copy "
                "the slices back into the .grads.")
        if len(kept) == len(got["grads"]):
            raise CheckFailed(
                f"the averaged buffer was never copied back into .grad: after your call rank {rank}'s "
                f"gradients are exactly its own batch's, although it made {_describe(got['collectives'])}. "
                "torch.cat (like flatten of several tensors) makes a new tensor, a copy; the all-reduce changed "
                "that copy only. Write each slice back in place (p.grad.copy_(...)); assigning it to a loop "
                "variable (g = flat[...]) changes nothing.")
        raise CheckFailed(f"only some gradients were copied back from the flat buffer: rank {rank}'s "
                          f"{', '.join(kept)} still hold its own batch's gradient. Copy every parameter's slice.")
    zero = ranks[min(ranks)]
    misplaced = _misplaced_slice(zero["grads"], reference["grads"], rtol, atol)
    if misplaced:
        name, at, own = misplaced
        raise CheckFailed(
            f"the slices are misaligned: {name}.grad holds the buffer's values from position {at}, but "
            f"{name}'s own gradient starts at {own}. Advance the offset by p.grad.numel() after each "
            "parameter, and unpack in the same order as you packed.")
    _compare_training(ranks, reference, rtol, atol)
    counts = {rank: got["collectives"] for rank, got in ranks.items()}
    for rank, count in sorted(counts.items()):
        reduces, total = count.get("allreduce_", 0), sum(count.values())
        if reduces > 1:
            raise CheckFailed(
                f"the gradients are right, but with {reduces} all-reduces in one step on rank {rank} (one per "
                f"parameter? the model has {len(zero['grads'])}): flatten into one buffer and all-reduce it "
                "once. Each collective pays its start-up latency however small its tensor; that is why DDP "
                "packs the gradients into buckets.")
        if total != 1:
            raise CheckFailed(f"the gradients are right, but rank {rank} made {_describe(count)} in one step: "
                              "one all-reduce (SUM) of one flat buffer is all it takes.")
    passed(f"{len(ranks)} ranks trained exactly like one process with the whole batch, averaging "
           f"{len(zero['grads'])} gradients with one all-reduce per step")


def _describe(counts: dict) -> str:
    return ", ".join(f"{n} {op.rstrip('_')}" for op, n in counts.items() if n) or "no collective"


def _misplaced_slice(grads: dict, expected: dict, rtol: float, atol: float):
    """(name, position, own position) when a gradient holds another part of the flat buffer."""
    import torch

    flat = torch.cat([torch.as_tensor(expected[name]).flatten() for name in grads])
    starts, at = {}, 0
    for name, value in grads.items():
        starts[name], at = at, at + value.numel()
    for name, value in grads.items():
        n = value.numel()
        if close(value.flatten(), flat[starts[name]:starts[name] + n], rtol, atol):
            continue
        for start in sorted(set(starts.values())):
            if start != starts[name] and start + n <= len(flat) and close(
                    value.flatten(), flat[start:start + n], rtol, atol):
                return name, start, starts[name]
    return None


def _compare_training(ranks: dict, reference: dict, rtol: float, atol: float) -> None:
    """Raise CheckFailed naming the first way ``ranks`` did not train like ``reference``."""
    world_size = len(ranks)
    zero = ranks[min(ranks)]
    for rank, got in sorted(ranks.items()):
        diff, name = largest_difference(got["initial"], zero["initial"])
        if diff > 0:
            raise CheckFailed(
                f"the weights were not broadcast at the start: before the first step rank {rank}'s {name} "
                f"differs from rank {min(ranks)}'s by {diff:.3g}. Each rank built its model from its own "
                "random seed, so the replicas train different models. Broadcast every parameter from rank 0 "
                "(dist.broadcast(p.data, src=0)) before training, as DistributedDataParallel does.")
    if not _same_names_all_close(zero["initial"], reference["initial"], rtol, atol):
        diff, name = largest_difference(zero["initial"], reference["initial"])
        raise CheckFailed(f"all ranks start from the same weights, but not rank 0's ({name} differs by {diff:.3g}): "
                          "broadcast with src=0")
    for rank, got in sorted(ranks.items()):
        diff, name = largest_difference(got["grads"], zero["grads"])
        if diff > atol + rtol * max(_largest_magnitude(zero["grads"]), 1e-12):
            raise CheckFailed(
                f"the gradients were not all-reduced: after backward rank {rank}'s {name}.grad differs from "
                f"rank {min(ranks)}'s by {diff:.3g}, so each replica steps with its own batch's gradient and "
                "the replicas drift apart. all_reduce every p.grad before optimizer.step().")
    grads, expected = zero["grads"], reference["grads"]
    if not _same_names_all_close(grads, expected, rtol, atol):
        if world_size > 1 and _same_names_all_close(grads, expected, rtol, atol, factor=world_size):
            raise CheckFailed(
                f"the gradients were summed but not averaged: they are {world_size} times too big ({world_size} "
                "is the world size). all_reduce with ReduceOp.SUM adds the ranks' gradients; divide "
                "by dist.get_world_size() afterwards to get the mean over the whole batch.")
        if world_size > 1 and _same_names_all_close(grads, expected, rtol, atol, factor=1 / world_size):
            raise CheckFailed(
                f"the gradients are 1/{world_size} of the single-process gradient: divided by the world size "
                "twice (ReduceOp.AVG already averages), or divided without all-reducing first.")
        diff, name = largest_difference(grads, expected)
        raise CheckFailed(f"the first step's gradients differ from the single-process gradients ({name} by "
                          f"{diff:.3g}): all-reduce (sum) every parameter's .grad, then divide by the world size")
    for rank, got in sorted(ranks.items()):
        if not _same_names_all_close(got["final"], reference["final"], rtol, 10 * atol):
            diff, name = largest_difference(got["final"], reference["final"])
            raise CheckFailed(
                f"the first step is right, but after training rank {rank}'s {name} differs from the "
                f"single-process model by {diff:.3g}: average the gradients in EVERY step, after "
                "loss.backward() and before optimizer.step() (and zero them before each backward).")


def _largest_magnitude(tensors: dict) -> float:
    return max(float(v.abs().max()) for v in tensors.values())


def check_distributed_accuracy(reported: dict, correct: int, total: int, shards: dict,
                               evaluated: dict | None = None) -> None:
    """Check an all-reduced evaluation against a single-process count of ``correct`` of ``total``.

    ``reported[r]`` is the accuracy rank r's evaluate() returned; ``shards[r]`` is that rank's
    own ``(correct, seen, correct_with_padding, seen_with_padding)``: its counts over
    its real samples, and over everything its DistributedSampler gave it, padding included;
    ``evaluated[r]`` how many samples rank r's model ran on during evaluate(). Names the
    usual mistakes; a whole test set evaluated on every rank gives the right number, so the
    split is checked first.
    """
    if evaluated is not None:
        _check_split(evaluated, total)
    expected = correct / total
    values = {rank: float(value) for rank, value in reported.items()}
    if len(set(values.values())) > 1:
        raise CheckFailed(
            f"the ranks report different accuracies {values}: each one measured its own shard only. "
            "all_reduce the correct and seen counts (ReduceOp.SUM) so that every rank gets the whole "
            "test set's accuracy.")
    value = next(iter(values.values()))
    if abs(value - expected) < 1e-6:
        return passed(f"all-reduced accuracy {value:.4f} equals the single-process accuracy ({correct}/{total})")
    padded_c = sum(s[2] for s in shards.values())
    padded_n = sum(s[3] for s in shards.values())
    if padded_n != total and abs(value - padded_c / padded_n) < 1e-6:
        raise CheckFailed(
            f"accuracy {value:.6f} counts the padding: {padded_n} samples, but the test set has {total}. "
            "DistributedSampler repeats a few samples so every rank gets the same number; those were "
            "counted twice. Count a sample only where its position i * num_replicas + rank is below "
            "len(dataset).")
    for rank, s in sorted(shards.items()):
        if any(n and abs(value - c / n) < 1e-6 for c, n in ((s[0], s[1]), (s[2], s[3]))):
            raise CheckFailed(f"accuracy {value:.6f} is rank {rank}'s shard only, not the whole test set: "
                              "all_reduce the correct and seen counts before dividing")
    means = [sum(s[i] / s[i + 1] for s in shards.values()) / len(shards) for i in (0, 2)]
    if any(abs(value - mean) < 1e-6 for mean in means):
        raise CheckFailed(
            f"accuracy {value:.6f} is the mean of the ranks' accuracies; with shards of different sizes "
            "that is not the accuracy of the test set. all_reduce the correct and seen COUNTS, then divide.")
    raise CheckFailed(f"accuracy {value:.6f} differs from the single-process {expected:.6f} ({correct}/{total})")


def _check_split(evaluated: dict, total: int) -> None:
    """Each rank runs the model on its own share of the test set only, and the shares cover it."""
    share = -(-total // len(evaluated))  # a DistributedSampler's share, padding included
    for rank, count in sorted(evaluated.items()):
        if count > share:
            raise CheckFailed(f"rank {rank} ran the model on {count} test samples, more than one rank's "
                              f"share ({share} of {total} on {len(evaluated)} ranks): the evaluation was not "
                              "split between the ranks, so it is not distributed.")
    if sum(evaluated.values()) < total:
        raise CheckFailed(f"the ranks ran the model on {sum(evaluated.values())} test samples together, fewer "
                          f"than the {total} of the test set: some samples were never evaluated.")
