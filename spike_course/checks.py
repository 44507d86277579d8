"""Friendly checks for the exercises: compare a learner's answer with a reference and,
when it is wrong, say which mistake it most likely is.

Every check raises :class:`CheckFailed` (an AssertionError) with a message that names
the likely mistake and how to fix it, and prints one "passed" line when all is well.
"""

from __future__ import annotations


class CheckFailed(AssertionError):
    """The exercise's answer is not right yet; the message says what is likely wrong."""


def passed(what: str) -> None:
    print(f"check passed: {what}")


def close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """True when two tensors (or arrays, or numbers) agree within tolerance."""
    import torch

    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=rtol, atol=atol)


# --- chapter 04: pipeline parallel (GPipe by hand) ---


def _scale_between(actual: dict, expected: dict) -> float:
    """The factor s that best explains actual = s * expected (least squares over all tensors)."""
    import torch

    num = sum(float((torch.as_tensor(actual[k]).double() * torch.as_tensor(expected[k]).double()).sum())
              for k in expected)
    den = sum(float(torch.as_tensor(expected[k]).double().pow(2).sum()) for k in expected)
    return num / den if den else float("nan")


def _all_close(actual: dict, expected: dict, factor: float = 1.0, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    import torch

    return all(close(actual[k], factor * torch.as_tensor(expected[k]), rtol, atol) for k in expected)


def pipeline_gradients(grads: dict, reference: dict, microbatches: int, stages: dict | None = None,
                       last_microbatch: dict | None = None, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Check the gradients of a hand-written GPipe step against the single-process model.

    grads: parameter name -> gradient after the pipelined step (all stages merged).
    reference: name -> gradient of the single-process model's mean loss on the whole batch.
    microbatches: m, the number of micro-batches the batch was cut into.
    stages: name -> stage index, so a message can say which stage went wrong.
    last_microbatch: name -> gradient of the last micro-batch's own mean loss (optional;
        lets the check recognise "only the last micro-batch's gradient survived").
    """
    import torch

    m = microbatches
    stages = stages or {}
    missing = [k for k in reference if grads.get(k) is None]
    zero = [k for k in reference if k not in missing and not torch.as_tensor(grads[k]).any()
            and torch.as_tensor(reference[k]).any()]
    if missing or zero:
        names = missing + zero
        where = sorted({stages[k] for k in names if k in stages})
        if where and min(where) < max(stages.values(), default=0):
            raise CheckFailed(
                f"no gradient reached stage {where} (parameters {names}): the backward pass stops at "
                "a stage boundary unless you carry it across. The receiving stage must call "
                "requires_grad_() on the activation it received and send that activation's .grad "
                "back; the sending stage must call output.backward(received_grad) on the output it "
                "kept from the forward.")
        raise CheckFailed(f"no gradient for {names}: did the stage run backward (loss.backward()) "
                          "and report its parameters' .grad?")
    shapes = [k for k in reference if tuple(torch.as_tensor(grads[k]).shape) != tuple(torch.as_tensor(reference[k]).shape)]
    if shapes:
        raise CheckFailed(f"gradients of {shapes} have the wrong shape: report param.grad for each parameter")
    if _all_close(grads, reference, 1.0, rtol, atol):
        passed(f"GPipe gradients over {m} micro-batches equal the single-process gradients")
        return
    if last_microbatch is not None:
        for factor in (1.0 / m, 1.0):
            if _all_close(grads, last_microbatch, factor, rtol, atol):
                raise CheckFailed(
                    "only the last micro-batch's gradient is left: gradients must accumulate over "
                    "all micro-batches. Zero them once per step (before the first forward), never "
                    "inside the micro-batch loop, and let every backward add to .grad.")
    scale = _scale_between(grads, reference)
    if m > 1 and abs(scale - m) < 1e-3 * m and _all_close(grads, reference, scale, rtol, atol):
        raise CheckFailed(
            f"the gradients are {m} x too large: the micro-batch losses were not scaled by 1/m. "
            f"Each micro-batch's loss is a mean over its own samples; adding up the gradients of "
            f"{m} such means gives {m} times the gradient of the whole batch's mean. Divide each "
            f"micro-batch loss by m = {m} before its backward.")
    if m > 1 and abs(scale - 1 / m) < 1e-3 / m and _all_close(grads, reference, scale, rtol, atol):
        raise CheckFailed(
            f"the gradients are {m} x too small: the 1/m scaling was applied twice (to the loss "
            f"and again to the gradients, or on both stages). Divide each micro-batch loss by m "
            f"once, on the last stage only: the earlier stage receives gradients already scaled.")
    wrong = [k for k in reference if not close(grads[k], reference[k], rtol, atol)]
    wrong_stages = sorted({stages[k] for k in wrong if k in stages})
    if stages and wrong_stages and len(wrong_stages) < len(set(stages.values())):
        part = {k: reference[k] for k in reference if stages.get(k) in wrong_stages}
        part_scale = _scale_between(grads, part)
        if m > 1 and abs(part_scale - 1 / m) < 1e-3 / m and _all_close(grads, part, part_scale, rtol, atol):
            raise CheckFailed(
                f"stage {wrong_stages}'s gradients are {m} x too small while the other stage is "
                "right: the 1/m was applied again on the way back. The gradient a stage receives "
                "is already scaled (the last stage divided its loss by m): use it as it is.")
        if m > 1 and abs(part_scale - m) < 1e-3 * m and _all_close(grads, part, part_scale, rtol, atol):
            raise CheckFailed(
                f"stage {wrong_stages}'s gradients are {m} x too large while the other stage is "
                "right: the micro-batch losses were not scaled by 1/m where this stage's gradient "
                "comes from. Divide each micro-batch loss by m before its backward, and send back "
                "the gradient of that scaled loss.")
        raise CheckFailed(
            f"stage {wrong_stages} has wrong gradients ({wrong}) while the other stage is right: "
            "each received gradient must meet the output of the same micro-batch. Keep the "
            "forward outputs in a list and run backward in the order the gradients are sent.")
    raise CheckFailed(
        f"gradients of {wrong} differ from the single-process model's (best scale factor "
        f"{scale:.4g}). Check that the micro-batches are the batch cut in order (x.chunk(m)), "
        "that the targets are cut the same way, and that every micro-batch runs forward and backward once.")


# --- chapter 02: distributed sampling ---


def _sampler_orders(sampler_cls, size, replicas, shuffle, drop_last, epochs, seed):
    """orders[epoch][rank] from fresh samplers, one per rank, as the ranks of a job would build them."""
    dataset = list(range(size))
    samplers = [sampler_cls(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                            drop_last=drop_last) for rank in range(replicas)]
    orders = []
    for epoch in range(epochs):
        for sampler in samplers:
            if not callable(getattr(sampler, "set_epoch", None)):
                raise CheckFailed(
                    f"{sampler_cls.__name__} has no set_epoch(epoch) method. Without it every epoch "
                    "repeats the same order: store the epoch and seed the shuffle with seed + epoch.")
            sampler.set_epoch(epoch)
        orders.append([[int(i) for i in sampler] for sampler in samplers])
    return samplers, orders


def check_sampler(sampler_cls, sizes=(8, 10, 11, 13), replicas=(1, 2, 3, 4), epochs: int = 3,
                  seed: int = 0, exact: bool = True) -> None:
    """Check a sampler class with DistributedSampler's contract against the real one.

    ``sampler_cls(dataset, num_replicas=, rank=, shuffle=, seed=, drop_last=)`` must give every
    rank the same number of indices, disjoint slices that together cover the data set (padding
    with repeats, or dropping the tail with ``drop_last``), a new shuffle each ``set_epoch``,
    and (``exact=True``) the very order of ``torch.utils.data.distributed.DistributedSampler``.
    """
    from collections import Counter
    from itertools import product

    from torch.utils.data.distributed import DistributedSampler

    runs = []
    for size, n, shuffle, drop_last in product(sizes, replicas, (True, False), (False, True)):
        where = f"(data set of {size}, num_replicas={n}, shuffle={shuffle}, drop_last={drop_last})"
        options = (size, n, shuffle, drop_last, epochs, seed)
        samplers, orders = _sampler_orders(sampler_cls, *options)
        _, expected = _sampler_orders(DistributedSampler, *options)
        runs.append((where, orders, expected))
        for epoch, order in enumerate(orders):
            _check_partition(order, len(expected[0][0]), size, drop_last, epoch, where, samplers, Counter)
        if shuffle and size > 4 and all(o == orders[0] for o in orders[1:]):
            raise CheckFailed(
                f"every epoch gives the same order {where}: set_epoch has no effect, as if it were "
                "never called. Store the epoch in set_epoch and seed the generator with seed + epoch "
                "in __iter__, so each epoch shuffles differently (and every rank the same way).")
    # The partitions are valid everywhere; now are they DistributedSampler's very own?
    for where, orders, expected in runs if exact else ():
        if orders != expected:
            epoch, rank = next((e, r) for e in range(len(orders)) for r in range(len(orders[e]))
                               if orders[e][r] != expected[e][r])
            raise CheckFailed(
                f"a valid partition, but not DistributedSampler's {where}: in epoch {epoch} rank "
                f"{rank} reads {orders[epoch][rank]}, DistributedSampler gives {expected[epoch][rank]}. "
                "It uses range(len(dataset)) without shuffle, else torch.randperm(len(dataset), "
                "generator=g) after g.manual_seed(seed + epoch); pads by repeating the start of that "
                "order (or cuts the tail with drop_last), then takes order[rank:total_size:num_replicas].")
    passed(f"{sampler_cls.__name__} partitions like DistributedSampler (sizes {list(sizes)}, "
           f"{list(replicas)} replicas, shuffle and drop_last on and off, {epochs} epochs)")


def _check_partition(order, per_rank, size, drop_last, epoch, where, samplers, Counter):
    for rank, (indices, sampler) in enumerate(zip(order, samplers)):
        if len(indices) != per_rank or len(sampler) != len(indices):
            raise CheckFailed(
                f"rank {rank} reads {len(indices)} indices and says len() == {len(sampler)} in epoch {epoch} "
                f"{where}; every rank must read exactly {per_rank}. Ranks with fewer batches leave the "
                "loop early and the others hang in their next all-reduce: pad by repeating indices "
                "(drop_last=False) or drop the tail (drop_last=True) so the total divides by num_replicas.")
        outside = [i for i in indices if not 0 <= i < size]
        if outside:
            raise CheckFailed(f"rank {rank} reads indices {outside} outside the data set {where}")
    counts = Counter(i for indices in order for i in indices)
    padding = 0 if drop_last else per_rank * len(order) - size
    owners = {}
    for rank, indices in enumerate(order):
        for index in indices:
            owners.setdefault(index, set()).add(rank)
    shared = sorted(i for i, who in owners.items() if len(who) > 1)
    repeats = sum(c - 1 for c in counts.values())
    if repeats > padding or (padding == 0 and shared):
        index = shared[0] if shared else next(i for i, c in counts.items() if c > 1)
        who = sorted(owners[index])
        raise CheckFailed(
            f"the ranks overlap in epoch {epoch} {where}: index {index} is read by ranks {who}, "
            f"{repeats} repeats where at most {padding} (padding) are allowed. All ranks must cut their "
            "share from ONE common order (same seed and epoch on every rank) with order[rank::num_replicas]; "
            "a rank that ignores its rank, or shuffles with its own seed, reads its neighbours' samples.")
    missing = sorted(set(range(size)) - set(counts))
    allowed_missing = size - per_rank * len(order) if drop_last else 0
    if len(missing) > allowed_missing:
        raise CheckFailed(
            f"the ranks together skip indices {missing[:10]} in epoch {epoch} {where}: the partition is "
            "not complete. Every index must go to some rank (only drop_last may drop the few that do "
            "not divide by num_replicas).")


# --- chapter 03: data parallel ---


def _dp_max_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest absolute difference between two dicts of tensors, and the name where it is."""
    import torch

    worst, where = 0.0, ""
    for name, value in a.items():
        value, other = (torch.as_tensor(t, dtype=torch.float64) for t in (value, b[name]))
        diff = (value - other).abs().max().item()
        if diff > worst:
            worst, where = diff, name
    return worst, where


def _dp_all_close(a: dict, b: dict, rtol: float, atol: float) -> bool:
    return a.keys() == b.keys() and all(close(a[k], b[k], rtol=rtol, atol=atol) for k in a)


def _dp_scaled(tensors: dict, factor: float) -> dict:
    return {name: value * factor for name, value in tensors.items()}


def check_data_parallel(ranks: dict, reference: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Check hand-written data parallel training against one process that saw every rank's batch.

    ``ranks[r]`` and ``reference`` are dicts with ``"initial"`` (parameters before the first
    step, after any broadcast), ``"grads"`` (the gradients of the first step, after any
    averaging, just before ``optimizer.step``) and ``"final"`` (parameters at the end), each a
    dict name -> tensor. The reference trains one process on the concatenated batches.
    """
    world_size = len(ranks)
    zero = ranks[min(ranks)]
    for rank, got in sorted(ranks.items()):
        diff, name = _dp_max_diff(got["initial"], zero["initial"])
        if diff > 0:
            raise CheckFailed(
                f"the weights were not broadcast at the start: before the first step rank {rank}'s {name} "
                f"differs from rank {min(ranks)}'s by {diff:.3g}. Each rank built its model from its own "
                "random seed, so the replicas train different models. Broadcast every parameter from rank 0 "
                "(dist.broadcast(p.data, src=0)) before training, as DistributedDataParallel does.")
    if not _dp_all_close(zero["initial"], reference["initial"], rtol, atol):
        diff, name = _dp_max_diff(zero["initial"], reference["initial"])
        raise CheckFailed(f"all ranks start from the same weights, but not rank 0's ({name} differs by {diff:.3g}): "
                          "broadcast with src=0")
    for rank, got in sorted(ranks.items()):
        diff, name = _dp_max_diff(got["grads"], zero["grads"])
        if diff > atol + rtol * max(_dp_max_abs(zero["grads"]), 1e-12):
            raise CheckFailed(
                f"the gradients were not all-reduced: after backward rank {rank}'s {name}.grad differs from "
                f"rank {min(ranks)}'s by {diff:.3g}, so each replica steps with its own batch's gradient and "
                "the replicas drift apart. all_reduce every p.grad before optimizer.step().")
    grads, expected = zero["grads"], reference["grads"]
    if not _dp_all_close(grads, expected, rtol, atol):
        if world_size > 1 and _dp_all_close(grads, _dp_scaled(expected, world_size), rtol, atol):
            raise CheckFailed(
                f"the gradients were summed but not averaged: they are {world_size} (the world size) times "
                "the single-process gradient. all_reduce with ReduceOp.SUM adds the ranks' gradients; divide "
                "by dist.get_world_size() afterwards to get the mean over the whole batch.")
        if world_size > 1 and _dp_all_close(grads, _dp_scaled(expected, 1 / world_size), rtol, atol):
            raise CheckFailed(
                f"the gradients are 1/{world_size} of the single-process gradient: divided by the world size "
                "twice (ReduceOp.AVG already averages), or divided without all-reducing first.")
        diff, name = _dp_max_diff(grads, expected)
        raise CheckFailed(f"the first step's gradients differ from the single-process gradients ({name} by "
                          f"{diff:.3g}): all-reduce (sum) every parameter's .grad, then divide by the world size")
    for rank, got in sorted(ranks.items()):
        if not _dp_all_close(got["final"], reference["final"], rtol, 10 * atol):
            diff, name = _dp_max_diff(got["final"], reference["final"])
            raise CheckFailed(
                f"the first step is right, but after training rank {rank}'s {name} differs from the "
                f"single-process model by {diff:.3g}: average the gradients in EVERY step, after "
                "loss.backward() and before optimizer.step() (and zero them before each backward).")
    passed(f"{world_size} ranks trained exactly like one process with the whole batch "
           "(same start, averaged gradients, same final weights)")


def _dp_max_abs(tensors: dict) -> float:
    return max(float(v.abs().max()) for v in tensors.values())


def check_distributed_accuracy(reported: dict, correct: int, total: int, shards: dict) -> None:
    """Check an all-reduced evaluation against a single-process count of ``correct`` of ``total``.

    ``reported[r]`` is the accuracy rank r's evaluate() returned; ``shards[r]`` is that rank's
    own ``(correct, seen, correct_with_padding, seen_with_padding)``: its counts over
    its real samples, and over everything its DistributedSampler gave it, padding included.
    Names the usual mistakes.
    """
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


# --- chapter 06: fully sharded data parallel (ZeRO-1 by hand) ---


def zero1_matches_ddp(results: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
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


# --- chapter 01: message passing (ring all-reduce, deadlock-free exchange) ---


def _run_simulated(world, fn, inputs, what):
    """world.run(fn) with rank r getting inputs[r]; a blank exercise becomes a CheckFailed."""
    try:
        return world.run(lambda comm: fn(comm, inputs[comm.rank].copy()))
    except NotImplementedError as error:
        raise CheckFailed(f"{what} is not written yet: replace the `raise NotImplementedError` "
                          "line with your code.") from error


def _ring_values(results, inputs, n):
    """Name the likely mistake when the ring's results are not the sum, else None."""
    import numpy as np

    expected = np.sum(inputs, axis=0)
    pieces = np.array_split(np.arange(expected.size), n)
    for rank, out in enumerate(results):
        if out is None:
            return f"rank {rank} returned None: return the summed array."
        out = np.asarray(out, dtype=float)
        if out.shape != expected.shape:
            return (f"rank {rank} returned shape {out.shape}, the input has shape {expected.shape}: "
                    "return the whole array (all N chunks), not only the chunk that rank reduced.")
        if np.allclose(out, expected):
            continue
        if np.allclose(out * n, expected):
            return ("the result is the sum divided by the world size: an all-reduce sums. "
                    "(Averaging gradients is a later step, in data parallel training.)")
        if np.allclose(out, inputs[rank]):
            return (f"rank {rank} returned its own input unchanged: the sums never reached the "
                    "array you returned. np.array_split returns views into the array it cuts; "
                    "add into those chunks in place and return that array.")
        right = [i for i, p in enumerate(pieces) if np.allclose(out[p], expected[p])]
        if len(right) == 1:
            return (f"on {n} ranks, rank {rank} has only chunk {right[0]} fully summed: that is "
                    "where the reduce-scatter ends. The all-gather is missing (or does not write "
                    "into the array): N-1 more steps in which each rank passes on a finished "
                    "chunk and overwrites its copy with the one it receives.")
        return (f"on {n} ranks, rank {rank} has wrong values in chunks "
                f"{[i for i in range(n) if i not in right]}. Most likely the chunk indices: in "
                "reduce-scatter step s rank r sends chunk (r - s) % N and adds the chunk it "
                "receives into chunk (r - s - 1) % N; in all-gather step s it sends chunk "
                "(r - s + 1) % N and overwrites chunk (r - s) % N with what it receives.")
    return None


def _ring_traffic(world, n, length, itemsize):
    """Name the likely mistake when the ring's messages are not 2(N-1) chunks to the right."""
    counts, sent = world.messages_per_rank(), world.bytes_per_rank()
    for m in world.trace:
        if m.dest != (m.source + 1) % n:
            return (f"on {n} ranks rank {m.source} sent a message to rank {m.dest}: in a ring each "
                    "rank sends only to its right neighbour (rank + 1) % N and receives only from "
                    "its left one (rank - 1) % N.")
    for rank in range(n):
        if counts[rank] != 2 * (n - 1):
            half = " (only one of the two phases?)" if counts[rank] == n - 1 else ""
            return (f"on {n} ranks rank {rank} sent {counts[rank]} messages{half}; a ring all-reduce "
                    f"sends exactly 2(N-1) = {2 * (n - 1)}: N-1 in the reduce-scatter and N-1 in "
                    "the all-gather, one chunk each.")
        low, high = (2 * (n - 1) * (length // n) * itemsize,
                     2 * (n - 1) * -(-length // n) * itemsize)
        if not low <= sent[rank] <= high:
            whole = " It sends the whole array in some steps instead of one chunk." \
                if sent[rank] >= (n - 1) * length * itemsize else ""
            return (f"on {n} ranks rank {rank} sent {sent[rank]:,} bytes; a ring sends 2(N-1) chunks "
                    f"of about 1/N of the array ({low:,} to {high:,} bytes here).{whole}")
    return None


def check_ring_allreduce(fn) -> None:
    """``fn(comm, array)`` must return the sum over ranks of ``array`` with a ring:
    right values on 2-8 ranks (array lengths that N divides and that it does not),
    exactly 2(N-1) messages of one chunk per rank, all to the right neighbour, and no
    deadlock when no send is buffered (every send waits for its receive)."""
    import numpy as np

    from .mpi_sim import DeadlockError, World

    for n in range(2, 9):
        for length in (4 * n, 4 * n + 3):
            rng = np.random.default_rng(100 * n + length)
            inputs = [rng.integers(-9, 10, size=length).astype(float) for _ in range(n)]
            world = World(n)
            try:
                results = _run_simulated(world, fn, inputs, "ring_allreduce")
            except DeadlockError as error:
                raise CheckFailed(f"your ring deadlocked on {n} ranks. Check that every rank "
                                  "receives from (rank - 1) % N what that rank sends to it (same "
                                  f"tag too).\n{error}") from error
            problem = _ring_values(results, inputs, n)
            if problem and length % n:  # the length N divides passed just before
                problem = (f"wrong only when N = {n} does not divide the length ({length}): cut "
                           "the chunks with np.array_split, which makes some one element longer; "
                           "length // N drops the remainder.\n(" + problem + ")")
            problem = problem or _ring_traffic(world, n, length, 8)
            if problem:
                raise CheckFailed(problem)
    inputs = [np.full(64, float(r + 1)) for r in range(4)]
    try:
        _run_simulated(World(4, eager_limit=0), fn, inputs, "ring_allreduce")
    except DeadlockError as error:
        if all(w.startswith("send(") for w in error.waiting.values()):
            raise CheckFailed(
                "your ring works only while sends are buffered. With a message too large to "
                "buffer, a blocking send waits until the receiver posts its recv (MPI allows "
                "it, real libraries do it), and in a ring every rank sends first: all wait. "
                "Start the send with req = comm.isend(...), then comm.recv(...), then "
                f"req.wait().\n{error}") from error
        raise CheckFailed(f"your ring deadlocks when sends are not buffered:\n{error}") from error
    passed("ring all-reduce: right sums on 2-8 ranks, 2(N-1) messages of about 1/N of the array "
           "per rank, and no deadlock when sends are not buffered")


def check_exchange(fn) -> None:
    """``fn(comm, data)`` must send ``data`` to rank (rank + 1) % N and return what rank
    (rank - 1) % N sent, on 2-4 ranks, with no send buffered (every send waits for its
    receive), without deadlocking."""
    import numpy as np

    from .mpi_sim import DeadlockError, World

    for n in (2, 3, 4):
        inputs = [np.full(1000, float(r)) for r in range(n)]
        world = World(n, eager_limit=0)
        try:
            results = _run_simulated(world, fn, inputs, "exchange")
        except DeadlockError as error:
            waits = list(error.waiting.values())
            if waits and all(w.startswith("recv(") for w in waits):
                why = ("every rank blocks in recv before anyone has sent. Post the receive "
                       "without blocking (req = comm.irecv(left)), then send, then req.wait().")
            elif waits and all(w.startswith("send(") for w in waits):
                why = ("every rank blocks in a blocking send: a message too large to buffer waits "
                       "until its receiver posts the recv, and every receiver is itself sending. "
                       "Use comm.isend (or post comm.irecv first) and wait() afterwards.")
            else:
                why = "the ranks wait for each other; the simulator's report follows."
            raise CheckFailed(f"deadlock on {n} ranks: {why}\n{error}") from error
        for rank, got in enumerate(results):
            left, right = (rank - 1) % n, (rank + 1) % n
            if got is None:
                raise CheckFailed(f"rank {rank} returned None: return what it received "
                                  "(req.wait() on an irecv returns the object).")
            got = np.asarray(got, dtype=float)
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[left]):
                continue
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[rank]) and n > 1:
                raise CheckFailed(f"rank {rank} returned its own data: return what it received "
                                  "from its left neighbour, not what it sent.")
            if got.shape == inputs[rank].shape and np.array_equal(got, inputs[right]):
                raise CheckFailed(f"on {n} ranks rank {rank} got the data of rank {right}: send "
                                  "to the right neighbour (rank + 1) % N and receive from the left "
                                  "one (rank - 1) % N.")
            raise CheckFailed(f"on {n} ranks rank {rank} returned something else than the data of "
                              f"rank {left}, its left neighbour.")
        counts = world.messages_per_rank()
        if counts != [1] * n:
            raise CheckFailed(f"on {n} ranks the ranks sent {counts} messages: each sends exactly "
                              "one, to its right neighbour.")
    passed("exchange: every rank got its left neighbour's data on 2-4 ranks, one message each, "
           "and no deadlock even when no send is buffered")


# --- chapter 05: tensor parallel (column- and row-parallel linear layers) ---

_TP_KINDS = ("column", "row")


def _tp_gap(actual, expected) -> str:
    import torch

    return f"largest difference {(actual.double() - expected.double()).abs().max().item():.3g}"


def check_parallel_linear(kind: str, results: dict, reference: dict,
                          rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Check a column- or row-parallel linear layer against the unsharded nn.Linear.

    ``results``: ``launch(...).results``, rank -> dict whose ``results[rank][kind]`` holds
    what that rank's layer gave: ``y`` (the output), ``grad_x`` (gradient of its input:
    the whole input for "column", its slice of the input features for "row"),
    ``weight``/``grad_weight`` and ``bias``/``grad_bias`` (its local parameters).
    ``reference``: ``y``, ``grad_x``, ``weight``, ``bias``, ``grad_weight``, ``grad_bias``
    of the plain nn.Linear, computed on one process with the same numbers.
    """
    import torch

    if kind not in _TP_KINDS:
        raise ValueError(f"kind must be one of {_TP_KINDS}, got {kind!r}")
    ranks = sorted(results)
    n = len(ranks)
    if ranks != list(range(n)) or any(kind not in results[r] for r in ranks):
        raise CheckFailed(f"expected a {kind!r} entry from every rank 0..{n - 1}; got ranks {ranks}. "
                          "Did every rank run the check script to the end?")
    ref = {k: v.detach().double() for k, v in reference.items()}
    same = lambda a, b: a.shape == b.shape and torch.allclose(a.double(), b, rtol=rtol, atol=atol)  # noqa: E731
    name = f"{kind}-parallel linear on {n} ranks"
    shard_dim = 0 if kind == "column" else 1

    for r in ranks:
        got = results[r][kind]
        y = got.get("y")
        if y is None:
            raise CheckFailed(f"{name}: rank {r} reported no output.")
        y = y.double()
        if not same(y, ref["y"]):
            _tp_explain_output(name, kind, r, n, y, ref, same)

    for r in ranks:
        got = results[r][kind]
        for key in ("grad_x", "grad_weight") + (("grad_bias",) if ref.get("bias") is not None else ()):
            if got.get(key) is None:
                raise CheckFailed(
                    f"{name}: rank {r} has no {key}: the gradient never reached it. A dist.* call "
                    "on a tensor is invisible to autograd (all_gather fills fresh tensors that have no "
                    "history): put each collective in a torch.autograd.Function with its backward.")
        w_expected = ref["weight"].chunk(n, dim=shard_dim)[r]
        if not same(got["weight"], w_expected):
            raise CheckFailed(
                f"{name}: rank {r} holds a weight of shape {tuple(got['weight'].shape)}, expected its "
                f"slice {tuple(w_expected.shape)} of nn.Linear.weight (out, in) = {tuple(ref['weight'].shape)}. "
                f"{kind.capitalize()} parallel splits weight along dim {shard_dim} "
                f"({'its rows: the output features' if kind == 'column' else 'its columns: the input features'}); "
                "take chunk(world_size, dim)[rank].")

        gx = got["grad_x"].double()
        if kind == "column":
            gx_expected = ref["grad_x"]
            share = sum(results[q][kind]["grad_x"].double() for q in ranks)
            if n > 1 and not same(gx, gx_expected) and same(share, gx_expected):
                raise CheckFailed(
                    f"{name}: rank {r}'s input gradient is only its own share: each rank's weight slice "
                    "gives part of dL/dx, and the parts must be summed. The copy of x into the parallel "
                    "region needs backward = all-reduce of the gradient (forward = identity).")
        else:
            gx_expected = ref["grad_x"].chunk(n, dim=-1)[r]
        if not same(gx, gx_expected):
            hint = (" It is exactly world_size times too big: the backward of the forward all-reduce "
                    "must pass the gradient through unchanged (identity), not all-reduce it again."
                    if n > 1 and same(gx, n * gx_expected) else "")
            raise CheckFailed(f"{name}: rank {r}'s input gradient is wrong ({_tp_gap(gx, gx_expected)}).{hint}")

        gw, gw_expected = got["grad_weight"].double(), ref["grad_weight"].chunk(n, dim=shard_dim)[r]
        if not same(gw, gw_expected):
            hint = (" It is exactly world_size times too big: a backward all-reduces a gradient that "
                    "every rank already holds in full." if n > 1 and same(gw, n * gw_expected) else "")
            raise CheckFailed(f"{name}: rank {r}'s weight gradient is wrong ({_tp_gap(gw, gw_expected)}).{hint}")
        if ref.get("bias") is not None:
            gb = got["grad_bias"].double()
            gb_expected = ref["grad_bias"].chunk(n)[r] if kind == "column" else ref["grad_bias"]
            if not same(gb, gb_expected):
                raise CheckFailed(f"{name}: rank {r}'s bias gradient is wrong ({_tp_gap(gb, gb_expected)}); "
                                  + ("each rank owns the bias of its output features: chunk the bias like "
                                     "the weight's rows." if kind == "column" else
                                     "every rank holds the whole bias, added once after the all-reduce."))
    passed(f"{name}: output and every gradient match nn.Linear")


def _tp_explain_output(name, kind, r, n, y, ref, same):
    """Raise CheckFailed naming the most likely reason why rank r's output is wrong."""
    import torch

    y_ref = ref["y"]
    chunks = y_ref.chunk(n, dim=-1)
    for dim in range(y_ref.ndim - 1):  # the shards glued along a wrong dimension
        glued = torch.cat(chunks, dim=dim)
        if same(y, glued) or (y.shape == y_ref.shape and same(y, glued.reshape(y_ref.shape))):
            raise CheckFailed(
                f"{name}: rank {r}'s output has the {n} shards concatenated along dim {dim} "
                f"(shape {tuple(glued.shape)}"
                + (", then reshaped" if y.shape == y_ref.shape else "") +
                "). Each shard holds some OUTPUT FEATURES of every row, so the all-gathered pieces "
                "go side by side along the last dim: torch.cat(pieces, dim=-1).")
    bias = ref.get("bias")
    if kind == "row" and bias is not None and n > 1:
        if same(y, y_ref + (n - 1) * bias):
            raise CheckFailed(
                f"{name}: rank {r}'s output has the bias {n} times: every rank added it before the "
                "all-reduce, which sums the copies. Add the bias once, after the all-reduce.")
        if same(y, y_ref - bias):
            raise CheckFailed(f"{name}: the bias is missing from rank {r}'s output: add it after the all-reduce.")
    if y.shape != y_ref.shape:
        raise CheckFailed(f"{name}: rank {r}'s output has shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}"
                          + (": the shards were never gathered." if y.shape[-1] * n == y_ref.shape[-1] else "."))
    if kind == "row" and n > 1:
        raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_tp_gap(y, y_ref)}). Each rank's product "
                          "is a partial sum over its input features: all-reduce (sum) it, then add the bias.")
    raise CheckFailed(f"{name}: rank {r}'s output is wrong ({_tp_gap(y, y_ref)}).")


# --- chapter 07: launching at scale ---


def _resume_fixture():
    """A tiny model, optimizer (with momentum state) and scheduler, a few steps in."""
    import torch

    torch.manual_seed(7)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x, y = torch.randn(8, 4), torch.randn(8, 3)

    def train(steps):
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()

    return model, optimizer, scheduler, train


def check_checkpoint_functions(save_checkpoint, load_checkpoint, folder) -> None:
    """``save_checkpoint(path, model, optimizer, scheduler, epoch, step)`` and
    ``load_checkpoint(path, model, optimizer, scheduler) -> (epoch, step)`` restore
    everything a resumed run needs, and a crash while saving keeps the old checkpoint."""
    import os
    from pathlib import Path
    from unittest import mock

    import torch

    path = Path(folder) / "check_resume.pt"
    for stale in Path(folder).glob("check_resume.pt*"):
        stale.unlink()
    model, optimizer, scheduler, train = _resume_fixture()
    train(3)
    save_checkpoint(path, model, optimizer, scheduler, 1, 3)
    if not path.exists():
        raise CheckFailed(f"save_checkpoint did not create {path}: it must end with the checkpoint "
                          "at exactly the path it was given (rename the temporary file to it).")

    def fresh():
        m, o, s, t = _resume_fixture()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)  # different weights, so loading must overwrite them
        return m, o, s, t

    model2, optimizer2, scheduler2, train2 = fresh()
    where = load_checkpoint(path, model2, optimizer2, scheduler2)
    if where is None or tuple(where) != (1, 3):
        raise CheckFailed(f"load_checkpoint returned {where!r}, expected (epoch, step) = (1, 3): save "
                          "the epoch and the step in the checkpoint and return them, so the run "
                          "continues where it stopped instead of at step 0.")
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        if not torch.equal(p, q):
            raise CheckFailed(f"the model's {name} differs after loading: save model.state_dict() and "
                              "restore it with model.load_state_dict(...).")
    state, state2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    if set(state) != set(state2) or any(
            not torch.equal(state[k]["momentum_buffer"], state2[k]["momentum_buffer"]) for k in state):
        raise CheckFailed("optimizer state not restored: the momentum buffers after loading differ "
                          "from the saved ones (or are missing). Save optimizer.state_dict() and load "
                          "it with optimizer.load_state_dict(...); SGD momentum and Adam's moments live "
                          "there, not in the model.")
    if scheduler2.last_epoch != scheduler.last_epoch or \
            optimizer2.param_groups[0]["lr"] != optimizer.param_groups[0]["lr"]:
        raise CheckFailed(
            f"scheduler state not restored: after loading, the scheduler has taken "
            f"{scheduler2.last_epoch} steps and the learning rate is {optimizer2.param_groups[0]['lr']:g}, "
            f"expected {scheduler.last_epoch} steps and {optimizer.param_groups[0]['lr']:g}. Save "
            "scheduler.state_dict() and load it, or the learning-rate schedule restarts from the top.")
    train(2)
    train2(2)
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        if not torch.equal(p, q):
            raise CheckFailed(f"training on after loading gives a different {name} than training on "
                              "without the interruption: something else of the run's state is missing.")

    # A crash while writing: the new checkpoint is lost, but the previous one must survive.

    def crashing_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(b"half a checkpoint")
        else:
            f.write(b"half a checkpoint")
        raise OSError("simulated crash in the middle of torch.save")

    with mock.patch.object(torch, "save", crashing_save):
        try:
            save_checkpoint(path, model, optimizer, scheduler, 2, 5)
        except OSError:
            pass
    model3, optimizer3, scheduler3, _ = fresh()
    try:
        where = load_checkpoint(path, model3, optimizer3, scheduler3)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the mistake
        where = f"an error ({type(error).__name__})"
    if where is None or isinstance(where, str) or tuple(where) != (1, 3):
        raise CheckFailed(
            f"non-atomic write: a crash in the middle of saving destroyed the previous checkpoint "
            f"(loading it afterwards gave {where!r} instead of (1, 3)). Save to a temporary file in "
            "the same folder and then os.replace(tmp, path): a rename is atomic, so the path always "
            "holds a complete checkpoint, the old one or the new one.")
    passed("save_checkpoint/load_checkpoint restore model, optimizer, scheduler, epoch and step, "
           "and a crash while saving keeps the previous checkpoint")


def check_resumed_run(reference: dict, resumed: dict, crash_at: int, ckpt_every: int,
                      tolerance: float = 0.0) -> None:
    """A run that crashed at step ``crash_at`` and was restarted by torchrun must end with
    exactly the parameters of the uninterrupted ``reference`` run. Both are what the
    worker reported: ``params``, ``losses`` ({step: loss}), ``resumed_from``, ``restarts``.
    ``tolerance`` (relative) is 0 on CPUs, where the two runs are bit-identical; on GPUs
    some kernels add in a varying order, so pass a small one there."""
    import torch

    if resumed.get("restarts", 0) < 1:
        raise CheckFailed("the run was never restarted: the crash was not injected (pass --crash-at "
                          "and a checkpoint path) or torchrun was not given --max-restarts >= 1.")
    expected_from = crash_at // ckpt_every * ckpt_every
    got_from = resumed.get("resumed_from")
    if got_from == 0 and expected_from > 0:
        raise CheckFailed(f"the restarted run started again from step 0, although a checkpoint of step "
                          f"{expected_from} existed: load the checkpoint at start-up when the file exists.")
    if got_from != expected_from:
        raise CheckFailed(f"the restarted run resumed from step {got_from}, but the last checkpoint "
                          f"before the crash at step {crash_at} was step {expected_from}: is the step "
                          "saved and returned correctly?")
    ref_losses, losses = reference["losses"], resumed["losses"]
    missing = [s for s in ref_losses if s > got_from and s not in losses]
    if missing:
        raise CheckFailed(f"the resumed run never trained steps {missing[:5]}...: it must continue until "
                          "the same total number of steps as the uninterrupted run.")
    differs = [s for s in sorted(ref_losses) if s > got_from
               and not torch.isclose(torch.tensor(losses[s]), torch.tensor(ref_losses[s]),
                                     rtol=max(tolerance, 1e-6), atol=1e-7)]
    if differs and differs[0] == got_from + 1:
        raise CheckFailed(
            f"the very first step after resuming (step {got_from + 1}) already has a different loss "
            f"({losses[got_from + 1]:.6f} vs {ref_losses[got_from + 1]:.6f}): the model weights were "
            "not restored, or the data loader was not fast-forwarded to the saved position in the "
            "epoch (set_epoch(epoch) and skip the batches already trained).")
    if differs:
        raise CheckFailed(
            f"the first step after resuming matches, but from step {differs[0]} on the losses drift: "
            "the optimizer state (momentum) or the learning-rate scheduler was not restored.")
    for name, value in reference["params"].items():
        other = resumed["params"][name]
        if not torch.allclose(value, other, rtol=tolerance, atol=tolerance * 0.1):
            gap = (value - other).abs().max().item()
            raise CheckFailed(f"the final {name} differs from the uninterrupted run by {gap:.3g}: "
                              "some state that the last steps depend on was not restored.")
    passed(f"crashed at step {crash_at}, restarted, resumed from step {got_from} and ended with "
           "exactly the parameters of the uninterrupted run")


# --- chapter 08: communication and hardware ---

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def check_bus_factor(bus_factor, world_sizes=(2, 3, 4, 8, 64)) -> None:
    """Check ``bus_factor(op, world_size)`` (busbw / algbw) against the factors nccl-tests uses."""
    from .costmodel import BUS_FACTORS

    for op in _COLLECTIVES:
        for n in world_sizes:
            got, want = bus_factor(op, n), BUS_FACTORS[op](n)
            if got is None:
                raise CheckFailed(f"bus_factor({op!r}, {n}) returned None: return the factor as a number")
            if close(got, want):
                continue
            where = f"bus_factor({op!r}, {n}) = {float(got):.4g}, expected {want:.4g}: "
            if op == "all_reduce" and close(got, (n - 1) / n):
                raise CheckFailed(where + "the factor 2 is missing. A ring all-reduce is a reduce-scatter "
                                  "followed by an all-gather, and each sends (n-1)/n of the buffer: 2(n-1)/n.")
            if op in ("all_gather", "reduce_scatter") and close(got, 2 * (n - 1) / n):
                raise CheckFailed(where + f"that is all-reduce's factor. A {op} alone is one half of an "
                                  "all-reduce: each rank sends (n-1)/n of the buffer.")
            if op == "broadcast" and close(got, (n - 1) / n):
                raise CheckFailed(where + "a broadcast passes the whole buffer along every link of the "
                                  "chain (pipelined in chunks): every link carries all of it, factor 1.")
            if close(got, 1.0):
                raise CheckFailed(where + "busbw equals algbw only for broadcast (and reduce). For the "
                                  "others count what each rank's link carries in a ring, as a share of "
                                  "the buffer: (n-1)/n per pass over the ring.")
            if want and close(got, 1 / want):
                raise CheckFailed(where + "the factor is upside down: busbw = algbw * factor, and the "
                                  "factor is the share of the buffer each link carries, e.g. 2(n-1)/n.")
            if close(got, want * n):
                raise CheckFailed(where + "n times too big: in a ring the buffer is cut into n chunks, so "
                                  "each step sends 1/n of it; divide by n.")
            raise CheckFailed(where + "count the bytes each rank sends in a ring as a share of the buffer "
                              "(all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1).")
    passed(f"bus bandwidth factors of {', '.join(_COLLECTIVES)} for n = {', '.join(map(str, world_sizes))}")


def check_allreduce_prediction(predict) -> None:
    """Check ``predict(num_params, world_size, bidir_bandwidth, bytes_per_param, alpha)``:
    seconds of a ring all-reduce of the gradients (``costmodel.allreduce_time``, ring,
    with beta = 1 / (bidir_bandwidth / 2))."""
    from .costmodel import NVLINK5_BIDIR, PCIE5_X16_BIDIR, allreduce_time

    # (params, ranks, bidirectional bytes/s, bytes per parameter, alpha)
    cases = [(7e9, 8, NVLINK5_BIDIR, 2, 0.0), (1e9, 4, PCIE5_X16_BIDIR, 4, 0.0),
             (70e9, 2, PCIE5_X16_BIDIR, 2, 0.0), (1e6, 8, NVLINK5_BIDIR, 2, 5e-6)]
    ratios = []
    for p, n, bidir, b, alpha in cases:
        want = allreduce_time(p * b, n, "ring", alpha, 2 / bidir)
        got = predict(p, n, bidir, b, alpha)
        if got is None:
            raise CheckFailed("predict(...) returned None: return the time in seconds")
        ratios.append((float(got) / want, p, n, b, alpha, want, float(got)))
    if all(close(r, 1.0, rtol=1e-4) for r, *_ in ratios):
        passed("ring all-reduce times of gradients on NVLink 5 and PCIe Gen 5")
        return
    no_latency = [x for x in ratios if x[4] == 0]

    def all_near(values):
        return all(close(got, expect, rtol=1e-3) for got, expect in values)

    if all_near([(r, 1 / b) for r, _, _, b, *_ in no_latency]):
        raise CheckFailed("the time is too small by the bytes per parameter: you counted parameters, "
                          "not bytes. The message is num_params * bytes_per_param bytes (2 for bf16).")
    if all_near([(r, 0.5) for r, *_ in no_latency]):
        raise CheckFailed("the time is half what it should be. Either you used the bidirectional figure "
                          "as the speed of one direction (a ring sends and receives at once: each "
                          "direction carries bidir / 2), or you left out the 2 in 2(N-1)/N (a ring "
                          "all-reduce is a reduce-scatter plus an all-gather).")
    if all_near([(r, n / (2 * (n - 1))) for r, _, n, *_ in no_latency]):
        raise CheckFailed("the time is that of sending the whole buffer once (algbw): a ring all-reduce "
                          "pushes 2(N-1)/N of it through each rank's link.")
    if all_near([(r, n / (n - 1)) for r, _, n, *_ in no_latency]):
        raise CheckFailed("you used 2 instead of 2(N-1)/N: each of the 2(N-1) steps sends only 1/N of the "
                          "buffer.")
    if all_near([(r, 1e3) for r, *_ in ratios]) or all_near([(r, 1e6) for r, *_ in ratios]):
        raise CheckFailed("the time is in milliseconds or microseconds: return seconds.")
    if all(close(r, 1.0, rtol=1e-4) for r, *_ in no_latency):
        _, p, n, b, alpha, want, got = ratios[-1]
        raise CheckFailed(f"right without latency, wrong with alpha = {alpha:g} s ({got:.4g} s instead of "
                          f"{want:.4g} s): every one of the ring's 2(N-1) steps pays alpha once.")
    _, p, n, b, alpha, want, got = next(x for x in ratios if not close(x[0], 1.0, rtol=1e-4))
    raise CheckFailed(f"predict({p:g}, {n}, ..., {b}, {alpha:g}) = {got:.4g} s, expected {want:.4g} s: "
                      "2(N-1) * (alpha + S / N / B) with S the bytes and B = bidir / 2.")


# --- chapter 09: federated learning ---


def _state_close(a: dict, b: dict, rtol: float, atol: float) -> bool:
    return all(close(_as_double(a[k]), _as_double(b[k]), rtol, atol) for k in b)


def _as_double(x):
    import torch

    return torch.as_tensor(x).double()


def check_fedavg(before, samples, after, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Check a FedAvg aggregation done with collectives.

    before[r]: rank r's parameters (name -> tensor) just before aggregating; samples[r]: its
    number of training samples n_r; after[r]: what rank r holds after aggregating. Every rank
    must hold sum_r n_r before[r] / sum_r n_r.
    """
    from .federated import fedavg_reference

    n = len(before)
    if not (len(samples) == len(after) == n) or n == 0:
        raise CheckFailed(f"need one entry per rank in before, samples and after; got {len(before)}, "
                          f"{len(samples)}, {len(after)}")
    missing = [k for k in before[0] if k not in after[0]]
    if missing:
        raise CheckFailed(f"the aggregated parameters lack {missing}: average every parameter of the model")
    total = float(sum(samples))
    expected = fedavg_reference(before, samples)
    ok = [_state_close(a, expected, rtol, atol) for a in after]
    if all(ok):
        passed(f"all {n} ranks hold the sample-weighted mean of the sites' parameters (n_k = {list(samples)})")
        return

    def scaled(weights):
        return fedavg_reference(before, weights) if sum(weights) else None

    def matches(candidate, factor=1.0):
        cand = {k: v * factor for k, v in candidate.items()}
        return all(_state_close(a, cand, rtol, atol) for a in after)

    unweighted = scaled([1] * n)
    if matches(unweighted):
        raise CheckFailed("every rank holds the plain, unweighted mean of the sites' parameters: FedAvg "
                          "weights each site by its number of samples. Scale rank k's parameters by "
                          "n_k / n (n = the all-reduced sum of the n_k) before the all-reduce that adds them.")
    if matches(expected, total):
        raise CheckFailed("the result is sum_k n_k w_k, not divided by the total number of samples n: "
                          "all-reduce the n_k first and scale by n_k / n.")
    if matches(unweighted, n):
        raise CheckFailed("the result is the plain sum of the sites' parameters: all_reduce adds; scale "
                          "each site's parameters by n_k / n before it.")
    if matches(expected, total / n):
        raise CheckFailed("the result is sum_k n_k w_k / N (the number of ranks): divide by the total "
                          "number of samples n = sum_k n_k instead, all-reduced from every rank's n_k.")
    if matches(expected, 1 / n):
        raise CheckFailed("the result is N times too small: you divided by the number of ranks on top "
                          "of weighting by n_k / n, whose weights already add up to 1.")
    if all(_state_close(a, b, rtol, atol) for a, b in zip(after, before)):
        raise CheckFailed("the parameters did not change. all_reduce works in place on the tensor you pass "
                          "it: if you flattened the parameters into a new tensor (parameters_to_vector), "
                          "copy the result back (vector_to_parameters), or reduce p.data itself.")
    if all(_state_close(a, {k: _as_double(v) * (m / total) for k, v in b.items()}, rtol, atol)
           for a, b, m in zip(after, before, samples)):
        raise CheckFailed("each rank holds only its own scaled parameters n_k / n * w_k: the all-reduce "
                          "that adds them up is missing, or its result was not copied back.")
    if ok[0] and not all(ok):
        raise CheckFailed(f"rank 0 holds the right average but rank(s) {[r for r in range(n) if not ok[r]]} "
                          "do not: use all_reduce (every rank gets the result), not reduce (only the "
                          "destination does), or broadcast the result afterwards.")
    raise CheckFailed(f"rank(s) {[r for r in range(n) if not ok[r]]} hold neither the weighted mean "
                      "sum_k n_k w_k / sum_k n_k nor a recognisable mistake: check the weights and that every "
                      "parameter goes through the all-reduce.")
