"""The exercise checks of chapter 01 name the likely mistake (spike_course.checks)."""

import numpy as np
import pytest

from spike_course import checks
from spike_course.mpi_collectives import naive_allreduce, ring_allreduce


def _ring(comm, array, *, send_first=False, gather=True, chunk_of=None, whole=False):
    n, r = comm.size, comm.rank
    chunks = chunk_of(array, n) if chunk_of else np.array_split(array, n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        if send_first:
            comm.send(chunks[(r - step) % n], right)
            chunks[(r - step - 1) % n] += comm.recv(left)
        elif whole:  # sends everything, the receiver picks the chunk it needs
            request = comm.isend(array, right)
            chunks[(r - step - 1) % n] += np.array_split(comm.recv(left), n)[(r - step - 1) % n]
            request.wait()
        else:
            request = comm.isend(chunks[(r - step) % n], right)
            chunks[(r - step - 1) % n] += comm.recv(left)
            request.wait()
    for step in range(n - 1 if gather else 0):
        request = comm.isend(chunks[(r - step + 1) % n], right)
        chunks[(r - step) % n][...] = comm.recv(left)
        request.wait()
    return array


def _fails(check, fn, *words):
    with pytest.raises(checks.CheckFailed) as caught:
        check(fn)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_ring_check_passes_the_reference_and_a_learner_style_answer(capsys):
    checks.check_ring_allreduce(ring_allreduce)
    checks.check_ring_allreduce(_ring)
    assert "check passed" in capsys.readouterr().out


def test_ring_check_names_the_mistakes():
    def blank(comm, array):
        raise NotImplementedError("exercise")

    def floor_chunks(array, n):
        k = len(array) // n
        return [array[i * k:(i + 1) * k] for i in range(n)]

    _fails(checks.check_ring_allreduce, blank, "not written yet")
    _fails(checks.check_ring_allreduce, lambda c, a: None, "returned None")
    _fails(checks.check_ring_allreduce, lambda c, a: ring_allreduce(c, a) / c.size,
           "divided by the world size")
    _fails(checks.check_ring_allreduce, lambda c, a: a, "its own input unchanged")
    _fails(checks.check_ring_allreduce, lambda c, a: np.array_split(ring_allreduce(c, a), c.size)[0],
           "return the whole array")
    _fails(checks.check_ring_allreduce, lambda c, a: _ring(c, a, gather=False), "all-gather is missing")
    _fails(checks.check_ring_allreduce, lambda c, a: _ring(c, a, chunk_of=floor_chunks),
           "np.array_split")
    _fails(checks.check_ring_allreduce, lambda c, a: _ring(c, a, send_first=True),
           "only while sends are buffered", "isend")
    _fails(checks.check_ring_allreduce, naive_allreduce, "2(N-1)")
    _fails(checks.check_ring_allreduce, lambda c, a: _ring(c, a, whole=True), "whole array in some steps")


def _exchange(comm, data, *, src_step=-1, dst_step=1, style="irecv", give="received"):
    n = comm.size
    left, right = (comm.rank + src_step) % n, (comm.rank + dst_step) % n
    if style == "recv first":
        got = comm.recv(left)
        comm.send(data, right)
    elif style == "send first":
        comm.send(data, right)
        got = comm.recv(left)
    else:
        request = comm.irecv(left)
        comm.send(data, right)
        got = request.wait()
    return {"received": got, "own": data, "none": None}[give]


def test_exchange_check_passes_a_right_answer(capsys):
    checks.check_exchange(_exchange)
    assert "check passed" in capsys.readouterr().out


def test_exchange_check_names_the_mistakes():
    _fails(checks.check_exchange, lambda c, d: _exchange(c, d, style="recv first"),
           "every rank blocks in recv", "irecv")
    _fails(checks.check_exchange, lambda c, d: _exchange(c, d, style="send first"),
           "every rank blocks in a blocking send", "isend")
    _fails(checks.check_exchange, lambda c, d: _exchange(c, d, give="own"), "its own data")
    _fails(checks.check_exchange, lambda c, d: _exchange(c, d, give="none"), "returned None")
    _fails(checks.check_exchange, lambda c, d: _exchange(c, d, src_step=1, dst_step=-1),
           "right neighbour (rank + 1) % N")
