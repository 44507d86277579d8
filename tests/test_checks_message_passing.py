"""The exercise checks of chapter 01 name the likely mistake (spike_course.checks)."""

import numpy as np
import pytest

from spike_course import checks
from reference_collectives import naive_allreduce, ring_allreduce, tree_allreduce


def _tree(comm, array, *, broadcast=True, up=(1, 2, 4, 8), down=(8, 4, 2, 1), guard=True):
    """A binomial-tree all-reduce a learner might write; the keywords plant the mistakes."""
    n, r = comm.size, comm.rank
    total = np.array(array, copy=True)
    for k in (k for k in up if k < n):              # reduce: distance 1, 2, 4, ...
        if r % (2 * k) == k:
            comm.send(total, r - k)
        elif r % (2 * k) == 0 and (r + k < n or not guard):
            total += comm.recv(r + k)
    for k in (k for k in down if k < n and broadcast):  # broadcast: ..., 4, 2, 1
        if r % (2 * k) == 0 and (r + k < n or not guard):
            comm.send(total, r + k)
        elif r % (2 * k) == k:
            total = comm.recv(r - k)
    return total


def _fails(check, fn, *words):
    with pytest.raises(checks.CheckFailed) as caught:
        check(fn)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_tree_check_passes_the_reference_and_a_learner_style_answer(capsys):
    checks.check_tree_allreduce(tree_allreduce)
    checks.check_tree_allreduce(_tree)
    assert "check passed" in capsys.readouterr().out


def test_tree_check_names_the_mistakes():
    def blank(comm, array):
        raise NotImplementedError("exercise")

    _fails(checks.check_tree_allreduce, blank, "not written yet")
    _fails(checks.check_tree_allreduce, lambda c, a: None, "returned None")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a) / c.size, "divided by the world size")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, broadcast=False),
           "only rank 0 holds the sum", "broadcast")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, down=(1, 2, 4, 8)),
           "partial sum", "reverse order")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, up=(8, 4, 2, 1)),
           "never reached rank 0", "k = 1, 2, 4")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, guard=False),
           "does not exist", "power of two")
    _fails(checks.check_tree_allreduce, naive_allreduce, "right sums", "2 ceil(log2 N)")
    _fails(checks.check_tree_allreduce, ring_allreduce, "right sums", "2 ceil(log2 N)")


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
