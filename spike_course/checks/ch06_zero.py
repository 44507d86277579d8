"""Exercise checks for chapter 06: fully sharded data parallel (ZeRO-1 by hand; an FSDP2
checkpoint saved on N ranks that a job on another number of ranks resumes exactly)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from ._common import CheckFailed, Mistake, close, launch_reports, name_the_first, passed

# --- exercise 1: ZeRO stage 1 by hand ---

NOT_GATHERED = ("the updated parameters were not all-gathered after the step: every rank "
                "must all_gather the updated slices and copy them into its full model "
                "before the next forward.")


class _Rank:
    """One rank's results as the steps read them: its model's flat parameters (in float64, to
    compare), its slice [start, end), and what its optimizer holds."""

    def __init__(self, rank: int, report: dict, rtol: float, atol: float):
        self.rank, self.report, self.rtol, self.atol = rank, report, rtol, atol
        self.flat = report["zero1"].detach().double()
        self.start, self.end = (int(i) for i in report["owned"])
        self.initial, self.stepped = report.get("initial"), report.get("stepped")

    def close(self, actual, expected) -> bool:
        return close(actual, expected, self.rtol, self.atol)


class _Layout:
    """How the ranks split the flat parameters [0, total): their slices, and the elements their
    optimizers kept state for (measured in the ranks)."""

    def __init__(self, results: dict, total: int):
        self.total, self.world = total, len(results)
        self.spans = sorted(tuple(int(i) for i in results[rank]["owned"]) for rank in sorted(results))
        self.held = {rank: int(results[rank]["optimizer_numel"]) for rank in sorted(results)}

    @property
    def whole_model_stepper(self) -> int | None:
        """The first rank whose optimizers kept state for the whole model (on more than one rank)."""
        return next((rank for rank, held in self.held.items() if self.world > 1 and held >= self.total), None)

    @property
    def tiled(self) -> bool:
        """Each slice starts where the one before it ends."""
        ends = [0] + [end for _, end in self.spans[:-1]]
        return all(start == position and end >= start for (start, end), position in zip(self.spans, ends))

    @property
    def end(self) -> int:
        return self.spans[-1][1]


# How the ranks split the model and its optimizer state (readings: the layout).
LAYOUT_MISTAKES = (
    Mistake("the whole model stepped", lambda l: l.whole_model_stepper is not None,
            lambda l: f"rank {l.whole_model_stepper}'s optimizers kept state for {l.held[l.whole_model_stepper]:,} "
                      f"elements after their steps (measured in the rank, whichever optimizer stepped), the whole "
                      f"model's {l.total:,}: the rank steps the whole model, so the optimizer state is not sharded "
                      f"(that is plain DDP memory). Only this rank's slice, about {l.total // l.world:,} elements, may "
                      "have optimizer state (Hint 1)."),
    Mistake("slices do not tile", lambda l: not l.tiled,
            lambda l: f"the owned slices {l.spans} do not tile [0, {l.total:,}) without gaps or overlaps: rank r "
                      "should own [r * shard_size, min((r + 1) * shard_size, total))."),
    Mistake("shard size rounded down", lambda l: l.end < l.total,
            lambda l: f"the owned slices {l.spans} stop at {l.end:,}, not at {l.total:,}: round the shard size up "
                      "(ceil(total / world_size))."),
    # the shard size rounded up, and the last slice not cut at the end
    Mistake("last slice past the end", lambda l: l.end > l.total,
            lambda l: f"the owned slices {l.spans} stop at {l.end:,}, past the end of the model's {l.total:,} "
                      "elements: the last slice must end where the flat parameters end (Hint 3)."),
)


def _never_changed(r: _Rank) -> bool:
    """Training left the rank's model where it started (when the report says where that was)."""
    return r.initial is not None and r.close(r.flat, r.initial)


def _ddp(r: _Rank):
    return r.report["ddp"].detach().double()


# What one rank's model shows, before the ranks are compared and after (readings: the rank;
# the second table also the first rank, whose model every rank should hold).
UNCHANGED_MISTAKES = (
    Mistake("gradient wiped before the step",
            lambda r: _never_changed(r) and r.stepped is not None and r.close(r.stepped, r.initial[r.start:r.end]),
            lambda r: f"rank {r.rank}: the model's parameters never changed, and neither did the slice its optimizer "
                      "holds: every step saw a zero gradient (zeroed before optimizer.step(), or never handed to the "
                      "slice's .grad)."),
    Mistake("the stepped slice never copied back", _never_changed,
            lambda r: f"rank {r.rank}: the model's parameters never changed: the optimizer stepped its own copy of "
                      f"the slice, but {NOT_GATHERED}"),
)
RANKS_END_APART = Mistake(
    "ranks end apart", lambda r, first: not r.close(r.flat, first.flat),
    lambda r, first: f"ranks {first.rank} and {r.rank} end with different parameters (max difference "
                     f"{(r.flat - first.flat).abs().max().item():.2e}): {NOT_GATHERED}")
NOT_DDP_MISTAKES = (
    Mistake("only its own slice updated", lambda r: r.close(r.flat[r.start:r.end], _ddp(r)[r.start:r.end]),
            lambda r: f"rank {r.rank}: its own slice [{r.start:,}, {r.end:,}) matches DDP but the rest of its model "
                      f"does not (max error {(r.flat - _ddp(r)).abs().max().item():.2e}): {NOT_GATHERED}"),
    Mistake("gradients not averaged", lambda r: True,
            lambda r: f"rank {r.rank}: the parameters differ from DDP (max error "
                      f"{(r.flat - _ddp(r)).abs().max().item():.2e}). Average the gradients over ranks (all_reduce, "
                      "then divide by the world size) before the step, and give the optimizer the gradient of its "
                      "own slice."),
)


def check_zero1(results, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Check a hand-written ZeRO stage 1 against DDP trained on the same batches.

    ``results[rank]`` (what ``launch(...).reports`` gives) holds: "zero1", the flat
    parameters of the rank's model after training; "ddp", the flat parameters of the DDP
    reference; "owned", the (start, end) slice of the flat parameters the rank steps;
    "optimizer_numel", how many elements the rank's optimizers keep state for (measured by
    the worker's own code after each step of any optimizer, not read from the answer's); and
    optionally "initial", the flat parameters before training, and "stepped", the values of
    the parameters the rank's optimizer holds after training (its slice).
    """
    results = launch_reports(results, "the ZeRO-1 step in zero1.py")  # a launch (check=False) or its reports
    if not results:
        raise CheckFailed("no rank reported anything: did the worker call runtime.report(...)?")
    total = results[min(results)]["ddp"].numel()
    name_the_first(LAYOUT_MISTAKES, _Layout(results, total))
    ranks = [_Rank(rank, results[rank], rtol, atol) for rank in sorted(results)]
    for r in ranks:
        name_the_first(UNCHANGED_MISTAKES, r)
    for r in ranks[1:]:  # every rank ends with the same full model: the updated slices were gathered
        name_the_first((RANKS_END_APART,), r, ranks[0])
    for r in ranks:  # the rank's model is DDP's, trained on the same batches
        if not r.close(r.flat, _ddp(r)):
            name_the_first(NOT_DDP_MISTAKES, r)
    passed(f"ZeRO-1 by hand on {len(ranks)} ranks matches DDP; each rank keeps optimizer state for "
           f"{max(int(r.report['optimizer_numel']) for r in ranks):,} of {total:,} elements")


# --- exercise 2: an FSDP2 checkpoint that outlives its job's shape ---

U = 2.0 ** -24  # float32's unit roundoff
UPDATE_SHARE = 1e-3  # of the resumed steps' update: see _check_continued


def _global_batch(step: int, samples: int, global_batch: int) -> list[int]:
    """The sample ids of a step of the uninterrupted job: the sampler's shuffle of the step's
    epoch, one global batch after another (what every number of ranks deals out among itself)."""
    from torch.utils.data import DistributedSampler

    epoch, done = divmod(step, samples // global_batch)
    order = DistributedSampler(range(samples), num_replicas=1, rank=0, shuffle=True, seed=0)
    order.set_epoch(epoch)
    return sorted(list(order)[done * global_batch:(done + 1) * global_batch])


class _Step:
    """What all ranks of a job trained in one step, against the uninterrupted job's global batches."""

    def __init__(self, reports: dict, job: str, step: int, stop: int, samples: int, global_batch: int):
        import torch

        self.job, self.step, self.samples, self.global_batch = job, step, samples, global_batch
        self.per_epoch, self.epoch = samples // global_batch, step // (samples // global_batch)
        self.got = sorted(torch.cat([reports[r]["trained"][step]["ids"] for r in sorted(reports)]).tolist())
        # the earlier (or later) steps whose global batch these samples are
        self.same = [t for t in range(stop) if _global_batch(t, samples, global_batch) == self.got]

    @property
    def right(self) -> bool:
        return self.got == _global_batch(self.step, self.samples, self.global_batch)


# Which samples a step trained, when they are not its global batch (readings: the step).
STEP_MISTAKES = (
    Mistake("not one global batch of different samples",
            lambda s: len(set(s.got)) != len(s.got) or len(s.got) != s.global_batch,
            lambda s: f"in step {s.step} of the {s.job} the ranks trained {len(s.got)} samples, {len(set(s.got))} "
                      f"of them different: a step is one global batch of {s.global_batch} different samples, dealt "
                      "out to the ranks by the sampler (Hint 1)."),
    Mistake("an epoch in another epoch's shuffle",
            lambda s: bool(s.same) and s.same[0] % s.per_epoch == s.step % s.per_epoch,
            lambda s: f"step {s.step} of the {s.job} (epoch {s.epoch}) trained the very samples of step {s.same[0]} "
                      f"(epoch {s.same[0] // s.per_epoch}): epoch {s.epoch} was dealt out in the shuffle of epoch "
                      f"{s.same[0] // s.per_epoch}, not in its own (Hint 2)."),
    Mistake("the data restarted", lambda s: bool(s.same) and s.same[0] < s.step,
            lambda s: f"step {s.step} of the {s.job} trained again the samples of step {s.same[0]}, which were "
                      f"trained already, and the samples of step {s.step} were skipped: the data did not continue "
                      "where the checkpoint left it (Hint 1)."),
)

WRONG_STEPS = Mistake(
    "the wrong steps trained", lambda trained, steps, job: trained != list(steps),
    lambda trained, steps, job: f"the {job} trained steps {trained}, not {list(steps)}: batches(start) gave too few "
                                "or too many steps, or the wrong ones (Hint 3).")


def _check_samples(reports: dict, job: str, steps: range, samples: int, global_batch: int) -> None:
    """Every step of ``steps`` trained, all ranks together, exactly its global batch."""
    name_the_first((WRONG_STEPS,), sorted(reports[0].get("trained", {})), steps, job)
    for step in steps:
        s = _Step(reports, job, step, steps.stop, samples, global_batch)
        if s.right:
            continue
        name_the_first(STEP_MISTAKES, s)
        raise CheckFailed(
            f"step {step} of the {job} trained samples that are no global batch of the uninterrupted job: "
            f"its {samples} samples make {s.per_epoch} global batches of {global_batch} per epoch, in the "
            "sampler's shuffle of that epoch, and step s takes the next one. Where the data continues must "
            "not depend on how many ranks deal each global batch out (Hint 1).")


class _Checkpoint:
    """The folder save(step) wrote, as DCP and the ranks left it; each reading made when first asked for."""

    def __init__(self, path: Path, world: int, params: dict):
        self.path, self.world, self.params = path, world, params

    @functools.cached_property
    def files(self) -> list[str]:
        return sorted(f.name for f in self.path.iterdir()) if self.path.is_dir() else [self.path.name]

    @functools.cached_property
    def metadata(self) -> dict:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(self.path)).read_metadata().state_dict_metadata

    @property
    def shards(self) -> int:
        return len([f for f in self.files if f.endswith(".distcp")])

    @property
    def lacking(self) -> list[str]:
        """The model's parameters that no entry of the checkpoint holds."""
        return [n for n in self.params if not any(k == n or k.endswith("." + n) for k in self.metadata)]

    @property
    def whole(self) -> bool:
        """Every tensor that the ranks hold in shards was written as one whole piece."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        tensors = [m for m in self.metadata.values() if isinstance(m, TensorStorageMetadata) and len(m.size)
                   and m.size[0] >= self.world]
        return self.world > 1 and all(len(m.chunks) == 1 and tuple(m.chunks[0].sizes) == tuple(m.size)
                                      for m in tensors)


# The checkpoint is DCP's, every rank wrote its own shards, and the optimizer state is keyed by
# name (readings: the checkpoint), in this order: each assumes the ones before it were not seen.
CHECKPOINT_MISTAKES = (
    Mistake("nothing saved", lambda c: not c.path.exists(),
            lambda c: f"nothing was saved at {c.path}: save(step) writes the checkpoint to args.checkpoint (Hint 2)."),
    Mistake("not a DCP checkpoint", lambda c: not (c.path / ".metadata").is_file(),
            lambda c: f"{c.path} holds {c.files}, no .metadata: that is not a DCP checkpoint. A file that one rank "
                      "writes (torch.save) holds that rank's view only, its shards or whole tensors gathered through "
                      "its memory, and nothing records how the pieces fit together: a job of another shape cannot "
                      "load it piece by piece (Hint 2)."),
    Mistake("not every rank wrote", lambda c: c.shards != c.world,
            lambda c: f"{c.path} holds {c.shards} shard files for {c.world} ranks: the save is a collective that "
                      "every rank takes part in, each writing its own shards (Hint 2)."),
    Mistake("the model left out", lambda c: bool(c.lacking),
            lambda c: f"the checkpoint has no entry for {len(c.lacking)} of the model's parameters (e.g. "
                      f"{c.lacking[0]!r}): it does not hold the model's state (Hint 2)."),
    Mistake("optimizer state keyed by number",
            lambda c: any(re.search(r"\.state\.\d+\.momentum_buffer$", k) for k in c.metadata),
            "the optimizer state in the checkpoint is keyed by parameter numbers (optimizer.state_dict() numbers "
            "the parameters 0, 1, 2, ...), not by name: a number means nothing to a model built or sharded another "
            "way, so no job of another shape can match it (Hint 2)."),
    Mistake("no optimizer state", lambda c: not any(k.endswith(".momentum_buffer") for k in c.metadata),
            "the checkpoint holds the model but no optimizer state: a job resumed from it restarts SGD's momentum "
            "from zero, a jolt in its training that the uninterrupted job never had (Hint 1)."),
    Mistake("gathered whole before the save", lambda c: c.whole,
            lambda c: f"every tensor in the checkpoint was written as one whole piece, none as the {c.world} shards "
                      "the ranks hold: the state was gathered whole before the save (a full state dict, or "
                      "full_tensor()), so each rank held the whole model and optimizer state at once, the memory "
                      "FSDP is there to avoid, and on a model that needs sharding that gather runs out of memory. "
                      "DCP reshards a sharded save by itself when it loads (Hint 2)."),
)


class _Loaded:
    """Right after resume(): what the resumed job holds (``loaded``) against what the saved job
    saved (``before``), and the checkpoint's keys."""

    def __init__(self, resumed: dict, saved: dict, keys: list):
        import torch

        self.loaded, self.before, self.keys = resumed["loaded"], saved["saved"], keys
        self.differ = [n for n, p in self.before["params"].items() if not torch.equal(self.loaded["params"][n], p)]
        momentum = self.loaded["momentum"]
        self.no_momentum = set(momentum) != set(self.before["momentum"]) or not any(m.any() for m in momentum.values())
        self.wrong_momentum = [] if self.no_momentum else [
            n for n, m in self.before["momentum"].items() if not torch.equal(momentum[n], m)]

    @property
    def where_the_schedule_is(self) -> str:
        stored = [k for k in self.keys if k.endswith("last_epoch")]
        return (f"the checkpoint holds it ({stored[0]}) but it never reached this job's scheduler" if stored
                else "the checkpoint holds no learning-rate schedule")


# Everything the next step depends on, bit for bit (readings: what was loaded).
LOAD_MISTAKES = (
    Mistake("nothing loaded", lambda d: len(d.differ) == len(d.before["params"]),
            "after resume() the model holds none of the saved weights: nothing was loaded into it. DCP loads in "
            "place, into the tensors of the dict it is given (Hint 2)."),
    Mistake("some weights differ", lambda d: bool(d.differ),
            lambda d: f"after resume() {len(d.differ)} of {len(d.before['params'])} weights differ from the saved ones "
                      f"(e.g. {d.differ[0]}): loading copies bits, so all must be equal (Hint 2)."),
    Mistake("optimizer state not loaded", lambda d: d.no_momentum,
            "after resume() SGD's momentum is all zeros (or missing): the model was loaded, the optimizer state was "
            "not, so the resumed job restarts its momentum from nothing (Hint 2)."),
    Mistake("another momentum loaded", lambda d: bool(d.wrong_momentum),
            lambda d: f"after resume() the momentum of {d.wrong_momentum[0]} (and {len(d.wrong_momentum) - 1} more) is "
                      "not the saved one: it must come back bit for bit (Hint 2)."),
    Mistake("the optimizer's hyperparameters not loaded", lambda d: d.loaded["lr"] != d.before["lr"],
            lambda d: f"after resume() the optimizer's learning rate is {d.loaded['lr']:.6g}, the saved job's was "
                      f"{d.before['lr']:.6g}: the optimizer's hyperparameters (its param_groups) were not put back, "
                      "only its tensors, so the next step runs with the fresh scheduler's first value (Hint 2)."),
    Mistake("the scheduler not restored", lambda d: d.loaded["schedule_step"] != d.before["schedule_step"],
            lambda d: f"after resume() the scheduler stands at step {d.loaded['schedule_step']}, the saved job's stood "
                      f"at {d.before['schedule_step']}: {d.where_the_schedule_is}. The resumed job's learning rate "
                      "would follow the schedule from its start again, warmup included (Hint 1)."),
)


def _check_continued(resumed: dict, saved: dict, start: int) -> float:
    """The resumed job's last weights against the uninterrupted job's; returns the share of the
    tolerance used.

    Both jobs start these steps from the same bits, train on the same samples with the same
    learning rates: only the sums differ. Each gradient entry is a sum over the global batch's
    terms (32 samples of 16 positions, n = 512), grouped by 2 ranks in halves and by 4 in
    quarters, and regrouping a sum of n terms changes it by at most (n - 1)u of the sum of their
    magnitudes, about 3e-5: that share of each step's update where the terms do not cancel.
    UPDATE_SHARE = 1e-3 of the update leaves room for terms that cancel up to a factor of 30.
    Each job also rounds every weight once per step: up to 2 S u |w| apart after S steps.
    """
    final, expected, at_save = resumed["final"]["params"], saved["final"]["params"], saved["saved"]["params"]
    steps = len(saved["trained"]) - start
    worst, where = 0.0, ""
    for name, w in expected.items():
        update = (w.double() - at_save[name].double()).abs().max().item()
        allowed = 2 * steps * U * w.double().abs() + UPDATE_SHARE * update
        used = ((final[name].double() - w.double()).abs() / allowed.clamp_min(1e-30)).max().item()
        if used > worst:
            worst, where = used, name
    if worst > 1:
        gap = (final[where].double() - expected[where].double()).abs().max().item()
        raise CheckFailed(
            f"the resumed job's {where} ends {gap:.2e} away from the uninterrupted job's, {worst:.0f} times what "
            "rounding allows, although it loaded the same state and trained the same samples with the same "
            "learning rates: something else in the training differs between the two jobs (Hint 1).")
    return worst


# A rank that waited in the save's collective until it timed out (readings: its error line).
SAVED_ON_SOME_RANKS = Mistake(
    "the save entered by some ranks only", lambda error: "imed out" in error,
    " A rank waited in a collective that another rank never entered: the save is a collective, so every rank takes "
    "part in it. The cell above shows its traceback.")
STEP_NOT_READ_BACK = Mistake(
    "the step not read back", lambda start, save_at: start != save_at,
    lambda start, save_at: f"resume() returned {start!r}, the checkpoint was written after step {save_at}: the number "
                           "of steps trained did not come back from the checkpoint, so the resumed job does not know "
                           "where it is, in its schedule or in its data (Hint 1).")
ANOTHER_LEARNING_RATE = Mistake(
    "another learning rate", lambda step, lr, expected: lr != expected,
    lambda step, lr, expected: f"step {step} of the resumed job stepped with learning rate {lr:.6g}, the "
                               f"uninterrupted job's with {expected:.6g}: the schedule did not go on from where it "
                               "stood (Hint 1).")


def check_fsdp2_checkpoint(saved, resumed, checkpoint) -> None:
    """Check exercise 2: a job trained with FSDP2 saves a DCP checkpoint, and a job with another
    number of ranks resumes from it and trains exactly what the uninterrupted job trains.

    ``saved`` and ``resumed`` are the LaunchResults (launched with ``check=False``) of the worker
    run with ``--save-at K`` (it saves after K steps and trains on to the end: the uninterrupted
    job) and with ``--resume``; ``checkpoint`` is the folder the first saved to. Their reports
    hold "trained" (step -> this rank's sample "ids" and the "lr" it stepped with), "final" (the
    weights gathered whole at the end), "samples" and "global_batch"; the first's also "saved"
    (weights, momentum, lr and scheduler step before saving) and "saved_at"; the second's
    "start" (what resume() returned) and "loaded" (the same as "saved", right after loading).

    Exact: the samples of every step, the layout of the checkpoint, everything loaded (bits) and
    the learning rate of every step. Within rounding: the final weights (see _check_continued).
    """
    path = Path(checkpoint)
    first = launch_reports(saved, "the worker")
    saved_world = len(first)
    head = first[0]
    samples, global_batch = head["samples"], head["global_batch"]
    save_at = head.get("saved_at")
    total = len(head.get("trained", {}))
    _check_samples(first, "saved job", range(total), samples, global_batch)
    if save_at is None:
        raise CheckFailed("the saved job reached no save: run the worker with --save-at (the cell above does).")
    if not saved.ok:
        failure = saved.failure
        rank, code, error = failure.rank, failure.code, failure.error
        failed = f"the job trained, but rank {rank} failed afterwards, while saving (exit code {code}): {error}."
        name_the_first((SAVED_ON_SOME_RANKS,), error, before=failed)
        raise CheckFailed(failed + " The cell above shows its traceback.")
    layout = _Checkpoint(path, saved_world, head["saved"]["params"])
    name_the_first(CHECKPOINT_MISTAKES, layout)
    keys = list(layout.metadata)

    second = launch_reports(resumed, "the resumed job")
    start = second[0].get("start")
    name_the_first((STEP_NOT_READ_BACK,), start, save_at)
    name_the_first(LOAD_MISTAKES, _Loaded(second[0], head, keys))
    _check_samples(second, "resumed job", range(start, total), samples, global_batch)
    for step in range(start, total):
        name_the_first((ANOTHER_LEARNING_RATE,), step, second[0]["trained"][step]["lr"], head["trained"][step]["lr"])
    used = _check_continued(second[0], head, start)
    passed(f"saved on {saved_world} ranks after step {save_at}, resumed on {len(second)}: the same weights, "
           f"momentum and schedule bit for bit, the same samples and learning rates in steps {start}-{total - 1}, "
           f"and the same final weights ({used:.1%} of the rounding tolerance used)")
