"""Closed-form costs for chapter 04: pipeline parallel (bubble fraction, ideal schedules)."""

from __future__ import annotations



PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of one GPipe or 1F1B step: (p - 1) / (m + p - 1).

    With p equal stages and m micro-batches a step takes m + p - 1 "slots" per rank
    (forward plus backward of one micro-batch on one stage), of which each rank is
    busy for m: filling and draining the pipeline leaves p - 1 slots idle. 1F1B
    reorders the work (and holds fewer activations) but has the same bubble.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def _pipeline_order(schedule: str, rank: int, stages: int, microbatches: int) -> list:
    """The (phase, microbatch) actions one rank runs, in order."""
    m = microbatches
    if schedule == "gpipe":  # all forwards, then all backwards
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # 1F1B (PyTorch's Schedule1F1B): p - rank forwards to fill the pipeline, then
    # alternate one backward and one forward, then drain the remaining backwards.
    warmup = min(m, stages - rank)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(("B", backward))
        backward += 1
        if forward < m:
            order.append(("F", forward))
            forward += 1
    return order


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      t_forward=1.0, t_backward=2.0) -> list[dict]:
    """The ideal timeline of one step: every rank starts each action as soon as its
    inputs exist (free communication).

    ``t_forward``/``t_backward``: the time of one micro-batch's forward/backward on one
    stage, the same for all stages, or a list with one value per stage (rank).

    Returns event records ``{"rank", "microbatch", "phase" ("F"/"B"), "start", "end"}``,
    the same format a worker measures, so :func:`spike_course.viz.pipeline_gantt`
    draws both. Forward of micro-batch i on rank r waits for its forward on rank r-1;
    backward waits for the backward on rank r+1 (the last rank: for its own forward).
    """
    schedule = schedule.lower()
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    pipeline_bubble(stages, microbatches)  # validates the sizes
    orders = {r: _pipeline_order(schedule, r, stages, microbatches) for r in range(stages)}
    times = {}
    for phase, t in (("F", t_forward), ("B", t_backward)):
        t = list(t) if isinstance(t, (list, tuple)) else [t] * stages
        if len(t) != stages:
            raise ValueError(f"need one {phase} time per stage ({stages}), got {len(t)}")
        times[phase] = t
    done: dict = {}  # (rank, phase, microbatch) -> end time
    clock = {r: 0.0 for r in range(stages)}
    position = {r: 0 for r in range(stages)}
    events = []
    while any(position[r] < len(orders[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            if position[r] == len(orders[r]):
                continue
            phase, i = orders[r][position[r]]
            if phase == "F":
                needs = (r - 1, "F", i) if r > 0 else None
            else:
                needs = (r + 1, "B", i) if r < stages - 1 else (r, "F", i)
            if needs is not None and needs not in done:
                continue  # its input is not ready: another rank has to move first
            start = max(clock[r], done[needs] if needs else 0.0)
            end = start + times[phase][r]
            done[(r, phase, i)] = clock[r] = end
            events.append({"rank": r, "microbatch": i, "phase": phase, "start": start, "end": end})
            position[r] += 1
            progressed = True
        if not progressed:  # cannot happen for the two schedules above
            raise RuntimeError("the schedule deadlocks")
    return sorted(events, key=lambda e: (e["rank"], e["start"]))


def as_event(event) -> dict:
    """One pipeline event as a dict: dicts pass through, tuples are read in the order
    (rank, microbatch, phase, start, end), the order workers print them in."""
    if isinstance(event, dict):
        return event
    rank, microbatch, phase, start, end = event[:5]
    return {"rank": rank, "microbatch": microbatch, "phase": phase, "start": start, "end": end}


def pipeline_idle_fraction(events, per_rank: bool = False):
    """Share of the step the ranks spent waiting, from event records (measured or ideal).

    The step runs from the first start to the last end over all ranks; each rank's idle
    time is that span minus its busy time. Returns the fraction over all ranks, or a
    dict rank -> fraction with ``per_rank=True``. Comparable with :func:`pipeline_bubble`.
    """
    events = [as_event(e) for e in events]
    if not events:
        raise ValueError("no events")
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    busy: dict = {}
    for e in events:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + (e["end"] - e["start"])
    idle = {r: 1.0 - b / span for r, b in sorted(busy.items())}
    return idle if per_rank else sum(idle.values()) / len(idle)


def pipeline_peak_activations(events) -> dict:
    """Per rank, the most micro-batches whose forward has run but whose backward has not:
    the activations that rank holds at its worst moment (GPipe: m; 1F1B: at most p - rank)."""
    peaks: dict = {}
    by_rank: dict = {}
    for e in map(as_event, events):
        by_rank.setdefault(e["rank"], []).append(e)
    for r, evs in sorted(by_rank.items()):
        held = peak = 0
        for e in sorted(evs, key=lambda e: e["start"]):
            held += 1 if e["phase"] == "F" else -1 if e["phase"] == "B" else 0
            peak = max(peak, held)
        peaks[r] = peak
    return peaks
