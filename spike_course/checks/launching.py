"""Exercise checks for chapter 07: launching at scale."""

from __future__ import annotations

from ._common import CheckFailed, passed


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
