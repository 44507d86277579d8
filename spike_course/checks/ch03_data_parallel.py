"""Exercise checks for chapter 03: data parallel."""

from __future__ import annotations

from ._common import CheckFailed, Mistake, all_close, close, largest_difference, launch_reports, name_the_first, passed


def _same_names_all_close(a: dict, b: dict, rtol: float, atol: float, factor: float = 1.0) -> bool:
    return a.keys() == b.keys() and all_close(a, b, factor, rtol, atol)


class _Averaged:
    """What one rank's call of average_gradients_flat left in .grad: the gradients still its own
    batch's (``kept``), and the collectives it made."""

    def __init__(self, rank: int, got: dict):
        import torch

        self.rank, self.grads, self.collectives = rank, got["grads"], got["collectives"]
        self.kept = [name for name in got["grads"] if torch.equal(got["grads"][name], got["local"][name])]


# A rank whose gradients are, some or all, still its own batch's (readings: the rank's call).
NOT_AVERAGED = (
    Mistake("no collective", lambda a: bool(a.kept) and not sum(a.collectives.values()),
            lambda a: f"average_gradients_flat made no collective: rank {a.rank}'s gradients are its own batch's. Pack "
                      "every .grad into one buffer, dist.all_reduce it, divide by the world size and copy the slices "
                      "back into the .grads."),
    Mistake("the buffer never copied back", lambda a: len(a.kept) == len(a.grads),
            lambda a: f"the averaged buffer was never copied back into .grad: after your call rank {a.rank}'s "
                      f"gradients are exactly its own batch's, although it made {_describe(a.collectives)}. torch.cat "
                      "(like flatten of several tensors) makes a new tensor, a copy; the all-reduce changed that copy "
                      "only. Write each slice back in place (p.grad.copy_(...)); assigning it to a loop variable (g = "
                      "flat[...]) changes nothing."),
    Mistake("some gradients not copied back", lambda a: bool(a.kept),
            lambda a: f"only some gradients were copied back from the flat buffer: rank {a.rank}'s "
                      f"{', '.join(a.kept)} still hold its own batch's gradient. Copy every parameter's slice."),
)

# A gradient that holds another part of the flat buffer (readings: (name, at, own) or None).
MISALIGNED = Mistake(
    "slices misaligned", lambda misplaced: misplaced is not None,
    lambda misplaced: "the slices are misaligned: {0}.grad holds the buffer's values from position {1}, but {0}'s own "
                      "gradient starts at {2}. Advance the offset by p.grad.numel() after each parameter, and unpack "
                      "in the same order as you packed.".format(*misplaced))

# Right gradients, but more than one collective (readings: the rank, its counts, the parameters).
COLLECTIVE_MISTAKES = (
    Mistake("one all-reduce per parameter", lambda rank, count, params: count.get("allreduce_", 0) > 1,
            lambda rank, count, params: f"the gradients are right, but with {count.get('allreduce_', 0)} all-reduces "
                                        f"in one step on rank {rank} (one per parameter? the model has {params}): "
                                        "flatten into one buffer and all-reduce it once. Each collective pays its "
                                        "start-up latency however small its tensor; that is why DDP packs the "
                                        "gradients into buckets."),
    Mistake("other collectives", lambda rank, count, params: sum(count.values()) != 1,
            lambda rank, count, params: f"the gradients are right, but rank {rank} made {_describe(count)} in one "
                                        "step: one all-reduce (SUM) of one flat buffer is all it takes."),
)


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
    ranks = launch_reports(job, "average_gradients_flat")
    for rank, got in sorted(ranks.items()):
        if "collectives" not in got or "local" not in got:
            raise CheckFailed(f"rank {rank} did not report 'local' and 'collectives': run the worker as given, "
                              "with only average_gradients_flat changed.")
        name_the_first(NOT_AVERAGED, _Averaged(rank, got))
    zero = ranks[min(ranks)]
    name_the_first((MISALIGNED,), _misplaced_slice(zero["grads"], reference["grads"], rtol, atol))
    _compare_training(_Training(ranks, reference, rtol, atol))
    for rank, got in sorted(ranks.items()):
        name_the_first(COLLECTIVE_MISTAKES, rank, got["collectives"], len(zero["grads"]))
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


class _Training:
    """The ranks' training (``ranks``, each reporting initial, grads and final) against one process
    that trained on the whole batch (``reference``)."""

    def __init__(self, ranks: dict, reference: dict, rtol: float, atol: float):
        self.ranks, self.reference, self.rtol, self.atol = ranks, reference, rtol, atol
        self.first = min(ranks)
        self.zero, self.world = ranks[self.first], len(ranks)

    def first_rank_where(self, key: str, differs) -> tuple | None:
        """(rank, largest difference, where) of the first rank whose ``key`` differs from rank 0's by
        ``differs(difference)``, or None."""
        for rank, got in sorted(self.ranks.items()):
            diff, name = largest_difference(got[key], self.zero[key])
            if differs(diff):
                return rank, diff, name
        return None

    @property
    def unbroadcast(self):
        return self.first_rank_where("initial", lambda diff: diff > 0)

    @property
    def unreduced(self):
        scale = max(_largest_magnitude(self.zero["grads"]), 1e-12)
        return self.first_rank_where("grads", lambda diff: diff > self.atol + self.rtol * scale)

    def grads_times(self, factor: float) -> bool:
        return self.world > 1 and _same_names_all_close(self.zero["grads"], self.reference["grads"], self.rtol,
                                                        self.atol, factor=factor)

    @property
    def drifted(self):
        """(rank, difference, where) of the first rank whose final model is not the reference's, or None."""
        for rank, got in sorted(self.ranks.items()):
            if not _same_names_all_close(got["final"], self.reference["final"], self.rtol, 10 * self.atol):
                return (rank, *largest_difference(got["final"], self.reference["final"]))
        return None


# The first way the ranks did not train like the one process, in the order of a step: the start,
# the gradients, then the whole training (readings: the training).
TRAINING_MISTAKES = (
    Mistake("weights not broadcast", lambda t: t.unbroadcast is not None,
            lambda t: "the weights were not broadcast at the start: before the first step rank {0}'s {2} differs from "
                      "rank {3}'s by {1:.3g}. Each rank built its model from its own random seed, so the replicas "
                      "train different models. Broadcast every parameter from rank 0 (dist.broadcast(p.data, src=0)) "
                      "before training, as DistributedDataParallel does.".format(*t.unbroadcast, t.first)),
    Mistake("broadcast from another rank",
            lambda t: not _same_names_all_close(t.zero["initial"], t.reference["initial"], t.rtol, t.atol),
            lambda t: "all ranks start from the same weights, but not rank 0's ({1} differs by {0:.3g}): broadcast "
                      "with src=0".format(*largest_difference(t.zero["initial"], t.reference["initial"]))),
    Mistake("gradients not all-reduced", lambda t: t.unreduced is not None,
            lambda t: "the gradients were not all-reduced: after backward rank {0}'s {2}.grad differs from rank {3}'s "
                      "by {1:.3g}, so each replica steps with its own batch's gradient and the replicas drift apart. "
                      "all_reduce every p.grad before optimizer.step().".format(*t.unreduced, t.first)),
    Mistake("summed, not averaged", lambda t: t.grads_times(t.world),
            lambda t: f"the gradients were summed but not averaged: they are {t.world} times too big ({t.world} is the "
                      "world size). all_reduce with ReduceOp.SUM adds the ranks' gradients; divide by "
                      "dist.get_world_size() afterwards to get the mean over the whole batch."),
    Mistake("divided twice", lambda t: t.grads_times(1 / t.world),
            lambda t: f"the gradients are 1/{t.world} of the single-process gradient: divided by the world size twice "
                      "(ReduceOp.AVG already averages), or divided without all-reducing first."),
)

STEPS_AFTER_THE_FIRST = Mistake(
    "the first step only", lambda t: t.drifted is not None,
    lambda t: "the first step is right, but after training rank {0}'s {2} differs from the single-process model by "
              "{1:.3g}: average the gradients in EVERY step, after loss.backward() and before optimizer.step() (and "
              "zero them before each backward).".format(*t.drifted))


def _compare_training(t: _Training) -> None:
    """Raise CheckFailed naming the first way the ranks did not train like the one process."""
    name_the_first(TRAINING_MISTAKES, t)
    if not _same_names_all_close(t.zero["grads"], t.reference["grads"], t.rtol, t.atol):
        diff, name = largest_difference(t.zero["grads"], t.reference["grads"])
        raise CheckFailed(f"the first step's gradients differ from the single-process gradients ({name} by "
                          f"{diff:.3g}): all-reduce (sum) every parameter's .grad, then divide by the world size")
    name_the_first((STEPS_AFTER_THE_FIRST,), t)


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
            _check_value(_Value(metric, got[metric], expected, tolerance, runs, real, labels))
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


def _rows(got: dict) -> tuple:
    """(rows the network's first layer counted, samples the model's own hook saw) of one rank."""
    return got.get("first_layer_rows"), sum(len(inputs) for inputs, _, _ in got.get("forwards", []))


# The worker counts the rows the network's first layer got, beside the model's own hook
# (readings: the rank, its report).
HOOK_MISTAKES = (
    Mistake("the counting hook taken away",
            lambda rank, got: _rows(got)[0] is not None and _rows(got)[0] < _rows(got)[1],
            lambda rank, got: "rank {0}'s model ran on {2} samples during evaluate, but its first layer counted only "
                              "{1}: evaluate removed the hook the worker counts with, so what the rank ran cannot be "
                              "known. Leave the model's hooks as the worker set them.".format(rank, *_rows(got))),
    Mistake("past the model's hook", lambda rank, got: _rows(got)[0] is not None and _rows(got)[0] > _rows(got)[1],
            lambda rank, got: "rank {0}'s network ran on {1} samples during evaluate, but only {2} of them went "
                              "through the model as model(x) runs it: the others went through model.forward (or its "
                              "layers called by hand), which skips the model's hooks, so no one can tell which samples "
                              "they were. Call the model itself, on the rank's shard only.".format(rank, *_rows(got))),
)


def _check_called_as_a_module(ranks: dict) -> None:
    """Rows the hook never saw went through the model by another way than model(x), and fewer
    rows than the hook saw mean the worker's counting hook was taken away."""
    for rank, got in sorted(ranks.items()):
        name_the_first(HOOK_MISTAKES, rank, got)


DROPOUT_ON = Mistake(
    "dropout on", lambda rank, training: training,
    lambda rank, training: f"rank {rank} ran the model in training mode during evaluate: dropout zeroed random "
                           "activations, so its predictions and losses are those of a random thinned network, not of "
                           "the model. Turn dropout off for the evaluation (Hint 2).")


def _runs(ranks: dict, images) -> dict:
    """Per rank, the batches its model ran on during evaluate: (test-set indices, float64
    log-probabilities). The model in training mode, or inputs that are not test images, end here."""
    import torch

    where = {image.numpy().tobytes(): i for i, image in enumerate(images.float().contiguous())}
    runs = {}
    for rank, got in sorted(ranks.items()):
        batches = []
        for inputs, outputs, training in got.get("forwards", []):
            name_the_first((DROPOUT_ON,), rank, training)
            found = [where.get(x.float().contiguous().numpy().tobytes()) for x in inputs]
            if None in found:
                raise CheckFailed(f"rank {rank}'s model ran on inputs that are not images of the test set: give the "
                                  "model the loader's images as they come (moved to the device, nothing else).")
            indices = torch.tensor(found, dtype=torch.long)
            if not (batches and torch.equal(batches[-1][0], indices)):  # the same batch twice counts once
                batches.append((indices, outputs.double()))
        runs[rank] = batches
    return runs


class _Shard:
    """What rank ``rank`` ran the model on (``ran``, test-set positions) against its
    DistributedSampler(shuffle=False) shard of a test set of ``n`` on ``world`` ranks."""

    def __init__(self, rank: int, batches: list, n: int, world: int):
        self.rank, self.n, self.world = rank, n, world
        total = -(-n // world) * world
        order = (list(range(n)) * -(-total // n))[:total]  # the sampler's order, its repeats appended
        self.ran = {i for indices, _ in batches for i in indices.tolist()}
        self.real = set(range(rank, n, world))  # its positions below n
        self.outside = sorted(self.ran - set(order[rank:total:world]))
        self.missing = sorted(self.real - self.ran)


# Each rank ran the model on its shard only, on every real sample of it (readings: the shard).
SPLIT_MISTAKES = (
    Mistake("the whole test set on every rank", lambda d: d.world > 1 and len(d.ran) == d.n,
            lambda d: f"rank {d.rank} ran the model on all {d.n} test samples: every rank evaluated the whole test "
                      f"set, so nothing was split (the right numbers, at {d.world} times the cost). Each rank runs the "
                      "model only on the shard DistributedSampler(dataset, shuffle=False) deals it (Hint 1)."),
    Mistake("another split", lambda d: bool(d.outside),
            lambda d: f"rank {d.rank} ran the model on {len(d.outside)} samples of other ranks' shards (sample "
                      f"{d.outside[0]}, for one): the test set was split otherwise than DistributedSampler(dataset, "
                      "shuffle=False) splits it, the split the training loader uses (Hint 2)."),
    Mistake("part of the shard never run", lambda d: bool(d.missing),
            lambda d: f"rank {d.rank}'s model never ran on {len(d.missing)} of the {len(d.real)} samples of its shard "
                      f"(sample {d.missing[0]}, for one), so nothing can count them: run the model on the whole shard, "
                      "batch by batch (Hint 3)."),
)


def _check_split(runs: dict, n: int) -> dict:
    """Each rank ran the model on its DistributedSampler(shuffle=False) shard only, on every real
    sample of it. Returns each rank's real samples: its shard without the repeats."""
    shards = {rank: _Shard(rank, batches, n, len(runs)) for rank, batches in sorted(runs.items())}
    for shard in shards.values():
        name_the_first(SPLIT_MISTAKES, shard)
    return {rank: shard.real for rank, shard in shards.items()}


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


class _Value:
    """A wrong value of ``metric`` against the one process's (``expected``, within ``tolerance``),
    and what the usual mistakes give for it, computed from the ranks' own log-probabilities."""

    def __init__(self, metric, value, expected, tolerance, runs, real, labels):
        self.metric, self.value, self.right, self.tolerance = metric, value, expected[metric], tolerance[metric]
        self.runs, self.real, self.labels, self.n, self.world = runs, real, labels, len(labels), len(runs)

    def shards(self, repeats_counted: bool) -> dict:
        """Each rank's sums, batch by batch: of its real samples, or of every sample it ran."""
        return {rank: [_sums(indices[k], out[k], self.labels) for (indices, out), k in
                       zip(ran, [[repeats_counted or i in self.real[rank] for i in indices.tolist()]
                                 for indices, _ in ran])]
                for rank, ran in self.runs.items()}

    def gives(self, repeats_counted: bool, how: str):
        """What an evaluation returns for the metric when it averages ``how`` ("ratio of sums",
        "ranks", "batches" or "precision"), counting the repeats or not; None where ``how`` does
        not apply to this metric."""
        batches = self.shards(repeats_counted)
        shards = [_add(b) for b in batches.values()]
        if how == "ratio of sums":
            return _ratios(_add(shards))[self.metric]
        if how == "ranks":
            return _mean([_ratios(s) for s in shards])[self.metric]
        if how == "precision":
            return _ratios(_add(shards))["precision"] if self.metric == "recall" else None
        if self.metric == "recall":  # a recall per batch is mostly 0/0: nobody averages those
            return None
        return _mean([_ratios(s) for b in batches.values() for s in b if s["seen"].sum()])[self.metric]

    def matches(self, repeats_counted: bool, how: str) -> bool:
        candidate = self.gives(repeats_counted, how)
        return candidate is not None and _within(self.value, candidate, self.tolerance)

    @property
    def said(self) -> str:
        if self.metric == "recall":
            c = int((self.value - self.right).abs().nan_to_num(float("inf")).argmax())
            return (f"the recall of class {c} is {self.value[c].item():.8g}, the one process's "
                    f"{self.right[c].item():.8g}")
        return f"the {self.metric} is {self.value.item():.8g}, the one process's {self.right.item():.8g}"

    @property
    def facts(self) -> dict:
        """What the messages of the usual mistakes quote."""
        per_rank = -(-self.n // self.world)
        return dict(metric=self.metric, n=self.n, per_rank=per_rank, repeats=per_rank * self.world - self.n,
                    counted=per_rank * self.world,
                    sizes=" and ".join(str(len(self.real[rank])) for rank in sorted(self.real)),
                    per_class=", and each class a different number on each rank" if self.metric == "recall" else "",
                    batches=" and ".join(map(str, sorted({len(ix) for b in self.runs.values() for ix, _ in b},
                                                         reverse=True))))

    @property
    def float32_bound(self):
        """float32 sums of the n per-sample losses, in any order, then the all-reduce and the division:
        at most gamma_(n+W+1) sum_i l_i / n <= (n + W + 2) u32 L off."""
        return self.tolerance + (self.n + self.world + 2) * U32 * self.right


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
HOW = {"ranks": RANKS, "batches": BATCHES, "precision": PRECISION, "ratio of sums": None}


def _value_slip(name: str, repeats_counted: bool, how: str) -> Mistake:
    """A usual mistake of the values: seen when the metric is what it gives, told by its parts."""
    parts = [PADDING] * repeats_counted + [HOW[how]] * (HOW[how] is not None)
    return Mistake(name, lambda v: v.matches(repeats_counted, how),
                   lambda v: f"{v.said}: " + "; and ".join(part.format(**v.facts) for part in parts) + ".")


# The usual wrong values, in this order (readings: the value). Averaging each rank's mean of its
# batch means is not among them: DistributedSampler pads every shard to the same size, so every
# rank has as many batches, and that mean is the mean of batch means.
VALUE_MISTAKES = (
    _value_slip("ratios of the ranks averaged", False, "ranks"),
    _value_slip("precision for recall", False, "precision"),
    _value_slip("mean of batch means", False, "batches"),
    _value_slip("repeats counted", True, "ratio of sums"),
    _value_slip("repeats counted and ratios of the ranks averaged", True, "ranks"),
    _value_slip("repeats counted and precision for recall", True, "precision"),
    _value_slip("repeats counted and mean of batch means", True, "batches"),
)


def _check_value(v: _Value) -> None:
    """What to say about a wrong value: the usual mistake it matches, float32 sums, or the difference."""
    name_the_first(VALUE_MISTAKES, v)
    # Not a mistake of the table: on the exercise's test set a float32 sum of the per-sample
    # losses, even one by one, stays within the tolerance (the tests tried it), so only a much
    # larger evaluation gets here with it; the words are a likely cause, not a named mistake.
    if v.metric == "loss" and _within(v.value, v.right, v.float32_bound):
        raise CheckFailed(f"{v.said}, off by {(v.value - v.right).abs().item():.2g}: more than the rounding of "
                          f"float32 log-probabilities allows ({v.tolerance.item():.2g}), but as much as float32 sums "
                          "lose. Sum the losses in float64 (Hint 2).")
    raise CheckFailed(f"{v.said}, and none of the usual mistakes (repeats counted, ratios of the ranks or of the "
                      "batches averaged) gives that. Compare your steps with the shape of the code in Hint 3.")


# Right results with more than one collective (readings: the rank, its counts).
COLLECTIVES_IN_EVALUATE = Mistake(
    "more than one collective in evaluate", lambda rank, counts: sum(counts.values()) != 1,
    lambda rank, counts: f"the results are right, but rank {rank}'s evaluate made {sum(counts.values())} collectives "
                         f"({_describe(counts)}): one tensor can carry every sum and count, in one all-reduce, and "
                         "each collective pays its start-up latency (Hint 1).")


def _check_one_collective(ranks: dict) -> None:
    for rank, got in sorted(ranks.items()):
        name_the_first((COLLECTIVES_IN_EVALUATE,), rank, got.get("collectives", {}))
