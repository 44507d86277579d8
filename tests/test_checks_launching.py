"""Chapter 07's checks name the mistake: fed wrong answers, they say which one."""

import os

import pytest
import torch

from spike_course.checks import CheckFailed, check_checkpoint_functions, check_resumed_run


def make_save(keys=("model", "optimizer", "scheduler", "epoch", "step"), atomic=True):
    def save_checkpoint(path, model, optimizer, scheduler, epoch, step):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step}
        state = {k: v for k, v in state.items() if k in keys}
        if atomic:
            tmp = f"{path}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
        else:
            torch.save(state, path)
    return save_checkpoint


def load_checkpoint(path, model, optimizer, scheduler):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    return state.get("epoch", 0), state.get("step", 0)


def test_correct_functions_pass(tmp_path, capsys):
    check_checkpoint_functions(make_save(), load_checkpoint, tmp_path)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("keys, message", [
    (("model", "scheduler", "epoch", "step"), "optimizer state not restored"),
    (("model", "optimizer", "epoch", "step"), "scheduler state not restored"),
    (("model", "optimizer", "scheduler"), "expected (epoch, step)"),
])
def test_missing_state_is_named(tmp_path, keys, message):
    with pytest.raises(CheckFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_checkpoint_functions(make_save(keys), load_checkpoint, tmp_path)


def test_model_not_loaded_is_named(tmp_path):
    def load_without_model(path, model, optimizer, scheduler):
        state = torch.load(path)
        return state["epoch"], state["step"]
    with pytest.raises(CheckFailed, match="model's weight differs"):
        check_checkpoint_functions(make_save(), load_without_model, tmp_path)


def test_non_atomic_write_is_named(tmp_path):
    with pytest.raises(CheckFailed, match="non-atomic write"):
        check_checkpoint_functions(make_save(atomic=False), load_checkpoint, tmp_path)


def test_nothing_written_is_named(tmp_path):
    with pytest.raises(CheckFailed, match="did not create"):
        check_checkpoint_functions(lambda *args: None, load_checkpoint, tmp_path)


def run(resumed_from=10, restarts=1, params=None, losses=None):
    return {"params": params or {"w": torch.ones(3)}, "resumed_from": resumed_from,
            "restarts": restarts, "losses": losses or {s: 1.0 / s for s in range(1, 21)}}


def test_resumed_run_passes_when_identical(capsys):
    check_resumed_run(run(resumed_from=0), run(), crash_at=13, ckpt_every=5)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("resumed, message", [
    (run(restarts=0), "never restarted"),
    (run(resumed_from=0), "started again from step 0"),
    (run(resumed_from=5), "resumed from step 5"),
    (run(losses={s: 1.0 / s + (s > 10) for s in range(1, 21)}), "very first step after resuming"),
    (run(losses={s: 1.0 / s + (s > 12) for s in range(1, 21)}), "optimizer state"),
    (run(losses={s: 1.0 / s for s in range(1, 15)}), "never trained steps"),
    (run(params={"w": torch.zeros(3)}), "final w differs"),
])
def test_resumed_run_mistakes_are_named(resumed, message):
    with pytest.raises(CheckFailed, match=message):
        check_resumed_run(run(resumed_from=0), resumed, crash_at=13, ckpt_every=5)
