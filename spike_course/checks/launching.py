"""Exercise checks for chapter 07: launching at scale (resuming on another number of ranks)."""

from __future__ import annotations

import math

from ._common import CheckFailed, largest_difference, passed

# A learning rate is one float that the runs compute by the same few multiplications (the
# scheduler's gamma), or a restored copy of it: runs that agree differ by a few roundings of
# 1e-16 at most. 1e-12 accepts any honest way of getting there (a closed-form schedule, a
# replayed scheduler) and still tells apart every factor a mistake introduces (2, 1/2, ...).
LR_RTOL = 1e-12

REPORTED = ("world_size", "batch_size", "steps_per_epoch", "resumed_from", "start", "trained",
            "params", "momentum")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_RTOL, abs_tol=0.0)


def _report(results: dict, name: str) -> dict:
    """Rank 0's report of one launch, with everything the check reads."""
    if not results:
        raise CheckFailed(f"the {name} run reported nothing: pass the .reports of its launch(...)")
    report = results[min(results)]
    missing = [key for key in REPORTED if key not in report]
    if missing:
        raise CheckFailed(f"the {name} run did not report {missing}: it must run to its last line "
                          "(runtime.report at the end of the worker).")
    if not report["trained"]:
        raise CheckFailed(f"the {name} run trained no step at all: is --steps above the step it resumed "
                          "from, and --stop-at at least 1?")
    return report


def _check_global_batch(report: dict, name: str, global_batch: int, first_world: int) -> None:
    world, per_rank = report["world_size"], report["batch_size"]
    sizes = sorted({len(step["samples"]) for step in report["trained"].values()})
    if sizes == [global_batch]:
        return
    size = sizes[-1]
    if first_world != world and size == global_batch // first_world * world:
        raise CheckFailed(
            f"per-rank batch kept when the world size changed: the first part ran {first_world} ranks x "
            f"{global_batch // first_world} = {global_batch} samples per step, the {name} run "
            f"{world} x {per_rank} = {size}. The global batch is what changed, and it is a hyperparameter: "
            "each step averages the gradient over other samples (and over more or fewer of them), the "
            f"learning rate was tuned for {global_batch}, and an epoch has another number of steps. Derive "
            "the per-rank batch from the global one: batch_size = global_batch // WORLD_SIZE.")
    if size == global_batch * world:
        raise CheckFailed(
            f"each of the {world} ranks of the {name} run took --global-batch = {global_batch} samples, "
            f"so a step trained {size}: the global batch is the number of samples of ALL ranks together. "
            "batch_size = global_batch // WORLD_SIZE.")
    raise CheckFailed(
        f"the steps of the {name} run trained {'/'.join(map(str, sizes))} samples on {world} ranks "
        f"(per-rank batch {per_rank}), not --global-batch = {global_batch}: the per-rank batch times "
        "WORLD_SIZE must be the global batch, batch_size = global_batch // WORLD_SIZE.")


def _check_lr(report: dict, lr: float, global_batch: int) -> None:
    world = report["world_size"]
    got = report["trained"][min(report["trained"])]["lr"]
    if _same_lr(got, lr):
        return
    if world > 1 and _same_lr(got, lr * world):
        raise CheckFailed(
            f"learning rate scaled with the number of ranks: the run on {world} ranks started with lr "
            f"{got:g} = {world} x --lr {lr:g}, although its global batch is {global_batch}, the batch --lr "
            "was tuned for. The linear scaling rule scales the lr with the GLOBAL batch; when only "
            "WORLD_SIZE changes and the global batch stays, the lr stays: lr = args.lr.")
    if world > 1 and _same_lr(got, lr / world):
        raise CheckFailed(
            f"learning rate divided by the number of ranks: the run on {world} ranks started with lr "
            f"{got:g} = --lr {lr:g} / {world}. DDP already averages the gradients over the ranks; with the "
            "global batch that --lr was tuned for, use lr = args.lr.")
    raise CheckFailed(f"the first step used lr {got:g}, not --lr {lr:g}: with the global batch that --lr was "
                      "tuned for, the run uses lr = args.lr.")


def _check_position(u: dict, f: dict, r: dict, stopped: int) -> None:
    got = r["resumed_from"]
    if got == stopped:
        return
    if got == 0:
        raise CheckFailed(
            f"the resumed run started from step 0 although the first part saved a checkpoint after step "
            f"{stopped}: pass it the same --ckpt, and set `step` (and epoch, skip) from the checkpoint.")
    old, new = f["world_size"], r["world_size"]
    unit = ("The position was counted in a unit that depends on the world size (the samples or batches "
            f"of ONE rank, of {u['batch_size']} samples on {old} ranks) and read back with another. Store "
            "a position that means the same on any number of ranks: the samples seen by all ranks "
            "together (step x global batch), or the global step, which is the same thing while the "
            "global batch is fixed.")
    if got < stopped:
        raise CheckFailed(
            f"the resumed run on {_ranks(new)} continued after step {got}, but the checkpoint was taken "
            f"after step {stopped} on {old}: steps {got + 1}..{stopped} are trained twice, their samples "
            f"seen again. {unit}")
    raise CheckFailed(
        f"the resumed run on {_ranks(new)} continued after step {got}, but the checkpoint was taken after "
        f"step {stopped} on {old}: the samples of steps {stopped + 1}..{got} are never trained. {unit}")


def _check_restored_state(f: dict, r: dict, stopped: int) -> None:
    import torch

    for name, saved in f["params"].items():
        if not torch.equal(r["start"]["params"][name], saved):
            raise CheckFailed(
                f"the resumed run did not start from the saved model: its {name} differs from the first "
                f"part's after step {stopped}. Load the checkpoint's model state into the model before "
                "training (model.load_state_dict(state['model'])).")
    saved, loaded = f["momentum"], r["start"]["momentum"]
    if saved.keys() != loaded.keys() or any(not torch.equal(loaded[k], saved[k]) for k in saved):
        raise CheckFailed(
            "the resumed run did not start with the saved optimizer state: its momentum buffers are "
            "missing or differ from the first part's. Save optimizer.state_dict() and load it; SGD's "
            "momentum (Adam's moments) lives in the optimizer, not in the model.")


def _check_samples(u: dict, r: dict, stopped: int, last: int) -> None:
    ref, got = u["trained"], r["trained"]
    missing = [s for s in range(stopped + 1, last + 1) if s not in got]
    extra = sorted(s for s in got if s > last or s <= stopped)
    if missing or extra:
        raise CheckFailed(f"the resumed run trained {len(got)} steps, {min(got)}..{max(got)}, expected "
                          f"{stopped + 1}..{last}: it must number its steps on from the checkpoint's and "
                          "stop at --steps, as the uninterrupted run does.")
    per_epoch = u["steps_per_epoch"]
    by_samples = {tuple(step["samples"]): s for s, step in ref.items()}
    for s in range(stopped + 1, last + 1):
        if got[s]["samples"] == ref[s]["samples"]:
            continue
        epoch, place = divmod(s - 1, per_epoch)
        j = by_samples.get(tuple(got[s]["samples"]))
        said = f"resumed step {s} (batch {place} of epoch {epoch})"
        if j is None:
            raise CheckFailed(
                f"{said} trained a set of samples that no step of the uninterrupted run trained together: "
                "a different shuffle or a different split of the epoch over the ranks. Keep the sampler as "
                "given (shuffle=True, seed=0, drop_last=True), call set_epoch(epoch) before each epoch, and "
                "let each rank take global_batch // WORLD_SIZE samples per step.")
        j_epoch, j_place = divmod(j - 1, per_epoch)
        if j < s:
            again = f"the samples of step {j} trained twice"
        else:
            again = f"the samples of step {s}{f'..{j - 1}' if j - 1 > s else ''} never trained"
        if j_place == place:
            raise CheckFailed(
                f"{said} trained the samples of step {j}, batch {j_place} of epoch {j_epoch}: the right "
                f"place in the epoch but the wrong epoch's shuffle ({again}). set_epoch must get the epoch "
                "the checkpoint was in: epoch = step // steps_per_epoch, where an epoch is "
                f"{per_epoch} global steps on any number of ranks while the global batch is fixed.")
        if j_epoch == epoch:
            off = abs(place - j_place)
            raise CheckFailed(
                f"{said} trained the samples of step {j}, batch {j_place} of the same epoch: the right epoch "
                f"but {off} batch{'es' if off > 1 else ''} off ({again}). skip = step % steps_per_epoch "
                "batches of THIS rank's loader: with the global batch fixed, one batch of each rank's "
                "loader is one global step on any number of ranks.")
        raise CheckFailed(
            f"{said} trained the samples of step {j}, batch {j_place} of epoch {j_epoch}: both the epoch and "
            f"the batches to skip are off ({again}). epoch, skip = divmod(step, steps_per_epoch), "
            "with `step` counted in global steps.")


def _check_lr_schedule(u: dict, f: dict, r: dict, stopped: int, last: int) -> None:
    ref, got = u["trained"], r["trained"]
    for s in range(stopped + 1, last + 1):
        if _same_lr(got[s]["lr"], ref[s]["lr"]):
            continue
        ratio = got[s]["lr"] / ref[s]["lr"]
        old, new = f["world_size"], r["world_size"]
        if s == stopped + 1 and (_same_lr(ratio, new / old) or _same_lr(ratio, old / new)):
            raise CheckFailed(
                f"learning rate rescaled at the resume: the first step on {_ranks(new)} used lr "
                f"{got[s]['lr']:g}, the uninterrupted run {ref[s]['lr']:g} ({ratio:g} x, the ratio of the "
                "world sizes). The global batch did not change, so neither does the lr: keep what the "
                "restored optimizer and scheduler hold.")
        if s == stopped + 1:
            raise CheckFailed(
                f"the first resumed step used lr {got[s]['lr']:g}, the uninterrupted run {ref[s]['lr']:g}: "
                "restore the optimizer's state (the lr lives in its param_groups) and the scheduler's, "
                "and leave them as they were saved.")
        raise CheckFailed(
            f"the learning-rate schedule is off from step {s} on (lr {got[s]['lr']:g}, uninterrupted "
            f"{ref[s]['lr']:g}), although the first resumed step's lr was right: the scheduler was not "
            "restored, so it counts its steps from 0 again and decays at the wrong steps. Save "
            "scheduler.state_dict() and load it with scheduler.load_state_dict(...).")


def _check_uneven_refused(uneven, global_batch: int) -> None:
    """A world size that does not divide the global batch cannot train the same steps: refused."""
    n = uneven.nproc
    if global_batch % n == 0:
        raise CheckFailed(f"the run meant to be refused ran on {n} ranks, which divide --global-batch "
                          f"{global_batch}: launch it on a number of ranks that does not.")
    if uneven.ok:
        batch = uneven.reports.get(0, {}).get("batch_size")
        raise CheckFailed(f"the job ran on {n} ranks with --global-batch {global_batch}, which does not split "
                          f"into {n} equal per-rank batches" + (f" (each rank took {batch}, so a step was "
                          f"{batch * n} samples)" if batch else "") + ": its steps are not the steps of the "
                          "run it should continue, yet it trained them silently.")


def check_resharded_resume(uninterrupted: dict, first_part: dict, resumed: dict, global_batch: int,
                           lr: float, uneven=None) -> None:
    """A run checkpointed on one number of ranks and resumed on another must train, step by
    step, exactly the samples and with exactly the learning rate of the uninterrupted run.

    Each argument is a launch's ``.reports`` ({rank: report}) of the chapter's worker:
    ``uninterrupted`` ran every step on the first world size, ``first_part`` the same up to
    its --stop-at step (and saved a checkpoint), ``resumed`` the rest on another world size.
    ``uneven`` (a launch's result, optional) ran on a number of ranks that does not divide
    ``global_batch``: it must have been refused. Samples, learning rates, step numbers and the
    restored state are compared exactly. The final parameters are not: the two world sizes add the same gradients in another order,
    so they agree only up to rounding; the check prints how far apart they are.
    """
    u = _report(uninterrupted, "uninterrupted")
    f = _report(first_part, "first-part")
    r = _report(resumed, "resumed")
    old, new = f["world_size"], r["world_size"]
    if u["world_size"] != old:
        raise CheckFailed(f"the uninterrupted run ran on {u['world_size']} ranks and the first part on "
                          f"{old}: launch both with the same nproc, so that the first part is the "
                          "uninterrupted run cut short.")
    if new == old:
        raise CheckFailed(f"the resumed run ran on {new} ranks, as the first part did: this exercise resumes "
                          "on another world size; launch it with another nproc.")
    for report, name in ((u, "uninterrupted"), (f, "first-part"), (r, "resumed")):
        _check_global_batch(report, name, global_batch, old)
    _check_lr(u, lr, global_batch)

    stopped, last = max(f["trained"]), max(u["trained"])
    for s, step in sorted(f["trained"].items()):
        if s not in u["trained"] or step["samples"] != u["trained"][s]["samples"] \
                or not _same_lr(step["lr"], u["trained"][s]["lr"]):
            raise CheckFailed(f"the first part's step {s} differs from the uninterrupted run's, although "
                              f"both ran on {old} ranks: launch them with the same arguments, --stop-at "
                              "aside, and delete the checkpoint before the first part (it must start from "
                              "step 0).")
    _check_position(u, f, r, stopped)
    _check_restored_state(f, r, stopped)
    _check_samples(u, r, stopped, last)
    _check_lr_schedule(u, f, r, stopped, last)
    if uneven is not None:
        _check_uneven_refused(uneven, global_batch)

    # The parameters, for information only. Both runs sum the same `global_batch` per-sample
    # gradients with the same lr in every step, but in another order: on `old` ranks each rank
    # takes the mean of its share and DDP averages the `old` means, on `new` ranks the shares
    # differ (and so does the split of each convolution's sums over threads). Float addition is
    # not associative, so the last bits differ, and SGD carries them on. Any bound on that gap
    # would depend on the model's conditioning, so it is printed, not asserted.
    gap, where = largest_difference(u["params"], r["params"])
    moved, _ = largest_difference(r["params"], f["params"])
    print(f"final parameters: largest difference from the uninterrupted run {gap:.1e} (in {where}), while "
          f"the {last - stopped} resumed steps changed them by up to {moved:.1e}. Not zero: {old} x "
          f"{global_batch // old} samples and {new} x {global_batch // new} add the same gradients in "
          "another order, and float addition rounds differently in each order.")
    passed(f"checkpointed after step {stopped} on {_ranks(old)}, resumed on {new}: every step trained "
           f"exactly the samples of the uninterrupted run, {global_batch} per step, with the same learning "
           "rate and step numbers; the state was restored bit for bit")
