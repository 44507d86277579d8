"""Exercise checks for chapter 04: pipeline parallel (GPipe by hand)."""

from __future__ import annotations

from ._common import CheckFailed, all_close, close, passed


def _scale_between(actual: dict, expected: dict) -> float:
    """The factor s that best explains actual = s * expected (least squares over all tensors)."""
    import torch

    num = sum(float((torch.as_tensor(actual[k]).double() * torch.as_tensor(expected[k]).double()).sum())
              for k in expected)
    den = sum(float(torch.as_tensor(expected[k]).double().pow(2).sum()) for k in expected)
    return num / den if den else float("nan")


def check_gpipe_schedule(events: dict, microbatches: int) -> None:
    """What each rank did, in order ("forward", "backward" of its stage; "send", "recv", ...),
    is a GPipe step over two stages: every stage runs each of the m micro-batches forward and
    backward, all forwards before the first backward, and the stages exchange activations and
    gradients (m each way)."""
    m = microbatches
    for rank, done in sorted(events.items()):
        sends = sum(e in ("send", "isend") for e in done)
        recvs = sum(e in ("recv", "irecv") for e in done)
        if not sends or not recvs:
            raise CheckFailed(f"rank {rank} {'never sent' if not sends else 'never received'} anything: the "
                              "stages did not exchange activations and gradients, so this is not a pipeline.")
        for kind in ("forward", "backward"):
            if done.count(kind) != m:
                raise CheckFailed(f"rank {rank}'s stage ran {done.count(kind)} {kind} passes for {m} "
                                  f"micro-batches: each micro-batch goes through each stage once each way.")
        if sends != m or recvs != m:
            raise CheckFailed(f"rank {rank} sent {sends} and received {recvs} tensors for {m} micro-batches: "
                              "one activation forward and one gradient back per micro-batch.")
        last_forward = max(i for i, e in enumerate(done) if e == "forward")
        if done.index("backward") < last_forward:
            raise CheckFailed(f"rank {rank} ran a backward before its last forward: that is 1F1B (or one "
                              "micro-batch at a time), not GPipe's all forwards, then all backwards.")
    passed(f"the schedule is GPipe's: on every rank {m} forwards, then {m} backwards, with {m} "
           "activations and gradients exchanged")


def check_pipeline_gradients(grads: dict, reference: dict, microbatches: int, stages: dict | None = None,
                       last_microbatch: dict | None = None, rtol: float = 1e-4, atol: float = 1e-6,
                       events: dict | None = None) -> None:
    """Check the gradients of a hand-written GPipe step against the single-process model.

    grads: parameter name -> gradient after the pipelined step (all stages merged).
    reference: name -> gradient of the single-process model's mean loss on the whole batch.
    microbatches: m, the number of micro-batches the batch was cut into.
    stages: name -> stage index, so a message can say which stage went wrong.
    last_microbatch: name -> gradient of the last micro-batch's own mean loss (optional;
        lets the check recognise "only the last micro-batch's gradient survived").
    events: rank -> what the rank did, in order (see :func:`check_gpipe_schedule`), checked
        first: right gradients from a wrong schedule, or from no pipeline at all, do not pass.
    """
    import torch

    if events is not None:
        check_gpipe_schedule(events, microbatches)

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
    if all_close(grads, reference, 1.0, rtol, atol):
        passed(f"GPipe gradients over {m} micro-batches equal the single-process gradients")
        return
    if last_microbatch is not None:
        for factor in (1.0 / m, 1.0):
            if all_close(grads, last_microbatch, factor, rtol, atol):
                raise CheckFailed(
                    "only the last micro-batch's gradient is left: gradients must accumulate over "
                    "all micro-batches. Zero them once per step (before the first forward), never "
                    "inside the micro-batch loop, and let every backward add to .grad.")
    scale = _scale_between(grads, reference)
    if m > 1 and abs(scale - m) < 1e-3 * m and all_close(grads, reference, scale, rtol, atol):
        raise CheckFailed(
            f"the gradients are {m} x too large: the micro-batch losses were not scaled by 1/m. "
            f"Each micro-batch's loss is a mean over its own samples; adding up the gradients of "
            f"{m} such means gives {m} times the gradient of the whole batch's mean. Divide each "
            f"micro-batch loss by m = {m} before its backward.")
    if m > 1 and abs(scale - 1 / m) < 1e-3 / m and all_close(grads, reference, scale, rtol, atol):
        raise CheckFailed(
            f"the gradients are {m} x too small: the 1/m scaling was applied twice (to the loss "
            f"and again to the gradients, or on both stages). Divide each micro-batch loss by m "
            f"once, on the last stage only: the earlier stage receives gradients already scaled.")
    wrong = [k for k in reference if not close(grads[k], reference[k], rtol, atol)]
    wrong_stages = sorted({stages[k] for k in wrong if k in stages})
    if stages and wrong_stages and len(wrong_stages) < len(set(stages.values())):
        part = {k: reference[k] for k in reference if stages.get(k) in wrong_stages}
        part_scale = _scale_between(grads, part)
        if m > 1 and abs(part_scale - 1 / m) < 1e-3 / m and all_close(grads, part, part_scale, rtol, atol):
            raise CheckFailed(
                f"stage {wrong_stages}'s gradients are {m} x too small while the other stage is "
                "right: the 1/m was applied again on the way back. The gradient a stage receives "
                "is already scaled (the last stage divided its loss by m): use it as it is.")
        if m > 1 and abs(part_scale - m) < 1e-3 * m and all_close(grads, part, part_scale, rtol, atol):
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
