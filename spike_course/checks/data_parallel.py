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


# --- exercise 2: an evaluation split between the ranks ---

U32, U64 = 2.0 ** -24, 2.0 ** -53  # the unit roundoffs of float32 and float64
METRICS = ("accuracy", "recall", "loss")  # the counts first: they tell the mistakes apart exactly


def check_distributed_accuracy(job, images, labels, log_probs) -> None:
    """Check exercise 2 of chapter 03: the test loss, the accuracy and every class's recall over a
    test set that DistributedSampler(shuffle=False) splits between the ranks, with one collective.

    ``job`` is the launch of ``evaluate.py`` (``check=False``, so that a blank exercise reaches
    this check) or its reports. Each rank reports ``"result"`` (what evaluate returned),
    ``"forwards"`` (every forward pass of the model during evaluate: its input, its output and
    whether the model was in training mode), ``"first_layer_rows"`` (the rows its first layer
    received, however the model was called) and ``"collectives"`` (CommDebugMode's counts).
    ``images`` and ``labels`` are the whole test set in order, ``log_probs`` one process's output
    for all of it with the same weights; every class occurs in ``labels``. The steps go from what
    makes a comparison meaningless (dropout on, samples run never or by the wrong rank) to the
    values, and end with the number of collectives.
    """
    ranks = launch_reports(job, "evaluate")
    results = {rank: _result(rank, got.get("result"), log_probs.shape[1]) for rank, got in sorted(ranks.items())}
    _check_called_as_a_module(ranks)
    runs = _runs(ranks, images)
    real = _check_split(runs, len(labels))
    expected, tolerance = _one_process(labels, log_probs, runs, real)
    got = _same_on_every_rank(results, ranks)
    for metric in METRICS:
        if not _within(got[metric], expected[metric], tolerance[metric]):
            raise CheckFailed(_mistake(metric, got[metric], expected, tolerance, runs, real, labels))
    _check_one_collective(ranks)
    passed(f"loss {float(got['loss']):.4f}, accuracy {float(got['accuracy']):.4f} and {len(got['recall'])} "
           f"recalls over the {len(labels)} test samples, the same on {len(ranks)} ranks as in one process, each "
           "rank running the model on its own shard, with one all-reduce")


def _result(rank: int, result, classes: int) -> dict:
    """What rank ``rank``'s evaluate returned, as float64 tensors."""
    import torch

    if not isinstance(result, dict) or not set(METRICS) <= result.keys():
        raise CheckFailed(f"rank {rank}'s evaluate returned {str(result)[:80]!r}, not a dict with the keys 'loss', "
                          "'accuracy' and 'recall' (see the statement).")
    try:
        values = {key: torch.as_tensor(result[key], dtype=torch.float64).flatten() for key in METRICS}
    except (TypeError, ValueError, RuntimeError) as error:
        raise CheckFailed(f"rank {rank}'s evaluate returned values that are not numbers ({error})") from None
    sizes = {key: value.numel() for key, value in values.items()}
    if sizes != {"loss": 1, "accuracy": 1, "recall": classes}:
        raise CheckFailed(f"rank {rank}'s evaluate returned {sizes} numbers for {list(sizes)}: one loss, one "
                          f"accuracy and a recall for each of the {classes} classes.")
    return values


def _check_called_as_a_module(ranks: dict) -> None:
    """The worker counts the rows the network's first layer got, beside the model's own hook:
    rows the hook never saw went through the model by another way than model(x), and fewer
    rows than the hook saw mean the worker's counting hook was taken away."""
    for rank, got in sorted(ranks.items()):
        rows = got.get("first_layer_rows")
        hooked = sum(len(inputs) for inputs, _, _ in got.get("forwards", []))
        if rows is not None and rows < hooked:
            raise CheckFailed(
                f"rank {rank}'s model ran on {hooked} samples during evaluate, but its first layer counted only "
                f"{rows}: evaluate removed the hook the worker counts with, so what the rank ran cannot be "
                "known. Leave the model's hooks as the worker set them.")
        if rows is not None and rows > hooked:
            raise CheckFailed(
                f"rank {rank}'s network ran on {rows} samples during evaluate, but only {hooked} of them went "
                "through the model as model(x) runs it: the others went through model.forward (or its layers "
                "called by hand), which skips the model's hooks, so no one can tell which samples they were. "
                "Call the model itself, on the rank's shard only.")


def _runs(ranks: dict, images) -> dict:
    """Per rank, the batches its model ran on during evaluate: (test-set indices, float64
    log-probabilities). The model in training mode, or inputs that are not test images, end here."""
    import torch

    where = {image.numpy().tobytes(): i for i, image in enumerate(images.float().contiguous())}
    runs = {}
    for rank, got in sorted(ranks.items()):
        batches = []
        for inputs, outputs, training in got.get("forwards", []):
            if training:
                raise CheckFailed(
                    f"rank {rank} ran the model in training mode during evaluate: dropout zeroed random "
                    "activations, so its predictions and losses are those of a random thinned network, not of "
                    "the model. Turn dropout off for the evaluation (Hint 2).")
            found = [where.get(x.float().contiguous().numpy().tobytes()) for x in inputs]
            if None in found:
                raise CheckFailed(f"rank {rank}'s model ran on inputs that are not images of the test set: give the "
                                  "model the loader's images as they come (moved to the device, nothing else).")
            indices = torch.tensor(found, dtype=torch.long)
            if not (batches and torch.equal(batches[-1][0], indices)):  # the same batch twice counts once
                batches.append((indices, outputs.double()))
        runs[rank] = batches
    return runs


def _check_split(runs: dict, n: int) -> dict:
    """Each rank ran the model on its DistributedSampler(shuffle=False) shard only, on every real
    sample of it. Returns each rank's real samples: its shard without the repeats."""
    world = len(runs)
    total = -(-n // world) * world
    order = (list(range(n)) * -(-total // n))[:total]  # the sampler's order, its repeats appended
    real = {rank: set(range(rank, n, world)) for rank in runs}  # the positions below n
    for rank, batches in sorted(runs.items()):
        ran = {i for indices, _ in batches for i in indices.tolist()}
        if world > 1 and len(ran) == n:
            raise CheckFailed(
                f"rank {rank} ran the model on all {n} test samples: every rank evaluated the whole test set, so "
                f"nothing was split (the right numbers, at {world} times the cost). Each rank runs the model only "
                "on the shard DistributedSampler(dataset, shuffle=False) deals it (Hint 1).")
        outside = sorted(ran - set(order[rank:total:world]))
        if outside:
            raise CheckFailed(
                f"rank {rank} ran the model on {len(outside)} samples of other ranks' shards (sample {outside[0]}, "
                "for one): the test set was split otherwise than DistributedSampler(dataset, shuffle=False) "
                "splits it, the split the training loader uses (Hint 2).")
        missing = sorted(real[rank] - ran)
        if missing:
            raise CheckFailed(
                f"rank {rank}'s model never ran on {len(missing)} of the {len(real[rank])} samples of its shard "
                f"(sample {missing[0]}, for one), so nothing can count them: run the model on the whole shard, "
                "batch by batch (Hint 3).")
    return real


def _sums(indices, log_probs, labels) -> dict:
    """What adds up over samples: the loss sum, and per class the right predictions, the samples
    and the predictions."""
    import torch

    y, classes = labels[indices], log_probs.shape[1]
    predicted = log_probs.argmax(1)
    return {"loss": -log_probs.gather(1, y[:, None]).sum(),
            "right": torch.bincount(y[predicted == y], minlength=classes).double(),
            "seen": torch.bincount(y, minlength=classes).double(),
            "predicted": torch.bincount(predicted, minlength=classes).double()}


def _add(parts) -> dict:
    parts = list(parts)
    return {key: sum(part[key] for part in parts) for key in parts[0]}


def _ratios(s: dict) -> dict:
    return {"loss": s["loss"] / s["seen"].sum(), "accuracy": s["right"].sum() / s["seen"].sum(),
            "recall": s["right"] / s["seen"], "precision": s["right"] / s["predicted"]}


def _mean(ratios: list) -> dict:
    import torch

    return {key: torch.stack([torch.as_tensor(r[key]) for r in ratios]).mean(0) for key in ratios[0]}


def _one_process(labels, log_probs, runs: dict, real: dict) -> tuple[dict, dict]:
    """The one process's results in float64, and how far an evaluation over the ranks that does
    the right arithmetic may be from them, metric by metric."""
    import torch

    n = len(labels)
    one = log_probs.double()
    expected = _ratios(_sums(torch.arange(n), one, labels))
    ours = one.clone()  # the ranks' own log-probabilities of their real samples
    for rank, batches in runs.items():
        for indices, out in batches:
            keep = torch.tensor([i in real[rank] for i in indices.tolist()], dtype=torch.bool)
            ours[indices[keep]] = out[keep]
    loss, our_loss = (-lp.gather(1, labels[:, None])[:, 0] for lp in (one, ours))
    flips = torch.bincount(labels[ours.argmax(1) != one.argmax(1)], minlength=one.shape[1]).double()
    tolerance = {
        # Counts are exact. A sample whose prediction differs between the ranks' forward pass and
        # the one process's (batches of other sizes round differently) moves a count by one; the
        # division, rounded in float32 at worst, and the conversion add 2 u32 relative.
        "accuracy": flips.sum() / n + 2 * U32 * expected["accuracy"],
        "recall": flips / torch.bincount(labels, minlength=one.shape[1]) + 2 * U32 * expected["recall"],
        # The loss: the ranks' per-sample losses differ from the one process's by exactly
        # sum_i |l_i(ranks) - l_i(one)| / n, read from the recorded outputs; each per-sample loss may be
        # rounded once more in float32 (u32 l_i); float64 sums of n terms, the all-reduce over W ranks
        # and the division lose at most gamma_(n+W+1) sum_i l_i / n <= (n + W + 2) u64 L.
        "loss": ((our_loss - loss).abs().sum() + U32 * loss.sum()) / n + (n + len(runs) + 2) * U64 * expected["loss"],
    }
    return expected, tolerance


def _within(value, expected, tolerance) -> bool:
    """Within tolerance, element by element; NaN only where ``expected`` is NaN too (a ratio 0/0)."""
    return bool((((value - expected).abs() <= tolerance) | (value.isnan() & expected.isnan())).all())


def _same_on_every_rank(results: dict, ranks: dict) -> dict:
    import torch

    first = min(results)
    for rank, got in sorted(results.items()):
        for metric in METRICS:
            if not torch.allclose(got[metric], results[first][metric], rtol=0, atol=0, equal_nan=True):
                why = ("evaluate made no collective, so each rank's numbers are those of its own shard"
                       if not sum(ranks[rank].get("collectives", {}).values()) else
                       "after the collective every rank holds the same totals, so a rank that divides by a count of "
                       "its own, or that some collective left out, returns other numbers")
                raise CheckFailed(f"the ranks return different results ({metric} {results[first][metric].tolist()} on "
                                  f"rank {first}, {got[metric].tolist()} on rank {rank}): {why} (Hint 1).")
    return results[first]


PADDING = ("it counts the {repeats} repeat(s) that DistributedSampler added so that every rank gets {per_rank} "
           "samples ({counted} samples counted, the test set has {n}); a rank's model may run on a repeat, but the "
           "repeat must not count. Where do the repeats land in a rank's shard? (Hint 1)")
RANKS = ("it is the mean of the ranks' own {metric} values, but the shards differ in size ({sizes} real "
         "samples{per_class}), so the mean of their ratios is not the ratio over the test set: add up over the "
         "ranks what the ratios are made of, and divide last (Hint 1)")
BATCHES = ("it is the mean of the per-batch {metric} values, but the batches differ in size ({batches} samples), so "
           "a small batch weighs as much as a full one: add up sums and counts, not means (Hint 1)")
PRECISION = ("each class's value divides its right predictions by the samples PREDICTED as that class, which is "
             "the class's precision; its recall divides by the samples LABELLED with it (Hint 1)")


def _usual_mistakes(runs: dict, real: dict, labels, metric: str):
    """(the mistakes, what they return for ``metric``), computed from the ranks' own log-probabilities."""
    for padding in (False, True):  # the repeats left out, or counted
        batches = {}
        for rank, ran in runs.items():
            keep = [[padding or i in real[rank] for i in indices.tolist()] for indices, _ in ran]
            batches[rank] = [_sums(indices[k], out[k], labels) for (indices, out), k in zip(ran, keep)]
        shards = [_add(b) for b in batches.values()]
        said = [PADDING] if padding else []
        if padding:
            yield said, _ratios(_add(shards))[metric]
        yield said + [RANKS], _mean([_ratios(s) for s in shards])[metric]
        if metric == "recall":
            yield said + [PRECISION], _ratios(_add(shards))["precision"]
            continue
        per_batch = {rank: [_ratios(s) for s in b if s["seen"].sum()] for rank, b in batches.items()}
        yield said + [BATCHES], _mean([r for b in per_batch.values() for r in b])[metric]
        yield said + [BATCHES, RANKS], _mean([_mean(b) for b in per_batch.values()])[metric]


def _facts(metric: str, runs: dict, real: dict, n: int) -> dict:
    """What the messages of the usual mistakes quote."""
    world = len(runs)
    per_rank = -(-n // world)
    return dict(metric=metric, n=n, per_rank=per_rank, repeats=per_rank * world - n, counted=per_rank * world,
                sizes=" and ".join(str(len(real[rank])) for rank in sorted(real)),
                per_class=", and each class a different number on each rank" if metric == "recall" else "",
                batches=" and ".join(map(str, sorted({len(ix) for b in runs.values() for ix, _ in b}, reverse=True))))


def _mistake(metric: str, value, expected: dict, tolerance: dict, runs: dict, real: dict, labels) -> str:
    """What to say about a wrong ``metric``: the usual mistake it matches, float32 sums, or the difference."""
    n, world, right = len(labels), len(runs), expected[metric]
    if metric == "recall":
        c = int((value - right).abs().nan_to_num(float("inf")).argmax())
        said = f"the recall of class {c} is {value[c].item():.8g}, the one process's {right[c].item():.8g}"
    else:
        said = f"the {metric} is {value.item():.8g}, the one process's {right.item():.8g}"
    for mistakes, candidate in _usual_mistakes(runs, real, labels, metric):
        if _within(value, candidate, tolerance[metric]):
            return f"{said}: " + "; and ".join(m.format(**_facts(metric, runs, real, n)) for m in mistakes) + "."
    # float32 sums of the n per-sample losses, in any order, then the all-reduce and the division:
    # at most gamma_(n+W+1) sum_i l_i / n <= (n + W + 2) u32 L off.
    if metric == "loss" and _within(value, right, tolerance[metric] + (n + world + 2) * U32 * right):
        return (f"{said}, off by {(value - right).abs().item():.2g}: more than the rounding of float32 "
                f"log-probabilities allows ({tolerance[metric].item():.2g}), but as much as float32 sums lose. Sum "
                "the losses in float64 (Hint 2).")
    return (f"{said}, and none of the usual mistakes (repeats counted, ratios of the ranks or of the batches "
            "averaged) gives that. Compare your steps with the shape of the code in Hint 3.")


def _check_one_collective(ranks: dict) -> None:
    for rank, got in sorted(ranks.items()):
        counts = got.get("collectives", {})
        if sum(counts.values()) != 1:
            raise CheckFailed(
                f"the results are right, but rank {rank}'s evaluate made {sum(counts.values())} collectives "
                f"({_describe(counts)}): one tensor can carry every sum and count, in one all-reduce, and each "
                "collective pays its start-up latency (Hint 1).")
