"""An in-process message-passing simulator: MPI's ideas, with no MPI and no processes.

    world = World(4)
    def program(comm, x):                 # every rank runs the same function (SPMD)
        if comm.rank == 0:
            comm.send(x, dest=1)
        elif comm.rank == 1:
            return comm.recv(source=0)
    world.run(program, 42)                # [None, 42, None, None]: one value per rank
    world.trace                           # one Message per message: who, to whom, bytes, when

Each rank is a thread. A message is pickled when it is sent, so the receiver gets a
copy, as over a wire; ``nbytes`` counts numpy arrays and torch tensors by their buffer
size and anything else by its pickled size.

Blocking rules, as MPI allows them: ``recv`` and ``wait`` on a receive return once the
matching message is there. A blocking ``send`` returns at once for messages of at most
``eager_limit`` bytes (buffered, "eager"); a larger one waits until the receiver has
posted the matching receive ("rendezvous"), as real MPI does. Messages between two
ranks with the same tag are received in the order they were sent.

Simulated time follows the alpha-beta model: a message of n bytes occupies the
sender's outgoing link and the receiver's incoming link for ``alpha + n * beta``
seconds, one message at a time per link and direction. Computing takes no simulated
time. So the trace's times are those of an idealised network, the same one that
``spike_course.costmodel.allreduce_time`` describes in closed form.

When every rank that is still running is blocked and none can ever proceed, ``run``
raises :class:`DeadlockError` at once, naming what each rank waits for, instead of
hanging like real processes do.
"""

from __future__ import annotations

import math
import pickle
import threading
from dataclasses import dataclass, field

DEFAULT_ALPHA = 5e-6          # seconds per message: latency
DEFAULT_BETA = 1 / 64e9       # seconds per byte: one direction of PCIe 5 x16 (128 GB/s both ways)
DEFAULT_EAGER_LIMIT = 65536   # bytes: larger blocking sends wait for the matching receive


class DeadlockError(RuntimeError):
    """Every live rank is blocked and nothing can unblock it. ``waiting[rank]`` says on what."""

    def __init__(self, message: str, waiting: dict):
        super().__init__(message)
        self.waiting = waiting


class _Aborted(BaseException):
    """Stops a rank's thread when another rank failed or the world deadlocked."""


@dataclass(frozen=True)
class Message:
    """One delivered message, as it appears in ``World.trace`` (times in simulated seconds)."""

    source: int
    dest: int
    tag: int
    nbytes: int
    send_time: float     # its first byte leaves the sender
    arrival_time: float  # its last byte has reached the receiver


@dataclass(eq=False)
class _Envelope:
    source: int
    dest: int
    tag: int
    payload: bytes
    nbytes: int
    depart: float
    matched: bool = False
    delivered: Message | None = None


def nbytes_of(obj, payload: bytes) -> int:
    """Buffer size of an array or tensor; pickled size of anything else."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # a torch tensor
        return int(obj.numel() * obj.element_size())
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):        # a numpy array
        return int(obj.nbytes)
    return len(payload)


class Request:
    """A posted ``isend`` or ``irecv``. ``wait()`` blocks until it is done and, for a
    receive, returns the received object (calling it again returns the same)."""

    def __init__(self, comm: "Comm", kind: str, peer: int, tag: int, envelope=None):
        self._comm, self.kind, self.peer, self.tag = comm, kind, peer, tag
        self._envelope = envelope
        self._value, self._done = None, False
        self._blocking = False   # made by send()/recv() rather than isend()/irecv()

    def __repr__(self) -> str:
        return f"<{self.kind} request of rank {self._comm.rank}: {self._describe()}>"

    def _describe(self) -> str:
        if self.kind == "send":
            call = f"send(dest={self.peer}, tag={self.tag}, {self._envelope.nbytes} bytes)"
        else:
            call = f"recv(source={self.peer}, tag={self.tag})"
        return call if self._blocking else f"wait() on i{call}"

    def wait(self):
        if not self._done:
            self._value = self._comm._world._complete(self._comm.rank, self)
            self._done = True
        return self._value


def waitall(requests) -> list:
    """Wait for every request in order; the list of their values (None for sends)."""
    return [request.wait() for request in requests]


class Comm:
    """What one rank sees: its ``rank``, the world ``size``, and the messaging calls."""

    def __init__(self, world: "World", rank: int):
        self._world, self.rank, self.size = world, rank, world.size

    def __repr__(self) -> str:
        return f"<Comm rank {self.rank} of {self.size}>"

    @property
    def time(self) -> float:
        """This rank's simulated clock, in seconds."""
        return self._world._clock[self.rank]

    def isend(self, obj, dest: int, tag: int = 0) -> Request:
        """Start sending ``obj`` to rank ``dest``; the object is copied right away."""
        return self._world._post_send(self.rank, obj, dest, tag)

    def irecv(self, source: int, tag: int = 0) -> Request:
        """Post a receive; ``.wait()`` returns the object once it has arrived."""
        return self._world._post_recv(self.rank, source, tag)

    def send(self, obj, dest: int, tag: int = 0) -> None:
        """Blocking send (returns at once unless the message is over the eager limit)."""
        request = self.isend(obj, dest, tag)
        request._blocking = True
        request.wait()

    def recv(self, source: int, tag: int = 0):
        """Blocking receive of the next message from ``source`` with ``tag``."""
        request = self.irecv(source, tag)
        request._blocking = True
        return request.wait()

    def barrier(self) -> None:
        """Return only when every rank has called ``barrier``."""
        self._world._barrier(self.rank)


@dataclass
class World:
    """``size`` simulated ranks. ``run(fn, *args)`` calls ``fn(comm, *args)`` on each.

    alpha: seconds of latency per message; beta: seconds per byte on a link;
    eager_limit: largest message (bytes) that a blocking send buffers and returns from
    without waiting for the receiver (0: every send waits, like MPI_Ssend).
    """

    size: int
    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    eager_limit: int = DEFAULT_EAGER_LIMIT
    trace: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a world needs a whole number of ranks >= 1, got {self.size!r}")
        self._reset()

    def _reset(self):
        n = self.size
        self._cond = threading.Condition()
        self._clock = [0.0] * n
        self._out_free = [0.0] * n      # when each rank's outgoing link is free again
        self._in_free = [0.0] * n       # when each rank's incoming link is free again
        self._unexpected = [[] for _ in range(n)]  # sent to rank d, no receive posted yet
        self._posted = [[] for _ in range(n)]      # receives posted by rank d, no message yet
        self._envelopes = []
        self._waiting = {}              # rank -> (what it waits for, predicate)
        self._finished = set()
        self._failure = None            # (rank, exception) of the first rank that raised
        self._deadlock = None
        self._barrier_count, self._barrier_generation = 0, 0
        self.trace = []

    # ---- running ranks ----------------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = 60.0) -> list:
        """Run ``fn(comm, *args)`` on every rank; their return values in rank order.

        Raises DeadlockError when the ranks deadlock, or the first exception a rank
        raised (with a note naming the rank). ``timeout`` bounds the real seconds, for a
        rank that computes forever without communicating.
        """
        self._reset()
        results = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(rank, fn, args, results),
                                    name=f"mpi_sim-rank{rank}", daemon=True)
                   for rank in range(self.size)]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join(timeout)
                if thread.is_alive():
                    raise TimeoutError(f"ranks still running after {timeout} s: {self._states()}")
        except BaseException as error:  # a timeout, or an interrupted cell: stop waiting ranks
            with self._cond:
                self._failure = self._failure or (None, error)
                self._cond.notify_all()
            raise
        if self._deadlock is not None:
            raise self._deadlock
        if self._failure is not None:
            rank, error = self._failure
            raise error
        self._deliver_leftovers()
        self.trace.sort(key=lambda m: (m.send_time, m.source, m.dest, m.tag))
        return results

    def _rank_main(self, rank, fn, args, results):
        try:
            results[rank] = fn(Comm(self, rank), *args)
        except _Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to run() in the main thread
            if hasattr(error, "add_note"):
                error.add_note(f"(raised on rank {rank} of the simulated world)")
            with self._cond:
                if self._failure is None:
                    self._failure = (rank, error)
        finally:
            with self._cond:
                self._finished.add(rank)
                self._cond.notify_all()

    @property
    def elapsed(self) -> float:
        """Simulated seconds until the last rank finished (after ``run``)."""
        return max(self._clock)

    def messages_per_rank(self) -> list:
        """How many messages each rank sent, in the last run."""
        return [sum(1 for m in self.trace if m.source == r) for r in range(self.size)]

    def bytes_per_rank(self) -> list:
        """How many bytes each rank sent, in the last run."""
        return [sum(m.nbytes for m in self.trace if m.source == r) for r in range(self.size)]

    def delivered(self) -> list:
        """(Message, the object it carried) for every message of the last run, in the trace's
        order: what a check reads to say which partial result went where."""
        carried = [(e.delivered, pickle.loads(e.payload)) for e in self._envelopes if e.delivered]
        return sorted(carried, key=lambda pair: (pair[0].send_time, pair[0].source, pair[0].dest, pair[0].tag))

    # ---- messages ---------------------------------------------------------------------

    def _check_peer(self, rank, peer, what):
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise ValueError(f"rank {rank}: {what} rank {peer!r}, but this world has ranks "
                             f"0..{self.size - 1} (size {self.size})")

    def _post_send(self, rank, obj, dest, tag):
        self._check_peer(rank, dest, "send to")
        try:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"rank {rank} cannot send a {type(obj).__name__} to rank {dest}: messages are "
                f"serialised with pickle and this object cannot be ({error}). Send data: numbers, "
                "strings, lists, dicts, numpy arrays or tensors.") from error
        nbytes = nbytes_of(obj, payload)
        with self._cond:
            self._abort_if_needed()
            depart = max(self._clock[rank], self._out_free[rank])
            self._out_free[rank] = depart + self.alpha + nbytes * self.beta
            envelope = _Envelope(rank, dest, tag, payload, nbytes, depart)
            self._envelopes.append(envelope)
            request = Request(self._comms(rank), "send", dest, tag, envelope)
            for posted in self._posted[dest]:
                if posted.peer == rank and posted.tag == tag:
                    self._posted[dest].remove(posted)
                    posted._envelope, envelope.matched = envelope, True
                    break
            else:
                self._unexpected[dest].append(envelope)
            self._cond.notify_all()
        return request

    def _post_recv(self, rank, source, tag):
        self._check_peer(rank, source, "recv from")
        with self._cond:
            self._abort_if_needed()
            request = Request(self._comms(rank), "recv", source, tag)
            for envelope in self._unexpected[rank]:
                if envelope.source == source and envelope.tag == tag:
                    self._unexpected[rank].remove(envelope)
                    request._envelope, envelope.matched = envelope, True
                    break
            else:
                self._posted[rank].append(request)
            self._cond.notify_all()
        return request

    def _comms(self, rank):
        return Comm(self, rank)

    def _complete(self, rank, request):
        with self._cond:
            if request.kind == "send":
                envelope = request._envelope
                if envelope.nbytes > self.eager_limit:
                    self._block_until(rank, lambda: envelope.matched, f"{request._describe()} "
                                      f"(over the eager limit of {self.eager_limit} bytes, so it "
                                      f"waits for rank {envelope.dest} to post the matching recv)")
                done = envelope.depart + self.alpha + envelope.nbytes * self.beta
                self._clock[rank] = max(self._clock[rank], done)
                return None
            self._block_until(rank, lambda: request._envelope is not None,
                              f"{request._describe()} (no message from rank {request.peer} "
                              f"with tag {request.tag} yet)")
            message = self._deliver(request._envelope)
            self._clock[rank] = max(self._clock[rank], message.arrival_time)
            return pickle.loads(request._envelope.payload)

    def _deliver(self, envelope):
        """Times of a matched message, fixed when its receiver completes it (program order)."""
        if envelope.delivered is None:
            cost = self.alpha + envelope.nbytes * self.beta
            start = max(envelope.depart, self._in_free[envelope.dest])
            self._in_free[envelope.dest] = start + cost
            envelope.delivered = Message(envelope.source, envelope.dest, envelope.tag,
                                         envelope.nbytes, start, start + cost)
            self.trace.append(envelope.delivered)
        return envelope.delivered

    def _deliver_leftovers(self):
        """Messages matched by an irecv that nobody waited for still crossed the wire."""
        for envelope in sorted(self._envelopes, key=lambda e: (e.depart, e.source)):
            if envelope.matched:
                self._deliver(envelope)

    def _barrier(self, rank):
        with self._cond:
            self._abort_if_needed()
            generation = self._barrier_generation
            self._barrier_count += 1
            if self._barrier_count == self.size:
                # A dissemination barrier: ceil(log2 N) rounds of small messages.
                release = max(self._clock) + math.ceil(math.log2(self.size)) * self.alpha
                self._clock = [release] * self.size
                self._barrier_count, self._barrier_generation = 0, generation + 1
                self._cond.notify_all()
                return
            self._block_until(rank, lambda: self._barrier_generation != generation,
                              lambda: f"barrier ({self._barrier_count} of {self.size} ranks "
                                      "have arrived)")

    # ---- blocking and deadlock detection (all called with self._cond held) ------------

    def _abort_if_needed(self):
        if self._failure is not None or self._deadlock is not None:
            raise _Aborted()

    def _block_until(self, rank, ready, what):
        self._abort_if_needed()
        if ready():
            return
        self._waiting[rank] = (what, ready)
        try:
            while not ready():
                self._abort_if_needed()
                if self._stuck():
                    self._deadlock = DeadlockError(self._deadlock_message(), {
                        r: self._what(r) for r in sorted(self._waiting)})
                    self._cond.notify_all()
                    raise _Aborted()
                self._cond.wait(timeout=0.25)
        finally:
            del self._waiting[rank]

    def _stuck(self) -> bool:
        live = [r for r in range(self.size) if r not in self._finished]
        return all(r in self._waiting and not self._waiting[r][1]() for r in live)

    def _what(self, rank) -> str:
        what = self._waiting[rank][0]
        return what() if callable(what) else what

    def _states(self) -> str:
        return "; ".join(f"rank {r}: " + ("finished" if r in self._finished else
                                          self._what(r) if r in self._waiting else "running")
                         for r in range(self.size))

    def _deadlock_message(self) -> str:
        lines = ["deadlock: every rank that is still running waits for something that no rank "
                 "will ever do."]
        waits = {r: self._what(r) for r in self._waiting}
        for r in range(self.size):
            lines.append(f"  rank {r} " + (f"waits in {waits[r]}" if r in waits else "has returned"))
        pending = [e for queue in self._unexpected for e in queue]
        if pending:
            lines.append("Sent but never received: " + ", ".join(
                f"rank {e.source} -> rank {e.dest} (tag {e.tag}, {e.nbytes} bytes)" for e in pending))
        if any("recv(" in w or "send(" in w for w in waits.values()):
            lines.append("A blocking recv returns only after the matching send, and a large "
                         "blocking send only after the matching recv: if every rank does one "
                         "first, nobody gets to the other. Post irecv/isend first and wait() "
                         "afterwards, or order the calls so one side sends while the other "
                         "receives. Check also that sources, destinations and tags match.")
        if any(w.startswith("barrier") for w in waits.values()):
            lines.append("A barrier returns only when every rank calls it: a rank that skips it "
                         "(another branch, an early return) leaves the others waiting.")
        return "\n".join(lines)
