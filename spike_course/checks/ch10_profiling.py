"""Exercise checks for chapter 10: profiling and debugging.

``check_straggler`` grades a function that reads every rank's Chrome trace of one DDP job
and finds the rank the others wait for: how late, on average, each rank arrives at the
collectives. ``check_hang_diagnosis`` grades a function that reads the dumps of a hung job
(each rank's flight recorder and main-thread stack) and names the rank that holds the job
up, the collective the others wait in, and where the stuck rank is.

Both first run the learner's function on small deterministic cases built here, in which
each classic wrong reading gives its own wrong answer (so the message can name it), then
on the real traces or dumps of the notebook's own run.
"""

from __future__ import annotations


from ._common import CheckFailed, Mistake, name_the_first, passed
from ._guard import borrowing_refused

ARRIVAL = "c10d::allreduce_"  # the call on the rank's own thread: the moment it hands over its tensor
# Lateness is a difference of two clock readings near 1.8e15 us, where a float64 is exact to
# 0.25 us: reading a time adds at most two roundings, so one difference is off by at most
# 0.5 us, whichever order a function adds base and ts in (and a mean of them no more). Two
# correct answers agree within 1 us = 0.001 ms; every wrong reading below is off by 100 us or more.
LATENESS_TOLERANCE_MS = 0.001


# --- stragglers: the reference reading (private: the notebook teaches its own) ---

def _times(trace: dict, name: str, end: bool = False, clock: bool = True) -> list[float]:
    """Start (or end) times in us of a trace's complete events called ``name`` (a prefix if it
    ends with ':'), on the machine's clock unless ``clock`` is False, in order."""
    base = trace["baseTimeNanoseconds"] / 1000 if clock else 0.0
    return sorted(base + e["ts"] + (e["dur"] if end else 0.0) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and (e["name"].startswith(name) if name.endswith(":") else e["name"] == name))


def _lateness(traces: dict, name: str = ARRIVAL, end: bool = False, clock: bool = True,
              behind: bool = True, mean: bool = True, per_ms: float = 1000.0) -> dict:
    """The reference (defaults) and the wrong readings the check recognises: for the k-th
    ``name`` event of every rank (the same collective: every rank enters them in the same
    order), how long after the first rank each rank arrived; averaged over the collectives.
    ``behind=False`` measures from the LAST arrival instead (how long each rank waited)."""
    times = {rank: _times(trace, name, end, clock) for rank, trace in traces.items()}
    count = min(len(t) for t in times.values())
    late = {rank: 0.0 for rank in times}
    for k in range(count):
        first, last = min(t[k] for t in times.values()), max(t[k] for t in times.values())
        for rank, t in times.items():
            late[rank] += (t[k] - first) if behind else (last - t[k])
    late = {rank: total / (count if mean else 1) / per_ms for rank, total in late.items()}
    return {"rank": max(late, key=lambda r: (late[r], -r)), "late_ms": late}


def _communication_ms(trace: dict) -> float:
    """Time on gloo's threads: what a rank 'spent communicating', waiting included."""
    return sum(e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("gloo:")) / 1000


def _x(name, start, end, tid, base_us):
    return {"ph": "X", "name": name, "ts": float(start - base_us), "dur": float(end - start), "tid": tid, "pid": 1}


def synthetic_traces() -> dict:
    """Four ranks of a DDP job, 3 steps of 2 buckets, times in us. Rank 2 computes about 6 ms
    slower than the others and arrives last at every all-reduce; rank 1 is about 1 ms slow.
    The ranks begin their forwards almost together (rank 3 last, 0.4 ms after rank 0):
    a rank that waited in the previous step's all-reduce starts the next step when it ends.
    Each rank's trace counts from its own base, as on separate nodes; gloo's threads pick a
    bucket up 40 us to 0.9 ms after the call, and every rank's all-reduce ends 1.5 ms after
    the last one arrived."""
    slow = {0: 0, 1: 900, 2: 6000, 3: 200}
    jitter = [[{0: 30, 1: 0, 2: 170, 3: 80}, {0: 0, 1: 260, 2: 90, 3: 40}],
              [{0: 120, 1: 60, 2: 0, 3: 10}, {0: 50, 1: 0, 2: 310, 3: 150}],
              [{0: 0, 1: 140, 2: 70, 3: 220}, {0: 90, 1: 30, 2: 0, 3: 180}]]
    pickup = {0: 40, 1: 900, 2: 60, 3: 40}  # rank 1's gloo threads are slow to start
    traces = {}
    for rank in slow:
        base_us = 1_790_857_026_000_000 + 7_000 * rank  # each node's profiler has its own base
        main, events = 100 + rank, []
        for step in range(3):
            start = 50_000 * step
            arrivals = [start + 20_000 + 10_000 * b + slow[rank] + jitter[step][b][rank] for b in range(2)]
            ends = [start + 20_000 + 10_000 * b + max(slow[r] + jitter[step][b][r] for r in slow) + 1_500
                    for b in range(2)]
            forward = start + {0: 0, 1: 50, 2: 10, 3: 400}[rank]
            events += [_x(f"ProfilerStep#{step + 2}", forward - 5, start + 48_000, main, base_us),
                       _x("forward", forward, forward + 12_000 + slow[rank], main, base_us),
                       _x("backward", forward + 12_000 + slow[rank], ends[1] + 20, main, base_us)]
            for b in range(2):
                events += [_x(ARRIVAL, arrivals[b], arrivals[b] + 30 + 150 * rank, main, base_us),
                           _x("gloo:all_reduce", arrivals[b] + pickup[rank], ends[b], 200 + b, base_us)]
            events += [_x("optimizer", ends[1] + 30, ends[1] + 900, main, base_us),
                       {"ph": "s", "name": "ac2g", "id": step, "ts": float(arrivals[0] - base_us), "tid": main, "pid": 1}]
        traces[rank] = {"baseTimeNanoseconds": base_us * 1000, "traceEvents": events}
    return traces


def _straggler_answer(got, ranks) -> dict:
    if not isinstance(got, dict) or not {"rank", "late_ms"} <= set(got) or not isinstance(got["late_ms"], dict):
        raise CheckFailed(f"find_straggler() returned {got!r}: return a dict with 'rank' (the rank the others "
                          "wait for) and 'late_ms' (a dict: rank -> its mean lateness in milliseconds)")
    if set(got["late_ms"]) != set(ranks):
        raise CheckFailed(f"late_ms has the keys {sorted(got['late_ms'])}; give one entry per rank {sorted(ranks)}, "
                          "keyed by the rank as in `traces` (the first rank to arrive is 0 ms late)")
    return got


def _same(got: dict, expected: dict, rank: bool = True) -> bool:
    """Same lateness for every rank (and, with ``rank``, the same straggler named)."""
    return (got["rank"] == expected["rank"] or not rank) and all(
        abs(float(got["late_ms"][r]) - expected["late_ms"][r]) <= LATENESS_TOLERANCE_MS for r in expected["late_ms"])


def _table(late: dict) -> str:
    return ", ".join(f"rank {r}: {ms:.3f}" for r, ms in sorted(late.items()))


def _reading(name: str, options: dict, hint: str) -> Mistake:
    """A wrong reading of the traces: seen when the answer on the check's traces (``small``) is
    what ``_lateness`` computes with ``options``; the learner is told ``hint``."""
    return Mistake(name, lambda got, small: _same(got, _lateness(small, **options), rank=False),
                   lambda got, small: f"on the check's 4-rank traces you found rank {got['rank']} "
                                      f"({_table(got['late_ms'])} ms): {hint}.")


# Each gives an answer of its own on the check's 4-rank traces, so the first that matches names it.
WRONG_READINGS = (
    _reading("waits instead of lateness", dict(behind=False),
             "that is how long each rank WAITED for the last one (last arrival - its arrival), so the "
             "rank that waits most comes out on top: a victim. Lateness counts from the FIRST arrival: "
             "its arrival - the earliest arrival at the same collective"),
    _reading("no common clock", dict(clock=False),
             "you compared ts values of different traces: each counts from its own trace's "
             "baseTimeNanoseconds (ranks on different nodes have different bases). Put every event on "
             "one clock first: baseTimeNanoseconds / 1000 + ts"),
    _reading("gloo thread starts", dict(name="gloo:"),
             "you timed the gloo:all_reduce events: they start when one of gloo's threads picks the "
             f"work up, which can be long after the call. A rank arrives when it calls: {ARRIVAL}, on "
             "its own thread"),
    _reading("gloo thread ends", dict(end=True, name="gloo:"),
             "you used when the gloo:all_reduce events END: a collective ends at about the same moment "
             "on every rank (nobody finishes before the last one arrives), so nobody looks late. Use "
             f"when each rank ARRIVES: the start of its {ARRIVAL} call"),
    _reading("call ends", dict(end=True),
             f"you used when the {ARRIVAL} calls END. DDP's call returns once gloo has the tensor, "
             "a plain dist.all_reduce only when the sum is back: neither is the arrival. Use the START "
             "of the call"),
    _reading("forward starts", dict(name="forward"),
             "you compared when the ranks START their steps (the forward range): they start "
             "almost together, because a rank that waited in the last step's all-reduce starts "
             "the next step as soon as it ends. A slow rank shows where the ranks meet: at the "
             f"collectives ({ARRIVAL})"),
    _reading("total, not mean", dict(mean=False),
             "that is each rank's lateness added up over all the collectives; give the mean per collective"),
    _reading("microseconds", dict(per_ms=1.0),
             "those are microseconds (trace times are in us); give milliseconds"),
)


# The rank that spent the longest in gloo's all-reduce is a victim, not the straggler.
LONGEST_COMMUNICATOR = Mistake(
    "the longest communicator",
    lambda got, small: got["rank"] == max(small, key=lambda rank: _communication_ms(small[rank])),
    lambda got, small: f"on the check's 4-rank traces you named rank {got['rank']}, the rank that spent the longest "
                       f"in gloo:all_reduce ({_table({r: _communication_ms(t) for r, t in small.items()})} ms). That "
                       "rank is a victim: an all-reduce lasts until the last rank arrives, so the ranks that are "
                       "early 'communicate' longest, and the straggler least. Compare when each rank arrives at "
                       f"each collective ({ARRIVAL}).")


def _check_small_traces(find_straggler) -> None:
    """Right on the check's own four ranks, where every wrong reading it knows gives an answer
    of its own (so the message can name it)."""
    small = synthetic_traces()
    got, expected = _straggler_answer(find_straggler(small), small), _lateness(small)
    if _same(got, expected):
        return
    name_the_first((*WRONG_READINGS, LONGEST_COMMUNICATOR), got, small)
    raise CheckFailed(f"on the check's 4-rank traces you found rank {got['rank']} ({_table(got['late_ms'])} ms); "
                      f"expected rank {expected['rank']} ({_table(expected['late_ms'])} ms): for the k-th "
                      f"{ARRIVAL} of every rank (the same collective), each rank's start minus the earliest "
                      "start, on one clock, averaged over the collectives")


def _check_real_traces(find_straggler, traces: dict) -> dict:
    """Right on the notebook's real traces too (an answer that fits only the check's fails);
    returns the reference's answer."""
    got, expected = _straggler_answer(find_straggler(traces), traces), _lateness(traces)
    if not _same(got, expected):
        raise CheckFailed(f"on your job's traces you found rank {got['rank']} ({_table(got['late_ms'])} ms), "
                          f"expected rank {expected['rank']} ({_table(expected['late_ms'])} ms): right on the "
                          "check's traces, wrong on real ones. Do you keep every complete event (ph == 'X') "
                          f"named {ARRIVAL}, and pair each rank's k-th one with the others' k-th?")
    return expected


def check_straggler(find_straggler, traces: dict | None = None) -> None:
    """``find_straggler(traces)`` -> {"rank": r, "late_ms": {rank: ms}}, where ``traces[rank]``
    is one rank's Chrome trace (the JSON object, with ``traceEvents`` and
    ``baseTimeNanoseconds``) of one job.

    Runs it on the check's own four-rank traces, where every wrong reading it knows gives an
    answer of its own, then on ``traces``, the notebook's real ones.
    """
    found = ""
    with borrowing_refused("find_straggler", answers=[find_straggler]):
        _check_small_traces(find_straggler)
        if traces:
            expected = _check_real_traces(find_straggler, traces)
            found = (f" and on your job's {len(traces)}: rank {expected['rank']}, "
                     f"{expected['late_ms'][expected['rank']]:.1f} ms late on average")
    passed(f"straggler found on the check's 4 ranks{found}")


# --- hang dumps ---

def _frames(stack: str) -> list[str]:
    """Function names of a py-spy style stack, innermost first."""
    return [line.strip().split(" (")[0] for line in stack.splitlines()[1:] if line.strip()]


def _lasts(dumps: dict) -> dict:
    """{(group, rank): the highest collective_seq_id the rank entered in that process group}."""
    last = {}
    for rank, dump in dumps.items():
        for entry in dump["fr"]["entries"]:
            key = (entry["process_group"][0], rank)
            last[key] = max(last.get(key, 0), entry["collective_seq_id"])
    return last


def _missing(last: dict, group: str, seq: int) -> set:
    """The ranks of ``group`` that never entered its collective ``seq``, if another rank did."""
    members = {rank: s for (g, rank), s in last.items() if g == group}
    return {rank for rank, s in members.items() if s < seq} if max(members.values()) >= seq else set()


def _diagnose(dumps: dict) -> dict:
    """The rank that waits for no one while others wait (each in the newest collective it
    entered, one that a rank of its group never entered), and the collective only it is missing."""
    last = _lasts(dumps)
    waiting = {rank for (group, rank), seq in last.items() if _missing(last, group, seq)}
    culprit = min(set(dumps) - waiting)
    group, seq = next((g, s + 1) for (g, rank), s in sorted(last.items())
                      if rank == culprit and _missing(last, g, s + 1) == {culprit})
    op = next(e["profiling_name"] for d in dumps.values() for e in d["fr"]["entries"]
              if e["collective_seq_id"] == seq and e["process_group"][0] == group)
    return {"rank": culprit, "group": group, "seq": seq, "op": op, "stuck_in": _frames(dumps[culprit]["stack"])[0]}


def _entry(seq, size, record, group=("0", "default_pg")):
    return {"record_id": record, "pg_id": int(group[0]), "process_group": group, "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "gloo:all_reduce" if size else "gloo:barrier",
            "input_sizes": [[size]] if size else [], "state": "scheduled", "retired": True, "is_p2p": False}


_WAITING_STACK = "\n".join(['Thread {pid} "MainThread"', "    wait (distributed_c10d.py:3100)",
                            "    all_reduce (distributed_c10d.py:3913)", "    train_step (job.py:58)",
                            "    main (job.py:90)", "    <module> (job.py:97)"])
_STUCK_STACK = "\n".join(['Thread {pid} "MainThread"', "    read_shard (job.py:31)", "    next_batch (job.py:44)",
                          "    main (job.py:86)", "    <module> (job.py:97)"])


def two_group_dumps() -> dict:
    """Four ranks in two tensor-parallel pairs, (0, 1) in group 1 and (2, 3) in group 2, one
    all-reduce per step in pair 1, three in pair 2, then the data-parallel all-reduce in the
    default group 0. Rank 3 got stuck reading its data before step 11: rank 2 waits in pair 2's
    collective 31, ranks 0 and 1 in the default group's 11 (for ranks 2 and 3). Comparing
    collective_seq_ids across groups, or reading the default group alone, names a victim."""
    pairs = {0: ("1", "tp 0-1", 1), 1: ("1", "tp 0-1", 1), 2: ("2", "tp 2-3", 3), 3: ("2", "tp 2-3", 3)}
    last = {0: (11, 11), 1: (11, 11), 2: (31, 10), 3: (30, 10)}  # (in its pair, in the default group)
    dumps = {}
    for rank, (in_pair, in_default) in last.items():
        group, name, per_step = pairs[rank]
        timed = [(-(-seq // per_step) * 10 + (seq - 1) % per_step, seq, (group, name)) for seq in range(1, in_pair + 1)]
        timed += [(step * 10 + 5, step, ("0", "default_pg")) for step in range(1, in_default + 1)]
        entries = [_entry(seq, 18816 if pg[0] != "0" else 1181066, record, pg)
                   for record, (_, seq, pg) in enumerate(sorted(timed))]  # oldest first, as recorded
        dumps[rank] = {"rank": rank, "fr": {"entries": entries, "pg_status": {}},
                       "stack": (_STUCK_STACK if rank == 3 else _WAITING_STACK).format(pid=4000 + rank)}
    return dumps


def synthetic_dumps(buffer_size: int | None = None) -> dict:
    """Four ranks of a job whose rank 2 got stuck reading its data after collective 30; ranks
    0 and 1 have started two more all-reduces (DDP's buckets), rank 3 one. ``buffer_size``:
    each flight recorder keeps only its newest entries, as TORCH_FR_BUFFER_SIZE does."""
    sizes = [1181066, 18816, 1]
    dumps = {}
    for rank, last in {0: 32, 1: 32, 2: 30, 3: 31}.items():
        entries = [_entry(seq, sizes[(seq - 1) % 3], seq - 1) for seq in range(1, last + 1)]
        if buffer_size:
            entries = entries[-buffer_size:]
        dumps[rank] = {"rank": rank, "fr": {"entries": entries, "pg_status": {}},
                       "stack": (_STUCK_STACK if rank == 2 else _WAITING_STACK).format(pid=4000 + rank)}
    return dumps


def _diagnosis_of(diagnose, name: str, dumps: dict) -> dict:
    """What ``diagnose`` says about ``dumps``, a dict with the four keys; an error it raises is
    told its usual cause."""
    try:
        got = diagnose(dumps)
    except CheckFailed:
        raise
    except Exception as error:
        raise CheckFailed(
            f"{name}: diagnose() raised {type(error).__name__}: {error}. A collective looked up by a "
            "collective_seq_id that no rank recorded in that process group usually means the rank, the group or "
            "the seq is wrong (Hint 1).") from error
    if not isinstance(got, dict) or not {"rank", "group", "seq", "op", "stuck_in"} <= set(got):
        raise CheckFailed(f"diagnose() returned {got!r}: return a dict with keys 'rank', 'group', 'seq', 'op' and "
                          "'stuck_in'")
    return got


class _Case:
    """One set of dumps, named as the messages name it, with the learner's diagnosis of it
    (``got``) and the reference's (``expected``)."""

    def __init__(self, name: str, dumps: dict, got: dict):
        self.name, self.dumps, self.got = name, dumps, got
        self.expected = _diagnose(dumps)
        self.culprit, self.group = self.expected["rank"], self.expected["group"]
        lasts = _lasts(dumps)
        self.groups = sorted({group for group, _ in lasts})
        # the last collective each rank of the culprit's group entered there
        self.last = {rank: seq for (group, rank), seq in lasts.items() if group == self.group}
        self.counts = {rank: len(d["fr"]["entries"]) for rank, d in dumps.items()}
        newest = {rank: max(s for (_, r), s in lasts.items() if r == rank) for rank in dumps}
        self.lowest_anywhere = min(newest, key=lambda rank: (newest[rank], rank))  # seqs of all groups as one
        default = {rank: seq for (group, rank), seq in lasts.items() if group == "0"}
        self.lowest_in_default = min(default, key=lambda rank: (default[rank], rank)) if default else None

    def frames(self, rank) -> list[str]:
        return _frames(self.dumps[rank]["stack"])


# The known wrong readings of the dumps, each table tried in its order. Wrong ranks: where every
# recorder holds as many entries (they wrapped), a reading that counts entries names a rank by
# chance, so that is told first; a rank that entered later collectives than the culprit waits in one.
RANK_MISTAKES = (
    Mistake("seqs compared across groups",
             lambda c: len(c.groups) > 1 and c.got["rank"] == c.lowest_anywhere != c.culprit,
             lambda c: f"{c.name}: you named rank {c.got['rank']}, whose collectives have the lowest numbers, but "
                       f"these dumps hold {len(c.groups)} process groups ({', '.join(c.groups)}) and each numbers its "
                       "own collectives: a number says how far a rank got in one group only (Hint 1)."),
    Mistake("the default group only",
             lambda c: len(c.groups) > 1 and c.got["rank"] == c.lowest_in_default != c.culprit,
             lambda c: f"{c.name}: you named rank {c.got['rank']}, which got least far in the default group, but "
                       "it is waiting too: in another group, for a rank of its own group. Which rank waits for no "
                       "one (Hint 1)?"),
    Mistake("counts entries",
             lambda c: len(set(c.counts.values())) == 1,
             lambda c: f"{c.name}: you named rank {c.got['rank']}, but every rank's flight recorder holds "
                       f"{c.counts[c.culprit]} entries: it keeps only the newest TORCH_FR_BUFFER_SIZE, so counting "
                       "entries (or reading positions in the list) says nothing. Compare collective_seq_id, the "
                       "number of the collective within its process group."),
    Mistake("names the victim",
             lambda c: c.last.get(c.got["rank"], -1) > c.last[c.culprit],
             lambda c: f"{c.name}: rank {c.got['rank']} entered collective {c.last[c.got['rank']]} of group "
                       f"{c.group}, which rank {c.culprit} never entered, and is waiting there: a victim, not the "
                       "cause (its timeout error is only the echo)."),
)

SEQ_MISTAKES = (
    Mistake("off by one",
             lambda c: c.got["seq"] == c.last[c.culprit],
             lambda c: f"{c.name}: collective {c.got['seq']} is the last one rank {c.culprit} entered, and it "
                       f"completed on every rank. The others are waiting in the NEXT one, {c.expected['seq']}, "
                       f"which rank {c.culprit} never reached."),
    Mistake("newest collective",
             lambda c: c.got["seq"] == max(c.last.values()),
             lambda c: f"{c.name}: collective {c.got['seq']} is the newest one a waiting rank launched (DDP "
                       "launches each bucket's all-reduce without waiting), not the first one that cannot "
                       f"finish: that is {c.expected['seq']}, the first rank {c.culprit} never entered."),
)

GROUP_MISTAKES = (
    Mistake("the default group named",
             lambda c: str(c.got["group"]) == "0" != c.group,
             lambda c: f"{c.name}: the ranks that wait in the default group wait for more than rank {c.culprit}; "
                       f"the collective only rank {c.culprit} is missing is in another process group (Hint 1)."),
)

STUCK_IN_MISTAKES = (
    Mistake("outermost frame",
             lambda c: c.got["stuck_in"] == c.frames(c.culprit)[-1],
             lambda c: f"{c.name}: {c.got['stuck_in']!r} is the OUTERMOST frame of rank {c.culprit}'s stack. "
                       "py-spy dump (and this dump) print the innermost call first: the first line "
                       "under the thread's name is where it is stuck."),
    Mistake("a waiting rank's stack",
             lambda c: any(c.got["stuck_in"] in c.frames(r) for r in c.dumps if r != c.culprit),
             lambda c: f"{c.name}: {c.got['stuck_in']!r} comes from a waiting rank's stack; read the stack "
                       f"of the stuck rank {c.culprit}."),
)


def _check_rank(c: _Case) -> None:
    """The rank named is the one holding the job up: the one rank that waits for no one."""
    if c.got["rank"] != c.culprit:
        name_the_first(RANK_MISTAKES, c)
        raise CheckFailed(f"{c.name}: you named rank {c.got['rank']}, which is not the rank the others wait "
                          "for: that one waits for no one (Hint 1).")


def _check_group(c: _Case) -> None:
    """The process group of the collective only the stuck rank is missing, by its name."""
    if str(c.got["group"]) != c.group:
        name_the_first(GROUP_MISTAKES, c)
        raise CheckFailed(f"{c.name}: group {c.got['group']!r}: give the name of the process group (the first "
                          "element of an entry's process_group) whose collective only the stuck rank never entered")


def _check_seq(c: _Case) -> None:
    """The collective the others wait in is the first one the stuck rank never entered."""
    if c.got["seq"] != c.expected["seq"]:
        name_the_first(SEQ_MISTAKES, c)
        raise CheckFailed(f"{c.name}: seq {c.got['seq']}, expected {c.expected['seq']}: one past the stuck "
                          "rank's last collective_seq_id")


def _check_op(c: _Case) -> None:
    """The op is that collective's profiling_name, as the waiting ranks recorded it."""
    if c.got["op"] != c.expected["op"]:
        raise CheckFailed(f"{c.name}: op {c.got['op']!r}: give the profiling_name of collective "
                          f"{c.expected['seq']} as the waiting ranks recorded it ({c.expected['op']!r})")


def _check_stuck_in(c: _Case) -> None:
    """Where the stuck rank is: the innermost frame of its own stack."""
    if c.got["stuck_in"] != c.expected["stuck_in"]:
        name_the_first(STUCK_IN_MISTAKES, c)
        raise CheckFailed(f"{c.name}: stuck_in {c.got['stuck_in']!r}, expected {c.expected['stuck_in']!r}: the "
                          f"function name on the first line under rank {c.culprit}'s thread name")


def check_hang_diagnosis(diagnose, dumps: dict | None = None) -> None:
    """``diagnose(dumps)`` -> {"rank", "group", "seq", "op", "stuck_in"} for the dumps of a hung job.

    Runs it on the check's own four-rank dumps (with whole flight recorders, with wrapped ones,
    and of a job with two tensor-parallel pairs) and then on ``dumps``, the real dumps of the
    notebook's hung job.
    """
    cases = [("the check's 4-rank dumps", synthetic_dumps()),
             ("the check's 4-rank dumps with TORCH_FR_BUFFER_SIZE=8", synthetic_dumps(buffer_size=8)),
             ("the check's dumps of two tensor-parallel pairs", two_group_dumps())]
    if dumps:
        cases.append(("your job's dumps", dumps))
    with borrowing_refused("diagnose", answers=[diagnose]):
        for name, case in cases:
            c = _Case(name, case, _diagnosis_of(diagnose, name, case))
            _check_rank(c)
            _check_group(c)
            _check_seq(c)
            _check_op(c)
            _check_stuck_in(c)
    answer = _diagnose(dumps) if dumps else _diagnose(cases[0][1])
    passed(f"diagnosis right on {len(cases)} sets of dumps (yours: rank {answer['rank']} stuck in "
           f"{answer['stuck_in']}, the others wait in collective {answer['seq']} of group {answer['group']}, "
           f"{answer['op']})")
