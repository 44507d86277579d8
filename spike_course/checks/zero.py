"""Exercise checks for chapter 06: fully sharded data parallel (ZeRO-1 by hand; an FSDP2
checkpoint saved on N ranks that a job on another number of ranks resumes exactly)."""

from __future__ import annotations

import re
from pathlib import Path

from ._common import CheckFailed, close, first_failure, launch_reports, passed

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


def _check_optimizer_sharded(results: dict, total: int) -> None:
    """Each rank's optimizer keeps state for its slice only, not for the whole model."""
    world = len(results)
    for rank in sorted(results):
        held = int(results[rank]["optimizer_numel"])
        if world > 1 and held >= total:
            raise CheckFailed(
                f"rank {rank}'s optimizers kept state for {held:,} elements after their steps (measured "
                f"in the rank, whichever optimizer stepped), the whole model's {total:,}: the rank "
                f"steps the whole model, so the optimizer state is not sharded (that is plain DDP "
                f"memory). Only this rank's slice, about {total // world:,} elements, may have "
                f"optimizer state (Hint 1).")


def _check_slices_tile(results: dict, total: int) -> None:
    """The ranks' slices cover the flat parameters [0, total) once, without gaps or overlaps."""
    spans = sorted(tuple(int(i) for i in results[rank]["owned"]) for rank in sorted(results))
    position = 0
    for start, end in spans:
        if start != position or end < start:
            raise CheckFailed(
                f"the owned slices {spans} do not tile [0, {total:,}) without gaps or overlaps: "
                "rank r should own [r * shard_size, min((r + 1) * shard_size, total)).")
        position = end
    if position < total:
        raise CheckFailed(f"the owned slices {spans} stop at {position:,}, not at {total:,}: "
                          "round the shard size up (ceil(total / world_size)).")
    if position > total:  # the shard size rounded up, and the last slice not cut at the end
        raise CheckFailed(f"the owned slices {spans} stop at {position:,}, past the end of the model's "
                          f"{total:,} elements: the last slice must end where the flat parameters end (Hint 3).")


def _check_updated(r: _Rank) -> None:
    """Training changed the rank's model (when the report says where it started)."""
    if r.initial is None or not r.close(r.flat, r.initial):
        return
    if r.stepped is not None and r.close(r.stepped, r.initial[r.start:r.end]):
        raise CheckFailed(f"rank {r.rank}: the model's parameters never changed, and neither did the "
                          "slice its optimizer holds: every step saw a zero gradient (zeroed "
                          "before optimizer.step(), or never handed to the slice's .grad).")
    raise CheckFailed(f"rank {r.rank}: the model's parameters never changed: the optimizer "
                      f"stepped its own copy of the slice, but {NOT_GATHERED}")


def _check_ranks_agree(ranks: list[_Rank]) -> None:
    """Every rank ends with the same full model: the updated slices were gathered."""
    first = ranks[0]
    for r in ranks[1:]:
        if not r.close(r.flat, first.flat):
            differ = (r.flat - first.flat).abs().max().item()
            raise CheckFailed(f"ranks {first.rank} and {r.rank} end with different parameters (max "
                              f"difference {differ:.2e}): {NOT_GATHERED}")


def _check_matches_ddp(r: _Rank) -> None:
    """The rank's model is DDP's, trained on the same batches."""
    ddp = r.report["ddp"].detach().double()
    if r.close(r.flat, ddp):
        return
    error = (r.flat - ddp).abs().max().item()
    if r.close(r.flat[r.start:r.end], ddp[r.start:r.end]):
        raise CheckFailed(f"rank {r.rank}: its own slice [{r.start:,}, {r.end:,}) matches DDP but the rest of "
                          f"its model does not (max error {error:.2e}): {NOT_GATHERED}")
    raise CheckFailed(f"rank {r.rank}: the parameters differ from DDP (max error {error:.2e}). Average the "
                      "gradients over ranks (all_reduce, then divide by the world size) before the step, "
                      "and give the optimizer the gradient of its own slice.")


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
    _check_optimizer_sharded(results, total)
    _check_slices_tile(results, total)
    ranks = [_Rank(rank, results[rank], rtol, atol) for rank in sorted(results)]
    for r in ranks:
        _check_updated(r)
    _check_ranks_agree(ranks)
    for r in ranks:
        _check_matches_ddp(r)
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


def _check_samples(reports: dict, job: str, steps: range, samples: int, global_batch: int) -> None:
    """Every step of ``steps`` trained, all ranks together, exactly its global batch."""
    import torch

    per_epoch = samples // global_batch
    trained = sorted(reports[0].get("trained", {}))
    if trained != list(steps):
        raise CheckFailed(f"the {job} trained steps {trained}, not {list(steps)}: batches(start) gave too few or "
                          "too many steps, or the wrong ones (Hint 3).")
    for step in steps:
        got = sorted(torch.cat([reports[r]["trained"][step]["ids"] for r in sorted(reports)]).tolist())
        if got == _global_batch(step, samples, global_batch):
            continue
        if len(set(got)) != len(got) or len(got) != global_batch:
            raise CheckFailed(
                f"in step {step} of the {job} the ranks trained {len(got)} samples, {len(set(got))} of them "
                f"different: a step is one global batch of {global_batch} different samples, dealt out to the "
                "ranks by the sampler (Hint 1).")
        same = [t for t in range(steps.stop) if _global_batch(t, samples, global_batch) == got]
        epoch = step // per_epoch
        if same and same[0] % per_epoch == step % per_epoch:
            raise CheckFailed(
                f"step {step} of the {job} (epoch {epoch}) trained the very samples of step {same[0]} (epoch "
                f"{same[0] // per_epoch}): epoch {epoch} was dealt out in the shuffle of epoch "
                f"{same[0] // per_epoch}, not in its own (Hint 2).")
        if same and same[0] < step:
            raise CheckFailed(
                f"step {step} of the {job} trained again the samples of step {same[0]}, which were trained "
                f"already, and the samples of step {step} were skipped: the data did not continue where the "
                "checkpoint left it (Hint 1).")
        raise CheckFailed(
            f"step {step} of the {job} trained samples that are no global batch of the uninterrupted job: "
            f"its {samples} samples make {per_epoch} global batches of {global_batch} per epoch, in the "
            "sampler's shuffle of that epoch, and step s takes the next one. Where the data continues must "
            "not depend on how many ranks deal each global batch out (Hint 1).")


def _check_layout(path: Path, world: int, params: dict) -> list:
    """The checkpoint is DCP's, every rank wrote its own shards, and the optimizer state is keyed
    by name. Returns the checkpoint's keys."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not path.exists():
        raise CheckFailed(f"nothing was saved at {path}: save(step) writes the checkpoint to "
                          "args.checkpoint (Hint 2).")
    files = sorted(f.name for f in path.iterdir()) if path.is_dir() else [path.name]
    if not (path / ".metadata").is_file():
        raise CheckFailed(
            f"{path} holds {files}, no .metadata: that is not a DCP checkpoint. A file that one rank writes "
            "(torch.save) holds that rank's view only, its shards or whole tensors gathered through its "
            "memory, and nothing records how the pieces fit together: a job of another shape cannot load "
            "it piece by piece (Hint 2).")
    shards = [f for f in files if f.endswith(".distcp")]
    if len(shards) != world:
        raise CheckFailed(f"{path} holds {len(shards)} shard files for {world} ranks: the save is a collective "
                          "that every rank takes part in, each writing its own shards (Hint 2).")
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    keys = list(metadata)
    lacking = [n for n in params if not any(k == n or k.endswith("." + n) for k in keys)]
    if lacking:
        raise CheckFailed(f"the checkpoint has no entry for {len(lacking)} of the model's parameters (e.g. "
                          f"{lacking[0]!r}): it does not hold the model's state (Hint 2).")
    if any(re.search(r"\.state\.\d+\.momentum_buffer$", k) for k in keys):
        raise CheckFailed(
            "the optimizer state in the checkpoint is keyed by parameter numbers (optimizer.state_dict() "
            "numbers the parameters 0, 1, 2, ...), not by name: a number means nothing to a model built or "
            "sharded another way, so no job of another shape can match it (Hint 2).")
    if not any(k.endswith(".momentum_buffer") for k in keys):
        raise CheckFailed(
            "the checkpoint holds the model but no optimizer state: a job resumed from it restarts SGD's "
            "momentum from zero, a jolt in its training that the uninterrupted job never had (Hint 1).")
    tensors = [m for m in metadata.values() if isinstance(m, TensorStorageMetadata) and len(m.size)
               and m.size[0] >= world]
    if world > 1 and all(len(m.chunks) == 1 and tuple(m.chunks[0].sizes) == tuple(m.size) for m in tensors):
        raise CheckFailed(
            f"every tensor in the checkpoint was written as one whole piece, none as the {world} shards the "
            "ranks hold: the state was gathered whole before the save (a full state dict, or full_tensor()), "
            "so each rank held the whole model and optimizer state at once, the memory FSDP is there to "
            "avoid, and on a model that needs sharding that gather runs out of memory. DCP reshards a "
            "sharded save by itself when it loads (Hint 2).")
    return keys


def _check_loaded(resumed: dict, saved: dict, keys: list) -> None:
    """Right after resume(): everything the next step depends on, bit for bit."""
    import torch

    loaded, before = resumed["loaded"], saved["saved"]
    differ = [n for n, p in before["params"].items() if not torch.equal(loaded["params"][n], p)]
    if len(differ) == len(before["params"]):
        raise CheckFailed(
            "after resume() the model holds none of the saved weights: nothing was loaded into it. DCP loads "
            "in place, into the tensors of the dict it is given (Hint 2).")
    if differ:
        raise CheckFailed(f"after resume() {len(differ)} of {len(before['params'])} weights differ from the saved "
                          f"ones (e.g. {differ[0]}): loading copies bits, so all must be equal (Hint 2).")
    momentum = loaded["momentum"]
    if set(momentum) != set(before["momentum"]) or not any(m.any() for m in momentum.values()):
        raise CheckFailed(
            "after resume() SGD's momentum is all zeros (or missing): the model was loaded, the optimizer "
            "state was not, so the resumed job restarts its momentum from nothing (Hint 2).")
    wrong = [n for n, m in before["momentum"].items() if not torch.equal(momentum[n], m)]
    if wrong:
        raise CheckFailed(f"after resume() the momentum of {wrong[0]} (and {len(wrong) - 1} more) is not the saved "
                          "one: it must come back bit for bit (Hint 2).")
    if loaded["lr"] != before["lr"]:
        raise CheckFailed(
            f"after resume() the optimizer's learning rate is {loaded['lr']:.6g}, the saved job's was "
            f"{before['lr']:.6g}: the optimizer's hyperparameters (its param_groups) were not put back, only "
            "its tensors, so the next step runs with the fresh scheduler's first value (Hint 2).")
    if loaded["schedule_step"] != before["schedule_step"]:
        stored = [k for k in keys if k.endswith("last_epoch")]
        where = (f"the checkpoint holds it ({stored[0]}) but it never reached this job's scheduler" if stored
                 else "the checkpoint holds no learning-rate schedule")
        raise CheckFailed(
            f"after resume() the scheduler stands at step {loaded['schedule_step']}, the saved job's stood at "
            f"{before['schedule_step']}: {where}. The resumed job's learning rate would follow the schedule "
            "from its start again, warmup included (Hint 1).")


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
        rank, code, error = first_failure(saved)
        hint = (" A rank waited in a collective that another rank never entered: the save is a collective, so "
                "every rank takes part in it." if "imed out" in error else "")
        raise CheckFailed(f"the job trained, but rank {rank} failed afterwards, while saving (exit code {code}): "
                          f"{error}.{hint} The cell above shows its traceback.")
    keys = _check_layout(path, saved_world, head["saved"]["params"])

    second = launch_reports(resumed, "the resumed job")
    start = second[0].get("start")
    if start != save_at:
        raise CheckFailed(
            f"resume() returned {start!r}, the checkpoint was written after step {save_at}: the number of steps "
            "trained did not come back from the checkpoint, so the resumed job does not know where it is, in "
            "its schedule or in its data (Hint 1).")
    _check_loaded(second[0], head, keys)
    _check_samples(second, "resumed job", range(start, total), samples, global_batch)
    for step in range(start, total):
        lr, expected = second[0]["trained"][step]["lr"], head["trained"][step]["lr"]
        if lr != expected:
            raise CheckFailed(f"step {step} of the resumed job stepped with learning rate {lr:.6g}, the "
                              f"uninterrupted job's with {expected:.6g}: the schedule did not go on from where "
                              "it stood (Hint 1).")
    used = _check_continued(second[0], head, start)
    passed(f"saved on {saved_world} ranks after step {save_at}, resumed on {len(second)}: the same weights, "
           f"momentum and schedule bit for bit, the same samples and learning rates in steps {start}-{total - 1}, "
           f"and the same final weights ({used:.1%} of the rounding tolerance used)")
