"""Exercise checks for chapter 10: profiling and debugging.

``check_exposed_share`` grades a function that reads one rank's Chrome trace (its
``traceEvents``) and returns the share of the communication time that backward did NOT
hide. ``check_hang_diagnosis`` grades a function that reads the dumps of a hung job
(each rank's flight recorder and main-thread stack) and names the rank that holds the
job up, the collective the others wait in, and where the stuck rank is.

Both first run the learner's function on small deterministic cases built here, in which
each classic wrong reading gives its own wrong answer (so the message can name it), then
on the real traces or dumps of the notebook's own run.
"""

from __future__ import annotations

from ._common import CheckFailed, passed

COMM_PREFIX = "gloo:"                                   # the work itself, on gloo's threads
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"  # one backward node, on the autograd thread


# --- the reference readings (private: the notebook teaches its own) ---

def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a, b) -> float:
    """Length of the intersection of two unions of intervals."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def _spans(events, prefix):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["name"].startswith(prefix)]


def _exposed(events, comm=COMM_PREFIX, backward=BACKWARD_PREFIX, merge=True, complement=True) -> float:
    """Reference (merge=True, complement=True) and the wrong readings the check recognises."""
    comm_spans, backward_spans = _spans(events, comm), _union(_spans(events, backward))
    if merge:
        comm_spans = _union(comm_spans)
        hidden, total = _overlap(comm_spans, backward_spans), _length(comm_spans)
    else:  # every event on its own: two gloo threads working at once count twice
        hidden = sum(_overlap([s], backward_spans) for s in comm_spans)
        total = _length(comm_spans)
    if total == 0:
        return float("nan")
    return 1 - hidden / total if complement else hidden / total


def _x(name, start, end, tid):
    return {"ph": "X", "name": name, "ts": float(start), "dur": float(end - start), "tid": tid, "pid": 1}


def synthetic_trace() -> list:
    """One DDP step, times in microseconds: what the chapter's traces hold, small enough to
    check by hand. Backward computes from 10 to 30; gloo's two threads all-reduce two buckets
    from 16 to 26 and from 20 to 34 (together 16 to 34: 18 us, of which 14 inside backward)."""
    main, autograd_events = 100, [(10, 14, "NllLossBackward0"), (14, 22, "AddmmBackward0"),
                                  (22, 30, "ConvolutionBackward0")]
    events = [_x("ProfilerStep#3", 0, 40, main), _x("forward", 0, 10, main), _x("aten::conv2d", 1, 6, main),
              _x("backward", 10, 35, main)]  # the record_function range: DDP waits for its buckets in it
    for start, end, node in autograd_events:
        events.append(_x(f"{BACKWARD_PREFIX} {node}", start, end, main))
        events.append(_x("aten::" + node.lower().replace("backward0", "_backward"), start + 0.5, end - 0.5, main))
    events += [_x("c10d::allreduce_", 15, 15.5, main), _x("c10d::allreduce_", 33, 33.5, main),
               _x("gloo:all_reduce", 16, 26, 201), _x("gloo:all_reduce", 20, 34, 202),
               _x("optimizer", 36, 40, main), {"ph": "i", "name": "marker", "ts": 12.0, "tid": main, "pid": 1}]
    return events


def check_exposed_share(exposed_share, traces: dict | None = None) -> None:
    """``exposed_share(events)`` -> the exposed share of communication in one rank's trace.

    ``traces`` maps a name to a list of trace events (a trace's ``traceEvents``); a name that
    starts with ``by_hand`` is a run that all-reduced after backward (its share must be 1).
    """
    events = synthetic_trace()
    got = float(exposed_share(events))
    expected = _exposed(events)
    if abs(got - expected) > 1e-9:
        wrong = {
            "overlapped": _exposed(events, complement=False),
            "enqueue": _exposed(events, comm="c10d::allreduce_"),
            "summed": _exposed(events, merge=False),
            "backward range": _exposed(events, backward="backward"),
        }
        hints = {
            "overlapped": "that is the share backward HID (the overlapped share); the exposed share is what is "
                          "left: 1 - overlapped / communication time",
            "enqueue": "you measured the c10d::allreduce_ events: they only mark the main thread handing a "
                       "tensor to gloo (microseconds). The all-reduce itself runs on gloo's own threads as "
                       "gloo:all_reduce events; measure those",
            "summed": "you added up the durations of the gloo:all_reduce events one by one: gloo has two worker "
                      "threads, and where two buckets are in flight at once that time is counted twice. Take "
                      "the union of the communication intervals first (merge overlapping ones), then intersect",
            "backward range": "you intersected the communication with a range that contains it: the "
                              "record_function range named 'backward' (under DDP it ends only after DDP has waited "
                              "for the last bucket) or the whole step (ProfilerStep), so nothing looks exposed. Use "
                              f"the autograd engine's events ('{BACKWARD_PREFIX} ...'): the time backward really "
                              "computes",
        }
        for name, value in wrong.items():
            if abs(got - value) <= 1e-9:
                raise CheckFailed(f"exposed share {got:.4f} on the check's small trace, expected {expected:.4f}: "
                                  f"{hints[name]}.")
        raise CheckFailed(f"exposed share {got:.4f} on the check's small trace (one step: backward computes "
                          f"from 10 to 30 us, gloo all-reduces from 16 to 26 and from 20 to 34 on two threads), "
                          f"expected {expected:.4f} = (18 - 14) / 18")
    small = expected
    for name, trace in (traces or {}).items():
        got, expected = float(exposed_share(trace)), _exposed(trace)
        if name.startswith("by_hand") and expected != 1.0:
            raise CheckFailed(f"the reference itself finds overlap in {name}: the trace is not of the by-hand run")
        if abs(got - expected) > 1e-9:
            raise CheckFailed(f"{name}: exposed share {got:.4f}, expected {expected:.4f} (right on the small trace, "
                              "wrong on the real one: are you filtering on ph == 'X' and using ts + dur?)")
    passed(f"exposed communication share right on the check's trace ({small:.3f})"
           + (f" and on {len(traces)} real trace(s)" if traces else ""))


# --- hang dumps ---

def _last_seq(dump, group="0") -> int:
    seqs = [e["collective_seq_id"] for e in dump["fr"]["entries"] if e["process_group"][0] == group]
    return max(seqs) if seqs else 0


def _frames(stack: str) -> list[str]:
    """Function names of a py-spy style stack, innermost first."""
    return [line.strip().split(" (")[0] for line in stack.splitlines()[1:] if line.strip()]


def _diagnose(dumps: dict) -> dict:
    last = {rank: _last_seq(dump) for rank, dump in dumps.items()}
    culprit = min(last, key=lambda r: (last[r], r))
    seq = last[culprit] + 1
    op = next(e["profiling_name"] for d in dumps.values() for e in d["fr"]["entries"]
              if e["collective_seq_id"] == seq and e["process_group"][0] == "0")
    return {"rank": culprit, "seq": seq, "op": op, "stuck_in": _frames(dumps[culprit]["stack"])[0]}


def _entry(seq, size, record):
    return {"record_id": record, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "gloo:all_reduce" if size else "gloo:barrier",
            "input_sizes": [[size]] if size else [], "state": "scheduled", "retired": True, "is_p2p": False}


def synthetic_dumps(buffer_size: int | None = None) -> dict:
    """Four ranks of a job whose rank 2 got stuck reading its data after collective 30; ranks
    0 and 1 have started two more all-reduces (DDP's buckets), rank 3 one. ``buffer_size``:
    each flight recorder keeps only its newest entries, as TORCH_FR_BUFFER_SIZE does."""
    sizes = [1181066, 18816, 1]
    waiting = "\n".join(['Thread {pid} "MainThread"', "    wait (distributed_c10d.py:3100)",
                         "    all_reduce (distributed_c10d.py:3913)", "    train_step (job.py:58)",
                         "    main (job.py:90)", "    <module> (job.py:97)"])
    stuck = "\n".join(['Thread {pid} "MainThread"', "    read_shard (job.py:31)", "    next_batch (job.py:44)",
                       "    main (job.py:86)", "    <module> (job.py:97)"])
    dumps = {}
    for rank, last in {0: 32, 1: 32, 2: 30, 3: 31}.items():
        entries = [_entry(seq, sizes[(seq - 1) % 3], seq - 1) for seq in range(1, last + 1)]
        if buffer_size:
            entries = entries[-buffer_size:]
        dumps[rank] = {"rank": rank, "fr": {"entries": entries, "pg_status": {}},
                       "stack": (stuck if rank == 2 else waiting).format(pid=4000 + rank)}
    return dumps


def _answer(got) -> dict:
    if not isinstance(got, dict) or not {"rank", "seq", "op", "stuck_in"} <= set(got):
        raise CheckFailed(f"diagnose() returned {got!r}: return a dict with keys 'rank', 'seq', 'op' and 'stuck_in'")
    return got


def check_hang_diagnosis(diagnose, dumps: dict | None = None) -> None:
    """``diagnose(dumps)`` -> {"rank", "seq", "op", "stuck_in"} for the dumps of a hung job.

    Runs it on the check's own four-rank dumps (first with whole flight recorders, then with
    wrapped ones) and then on ``dumps``, the real dumps of the notebook's hung job.
    """
    cases = [("the check's 4-rank dumps", synthetic_dumps()),
             ("the check's 4-rank dumps with TORCH_FR_BUFFER_SIZE=8", synthetic_dumps(buffer_size=8))]
    if dumps:
        cases.append(("your job's dumps", dumps))
    for name, case in cases:
        try:
            got = _answer(diagnose(case))
        except CheckFailed:
            raise
        except Exception as error:
            raise CheckFailed(
                f"{name}: diagnose() raised {type(error).__name__}: {error}. A collective looked up by a "
                "collective_seq_id that no rank recorded usually means the rank or the seq is wrong: the stuck "
                "rank is the one whose last collective_seq_id is the lowest (not the one with the fewest entries, "
                "so no counting entries: the recorder keeps only the newest TORCH_FR_BUFFER_SIZE), and the others "
                "wait in the next one.") from error
        expected = _diagnose(case)
        last = {rank: _last_seq(d) for rank, d in case.items()}
        culprit, counts = expected["rank"], {r: len(d["fr"]["entries"]) for r, d in case.items()}
        if got["rank"] != culprit:
            if len(set(counts.values())) == 1:
                raise CheckFailed(
                    f"{name}: you named rank {got['rank']}, but every rank's flight recorder holds "
                    f"{counts[culprit]} entries: it keeps only the newest TORCH_FR_BUFFER_SIZE, so counting entries "
                    "(or reading positions in the list) says nothing. Compare collective_seq_id, the number of "
                    "the collective within its process group.")
            if last.get(got["rank"], -1) > last[culprit]:
                raise CheckFailed(
                    f"{name}: rank {got['rank']} entered collective {last[got['rank']]} and is waiting there; it is a "
                    "victim, not the cause (its timeout error is only the echo). The rank that holds the job up is "
                    f"the one whose last collective_seq_id is the lowest: rank {culprit} stopped at {last[culprit]}.")
            raise CheckFailed(f"{name}: you named rank {got['rank']}; look for the rank whose last collective_seq_id "
                              "is the lowest (the others entered collectives it never reached)")
        if got["seq"] != expected["seq"]:
            if got["seq"] == last[culprit]:
                raise CheckFailed(
                    f"{name}: collective {got['seq']} is the last one rank {culprit} entered, and it completed on "
                    f"every rank. The others are waiting in the NEXT one, {expected['seq']}, which rank {culprit} "
                    "never reached.")
            if got["seq"] == max(last.values()):
                raise CheckFailed(
                    f"{name}: collective {got['seq']} is the newest one a waiting rank launched (DDP launches each "
                    f"bucket's all-reduce without waiting), not the first one that cannot finish: that is "
                    f"{expected['seq']}, the first rank {culprit} never entered.")
            raise CheckFailed(f"{name}: seq {got['seq']}, expected {expected['seq']}: one past the stuck rank's last "
                              "collective_seq_id")
        if got["op"] != expected["op"]:
            raise CheckFailed(f"{name}: op {got['op']!r}: give the profiling_name of collective {expected['seq']} "
                              f"as the waiting ranks recorded it ({expected['op']!r})")
        if got["stuck_in"] != expected["stuck_in"]:
            frames = _frames(case[culprit]["stack"])
            if got["stuck_in"] == frames[-1]:
                raise CheckFailed(f"{name}: {got['stuck_in']!r} is the OUTERMOST frame of rank {culprit}'s stack. "
                                  "py-spy dump (and this dump) print the innermost call first: the first line "
                                  "under the thread's name is where it is stuck.")
            if any(got["stuck_in"] in _frames(d["stack"]) for r, d in case.items() if r != culprit):
                raise CheckFailed(f"{name}: {got['stuck_in']!r} comes from a waiting rank's stack; read the stack "
                                  f"of the stuck rank {culprit}.")
            raise CheckFailed(f"{name}: stuck_in {got['stuck_in']!r}, expected {expected['stuck_in']!r}: the "
                              f"function name on the first line under rank {culprit}'s thread name")
    answer = _diagnose(dumps) if dumps else _diagnose(cases[0][1])
    passed(f"diagnosis right on {len(cases)} sets of dumps (yours: rank {answer['rank']} stuck in "
           f"{answer['stuck_in']}, the others wait in collective {answer['seq']}, {answer['op']})")
