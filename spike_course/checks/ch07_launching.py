"""Exercise checks for chapter 07: launching at scale (resuming on another number of ranks)."""

from __future__ import annotations

import math

from ._common import CheckFailed, Mistake, largest_difference, name_the_first, passed

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


class _Resume:
    """The three runs' reports (rank 0's): uninterrupted ``u``, first part ``f``, resumed ``r``;
    the world sizes, the step the first part stopped after and the last step."""

    def __init__(self, u: dict, f: dict, r: dict, global_batch: int, lr: float):
        self.u, self.f, self.r, self.global_batch, self.lr = u, f, r, global_batch, lr
        self.old, self.new = f["world_size"], r["world_size"]
        self.stopped, self.last = max(f["trained"]), max(u["trained"])

    @property
    def first_lr(self) -> float:
        return self.u["trained"][min(self.u["trained"])]["lr"]

    @property
    def first_part_differs(self) -> int | None:
        """The first step of the first part that differs from the uninterrupted run's, or None."""
        u = self.u["trained"]
        return next((s for s, step in sorted(self.f["trained"].items())
                     if s not in u or step["samples"] != u[s]["samples"] or not _same_lr(step["lr"], u[s]["lr"])),
                    None)

    @property
    def unit(self) -> str:
        return ("The position was counted in a unit that depends on the world size (the samples or batches of ONE "
                f"rank, of {self.u['batch_size']} samples on {self.old} ranks) and read back with another. Store a "
                "position that means the same on any number of ranks: the samples seen by all ranks together "
                "(step x global batch), or the global step, which is the same thing while the global batch is "
                "fixed.")

    @property
    def other_params(self) -> str | None:
        """The first parameter the resumed run started with that is not the first part's saved one."""
        import torch

        return next((name for name, saved in self.f["params"].items()
                     if not torch.equal(self.r["start"]["params"][name], saved)), None)

    @property
    def momentum_restored(self) -> bool:
        import torch

        saved, loaded = self.f["momentum"], self.r["start"]["momentum"]
        return saved.keys() == loaded.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)

    @property
    def misnumbered(self) -> bool:
        got = self.r["trained"]
        return (any(s not in got for s in range(self.stopped + 1, self.last + 1))
                or any(s > self.last or s <= self.stopped for s in got))


# How the runs were launched (readings: the resume).
LAUNCH_MISTAKES = (
    Mistake("the first part on other ranks", lambda x: x.u["world_size"] != x.old,
            lambda x: f"the uninterrupted run ran on {x.u['world_size']} ranks and the first part on {x.old}: launch "
                      "both with the same nproc, so that the first part is the uninterrupted run cut short."),
    Mistake("resumed on the same ranks", lambda x: x.new == x.old,
            lambda x: f"the resumed run ran on {x.new} ranks, as the first part did: this exercise resumes on another "
                      "world size; launch it with another nproc."),
)


def _sizes(report: dict) -> list[int]:
    return sorted({len(step["samples"]) for step in report["trained"].values()})


# A run whose steps did not train the global batch (readings: its report, its name, the resume).
BATCH_MISTAKES = (
    Mistake("per-rank batch kept",
            lambda report, name, x: x.old != report["world_size"]
            and _sizes(report)[-1] == x.global_batch // x.old * report["world_size"],
            lambda report, name, x: f"per-rank batch kept when the world size changed: the first part ran {x.old} "
                                    f"ranks x {x.global_batch // x.old} = {x.global_batch} samples per step, the "
                                    f"{name} run {report['world_size']} x {report['batch_size']} = "
                                    f"{_sizes(report)[-1]}. The global batch is what changed, and it is a "
                                    "hyperparameter: each step averages the gradient over other samples (and over more "
                                    "or fewer of them), the learning rate was tuned for "
                                    f"{x.global_batch}, and an epoch has another number of steps. Derive the per-rank "
                                    "batch from the global one: batch_size = global_batch // WORLD_SIZE."),
    Mistake("the global batch on every rank",
            lambda report, name, x: _sizes(report)[-1] == x.global_batch * report["world_size"],
            lambda report, name, x: f"each of the {report['world_size']} ranks of the {name} run took --global-batch "
                                    f"= {x.global_batch} samples, so a step trained {_sizes(report)[-1]}: the global "
                                    "batch is the number of samples of ALL ranks together. batch_size = global_batch "
                                    "// WORLD_SIZE."),
)

# The first step's learning rate, against --lr (readings: the resume).
LR_MISTAKES = (
    Mistake("lr scaled with the world size",
            lambda x: x.u["world_size"] > 1 and _same_lr(x.first_lr, x.lr * x.u["world_size"]),
            lambda x: f"learning rate scaled with the number of ranks: the run on {x.u['world_size']} ranks started "
                      f"with lr {x.first_lr:g} = {x.u['world_size']} x --lr {x.lr:g}, although its global batch is "
                      f"{x.global_batch}, the batch --lr was tuned for. The linear scaling rule scales the lr with "
                      "the GLOBAL batch; when only WORLD_SIZE changes and the global batch stays, the lr stays: lr = "
                      "args.lr."),
    Mistake("lr divided by the world size",
            lambda x: x.u["world_size"] > 1 and _same_lr(x.first_lr, x.lr / x.u["world_size"]),
            lambda x: f"learning rate divided by the number of ranks: the run on {x.u['world_size']} ranks started "
                      f"with lr {x.first_lr:g} = --lr {x.lr:g} / {x.u['world_size']}. DDP already averages the "
                      "gradients over the ranks; with the global batch that --lr was tuned for, use lr = args.lr."),
)

FIRST_PART_DIFFERS = Mistake(
    "the first part differs", lambda x: x.first_part_differs is not None,
    lambda x: f"the first part's step {x.first_part_differs} differs from the uninterrupted run's, although both ran "
              f"on {x.old} ranks: launch them with the same arguments, --stop-at aside, and delete the checkpoint "
              "before the first part (it must start from step 0).")

# Where the resumed run continued, and what it started from (readings: the resume).
RESUME_MISTAKES = (
    Mistake("started from step 0", lambda x: x.r["resumed_from"] == 0 != x.stopped,
            lambda x: f"the resumed run started from step 0 although the first part saved a checkpoint after step "
                      f"{x.stopped}: pass it the same --ckpt, and set `step` (and epoch, skip) from the checkpoint."),
    Mistake("steps trained twice", lambda x: x.r["resumed_from"] < x.stopped,
            lambda x: f"the resumed run on {_ranks(x.new)} continued after step {x.r['resumed_from']}, but the "
                      f"checkpoint was taken after step {x.stopped} on {x.old}: steps "
                      f"{x.r['resumed_from'] + 1}..{x.stopped} are trained twice, their samples seen again. {x.unit}"),
    Mistake("steps lost", lambda x: x.r["resumed_from"] > x.stopped,
            lambda x: f"the resumed run on {_ranks(x.new)} continued after step {x.r['resumed_from']}, but the "
                      f"checkpoint was taken after step {x.stopped} on {x.old}: the samples of steps "
                      f"{x.stopped + 1}..{x.r['resumed_from']} are never trained. {x.unit}"),
    Mistake("model not restored", lambda x: x.other_params is not None,
            lambda x: f"the resumed run did not start from the saved model: its {x.other_params} differs from the "
                      f"first part's after step {x.stopped}. Load the checkpoint's model state into the model before "
                      "training (model.load_state_dict(state['model']))."),
    Mistake("optimizer state not restored", lambda x: not x.momentum_restored,
            "the resumed run did not start with the saved optimizer state: its momentum buffers are missing or "
            "differ from the first part's. Save optimizer.state_dict() and load it; SGD's momentum (Adam's "
            "moments) lives in the optimizer, not in the model."),
    Mistake("steps numbered wrong", lambda x: x.misnumbered,
            lambda x: f"the resumed run trained {len(x.r['trained'])} steps, {min(x.r['trained'])}.."
                      f"{max(x.r['trained'])}, expected {x.stopped + 1}..{x.last}: it must number its steps on from "
                      "the checkpoint's and stop at --steps, as the uninterrupted run does."),
)


class _ResumedStep:
    """Resumed step ``s`` of the resume ``x``, which trained another set of samples than the
    uninterrupted run's step s: which step of that run trained them (``j``, or None)."""

    def __init__(self, x: _Resume, s: int):
        ref, got = x.u["trained"], x.r["trained"]
        self.s, self.per_epoch = s, x.u["steps_per_epoch"]
        self.epoch, self.place = divmod(s - 1, self.per_epoch)
        self.j = {tuple(step["samples"]): t for t, step in ref.items()}.get(tuple(got[s]["samples"]))
        self.said = f"resumed step {s} (batch {self.place} of epoch {self.epoch})"
        if self.j is not None:
            self.j_epoch, self.j_place = divmod(self.j - 1, self.per_epoch)

    @property
    def again(self) -> str:
        if self.j < self.s:
            return f"the samples of step {self.j} trained twice"
        return f"the samples of step {self.s}{f'..{self.j - 1}' if self.j - 1 > self.s else ''} never trained"


# The samples a resumed step trained instead of its own (readings: the step).
SAMPLE_MISTAKES = (
    Mistake("another shuffle or split", lambda t: t.j is None,
            lambda t: f"{t.said} trained a set of samples that no step of the uninterrupted run trained together: a "
                      "different shuffle or a different split of the epoch over the ranks. Keep the sampler as given "
                      "(shuffle=True, seed=0, drop_last=True), call set_epoch(epoch) before each epoch, and let each "
                      "rank take global_batch // WORLD_SIZE samples per step."),
    Mistake("the wrong epoch's shuffle", lambda t: t.j_place == t.place,
            lambda t: f"{t.said} trained the samples of step {t.j}, batch {t.j_place} of epoch {t.j_epoch}: the right "
                      f"place in the epoch but the wrong epoch's shuffle ({t.again}). set_epoch must get the epoch the "
                      f"checkpoint was in, counted in global steps: an epoch is {t.per_epoch} global steps on any "
                      "number of ranks while the global batch is fixed (Hint 1)."),
    Mistake("batches to skip off", lambda t: t.j_epoch == t.epoch,
            lambda t: f"{t.said} trained the samples of step {t.j}, batch {t.j_place} of the same epoch: the right "
                      f"epoch but {abs(t.place - t.j_place)} batch{'es' if abs(t.place - t.j_place) > 1 else ''} off "
                      f"({t.again}). The batches to skip are counted in THIS rank's loader: with the global batch "
                      "fixed, one batch of each rank's loader is one global step on any number of ranks (Hint 1)."),
    Mistake("epoch and skip off", lambda t: True,
            lambda t: f"{t.said} trained the samples of step {t.j}, batch {t.j_place} of epoch {t.j_epoch}: both the "
                      f"epoch and the batches to skip are off ({t.again}): both follow from the global step, "
                      "counted in global steps, and the steps of an epoch (Hint 1)."),
)


def _lr_ratio(x: _Resume, s: int) -> float:
    return x.r["trained"][s]["lr"] / x.u["trained"][s]["lr"]


# A resumed step's learning rate that is not the uninterrupted run's (readings: the resume, the step).
LR_SCHEDULE_MISTAKES = (
    Mistake("lr rescaled at the resume",
            lambda x, s: s == x.stopped + 1 and (_same_lr(_lr_ratio(x, s), x.new / x.old)
                                                  or _same_lr(_lr_ratio(x, s), x.old / x.new)),
            lambda x, s: f"learning rate rescaled at the resume: the first step on {_ranks(x.new)} used lr "
                         f"{x.r['trained'][s]['lr']:g}, the uninterrupted run {x.u['trained'][s]['lr']:g} "
                         f"({_lr_ratio(x, s):g} x, the ratio of the world sizes). The global batch did not change, so "
                         "neither does the lr: keep what the restored optimizer and scheduler hold."),
    Mistake("the optimizer's lr not restored", lambda x, s: s == x.stopped + 1,
            lambda x, s: f"the first resumed step used lr {x.r['trained'][s]['lr']:g}, the uninterrupted run "
                         f"{x.u['trained'][s]['lr']:g}: restore the optimizer's state (the lr lives in its "
                         "param_groups) and the scheduler's, and leave them as they were saved."),
    Mistake("scheduler not restored", lambda x, s: True,
            lambda x, s: f"the learning-rate schedule is off from step {s} on (lr {x.r['trained'][s]['lr']:g}, "
                         f"uninterrupted {x.u['trained'][s]['lr']:g}), although the first resumed step's lr was "
                         "right: the scheduler was not restored, so it counts its steps from 0 again and decays at the "
                         "wrong steps. Save scheduler.state_dict() and load it with scheduler.load_state_dict(...)."),
)

# A world size that does not divide the global batch cannot train the same steps: refused.
def _not_refused(uneven, global_batch) -> str:
    batch = uneven.reports.get(0, {}).get("batch_size")
    took = f" (each rank took {batch}, so a step was {batch * uneven.nproc} samples)" if batch else ""
    return (f"the job ran on {uneven.nproc} ranks with --global-batch {global_batch}, which does not split into "
            f"{uneven.nproc} equal per-rank batches{took}: its steps are not the steps of the run it should continue, "
            "yet it trained them silently.")


UNEVEN_NOT_REFUSED = Mistake("a world size that does not divide the global batch not refused",
                             lambda uneven, global_batch: uneven.ok, _not_refused)


def _check_global_batch(report: dict, name: str, x: _Resume) -> None:
    sizes = _sizes(report)
    if sizes == [x.global_batch]:
        return
    name_the_first(BATCH_MISTAKES, report, name, x)
    raise CheckFailed(
        f"the steps of the {name} run trained {'/'.join(map(str, sizes))} samples on {report['world_size']} ranks "
        f"(per-rank batch {report['batch_size']}), not --global-batch = {x.global_batch}: the per-rank batch times "
        "WORLD_SIZE must be the global batch, batch_size = global_batch // WORLD_SIZE.")


def _check_lr(x: _Resume) -> None:
    if _same_lr(x.first_lr, x.lr):
        return
    name_the_first(LR_MISTAKES, x)
    raise CheckFailed(f"the first step used lr {x.first_lr:g}, not --lr {x.lr:g}: with the global batch that --lr "
                      "was tuned for, the run uses lr = args.lr.")


def _check_resumed_steps(x: _Resume) -> None:
    """Each resumed step trained the uninterrupted run's samples, with its learning rate."""
    for s in range(x.stopped + 1, x.last + 1):
        if x.r["trained"][s]["samples"] != x.u["trained"][s]["samples"]:
            name_the_first(SAMPLE_MISTAKES, _ResumedStep(x, s))
    for s in range(x.stopped + 1, x.last + 1):
        if not _same_lr(x.r["trained"][s]["lr"], x.u["trained"][s]["lr"]):
            name_the_first(LR_SCHEDULE_MISTAKES, x, s)


def _check_uneven_refused(uneven, global_batch: int) -> None:
    """A world size that does not divide the global batch cannot train the same steps: refused."""
    if global_batch % uneven.nproc == 0:
        raise CheckFailed(f"the run meant to be refused ran on {uneven.nproc} ranks, which divide --global-batch "
                          f"{global_batch}: launch it on a number of ranks that does not.")
    name_the_first((UNEVEN_NOT_REFUSED,), uneven, global_batch)


def check_resharded_resume(uninterrupted: dict, first_part: dict, resumed: dict, global_batch: int,
                           lr: float, uneven=None) -> None:
    """A run checkpointed on one number of ranks and resumed on another must train, step by
    step, exactly the samples and with exactly the learning rate of the uninterrupted run.

    Each argument is a launch's ``.reports`` ({rank: report}) of the chapter's worker:
    ``uninterrupted`` ran every step on the first world size, ``first_part`` the same up to
    its --stop-at step (and saved a checkpoint), ``resumed`` the rest on another world size.
    ``uneven`` (a launch's result, optional) ran on a number of ranks that does not divide
    ``global_batch``: it must have been refused. Samples, learning rates, step numbers and the
    restored state are compared exactly. The final parameters are not: the two world sizes add
    the same gradients in another order, so they agree only up to rounding; the check prints how
    far apart they are.
    """
    u = _report(uninterrupted, "uninterrupted")
    f = _report(first_part, "first-part")
    r = _report(resumed, "resumed")
    x = _Resume(u, f, r, global_batch, lr)
    old, new, stopped, last = x.old, x.new, x.stopped, x.last
    name_the_first(LAUNCH_MISTAKES, x)
    for report, name in ((u, "uninterrupted"), (f, "first-part"), (r, "resumed")):
        _check_global_batch(report, name, x)
    _check_lr(x)
    name_the_first((FIRST_PART_DIFFERS,), x)
    name_the_first(RESUME_MISTAKES, x)
    _check_resumed_steps(x)
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
