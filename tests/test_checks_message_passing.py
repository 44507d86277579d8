"""The exercise checks of chapter 01 name the likely mistake (spike_course.checks)."""

import math

import numpy as np
import pytest

from spike_course import checks
from spike_course.checks import ch01_message_passing as message_passing
from named import names
from reference_collectives import naive_allreduce, ring_allreduce, tree_allreduce


def _tree(comm, array, *, rounds=math.ceil, broadcast=True, up=True, down=True, guard=True,
          keep=True, tags=(1, 1)):
    """A binomial-tree all-reduce a learner might write; the keywords plant the mistakes."""
    n, r = comm.size, comm.rank
    total = np.array(array, copy=True)
    distances = [1 << i for i in range(int(rounds(math.log2(n))))] if n > 1 else []
    for k in distances if up else distances[::-1]:          # reduce: distance 1, 2, 4, ...
        if r % (2 * k) == k:
            comm.send(total, r - k, tag=tags[0])
        elif r % (2 * k) == 0 and (r + k < n or not guard):
            total += comm.recv(r + k, tag=tags[1])
    for k in (distances[::-1] if down else distances) if broadcast else ():  # broadcast: ..., 4, 2, 1
        if r % (2 * k) == 0 and (r + k < n or not guard):
            comm.send(total, r + k)
        elif r % (2 * k) == k:
            received = comm.recv(r - k)
            total = received if keep else total
    return total


def _recursive_doubling(comm, array):
    """Another right all-reduce, faster than the tree: the ranks above the largest power of two
    p fold into rank r - p, the p ranks exchange whole sums at distances 1, 2, 4, ... (both
    ways at once), and the folded ranks get the total back: floor(log2 N) + 2 rounds at most."""
    n, r = comm.size, comm.rank
    total = np.array(array, copy=True)
    p = 1 << int(math.log2(n))
    if r >= p:
        comm.send(total, r - p)
        return comm.recv(r - p)
    if r + p < n:
        total += comm.recv(r + p)
    k = 1
    while k < p:
        request = comm.isend(total.copy(), r ^ k)
        total = total + comm.recv(r ^ k)
        request.wait()
        k *= 2
    if r + p < n:
        comm.send(total, r + p)
    return total


def _fails(check, fn, *words):
    with pytest.raises(checks.CheckFailed) as caught:
        check(fn)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    return str(caught.value)


def test_tree_check_passes_the_reference_and_a_learner_style_answer(capsys):
    checks.check_tree_allreduce(tree_allreduce)
    checks.check_tree_allreduce(_tree)
    assert "check passed" in capsys.readouterr().out


def test_tree_check_passes_any_right_answer_as_fast_as_the_tree(capsys):
    checks.check_tree_allreduce(_recursive_doubling)
    assert "check passed" in capsys.readouterr().out


# Each mistake of the tree check's table, planted in a learner-style answer, with words its
# message must hold.
TREE_PLANTED = {
    "returned None": (lambda c, a: None, ["returned None"]),
    "another shape": (lambda c, a: _tree(c, a).reshape(2, 3), ["shape (2, 3)", "shape (6,)"]),
    "averaged": (lambda c, a: _tree(c, a) / c.size, ["divided by the world size"]),
    "a rank left out": (lambda c, a: _tree(c, a, rounds=math.floor),
                        ["on 3 ranks rank 2 never sent or received a message", "rank 2 returned its own input",
                         "log2(3) is no whole number"]),
    "received, not kept": (lambda c, a: _tree(c, a, keep=False),
                           ["on 2 ranks rank 1 received 1 message(s) and returned its own input"]),
    "no broadcast": (lambda c, a: _tree(c, a, broadcast=False),
                     ["only rank 0 ended with the sum", "rank 0 sent no message"]),
    "reduce out of order": (lambda c, a: _tree(c, a, up=False),
                            ["every rank ended with the sum of ranks [0, 1, 2] only", "inputs of rank 3 are missing",
                             "Rank 2 sent its partial sum on to rank 0 before rank 3's message reached it"]),
    "partial sum passed down": (lambda c, a: _tree(c, a, down=False),
                                ["rank 3 ended with the sum of ranks [2, 3], which is what rank 2 sent it, "
                                 "a partial sum: rank 2 passed it on before it held the total"]),
}


def test_tree_check_names_what_stops_a_run():
    def blank(comm, array):
        raise NotImplementedError("exercise")

    _fails(checks.check_tree_allreduce, blank, "not written yet")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, guard=False), "does not exist",
           "(it ran on 1-2 ranks)")
    _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a, tags=(1, 2)), "deadlocked on 2 ranks")
    _fails(checks.check_tree_allreduce, naive_allreduce, "right sums", "2 ceil(log2 N)")
    _fails(checks.check_tree_allreduce, ring_allreduce, "right sums", "2 ceil(log2 N)")


def test_a_floor_for_the_number_of_rounds_is_not_blamed_on_the_broadcast():
    """range(int(math.log2(n))) on 3 ranks: one round, and rank 2 never takes part. The
    broadcast's order is right, so the message must not send the learner there."""
    said = _fails(checks.check_tree_allreduce, TREE_PLANTED["a rank left out"][0])
    assert "broadcast" not in said and "partial sum" not in said


def test_a_wrong_result_the_table_does_not_know_is_described_not_named():
    said = _fails(checks.check_tree_allreduce, lambda c, a: _tree(c, a) + 1,
                  "on 1 rank the result is wrong, and not in a way this check knows",
                  "rank 0: values that are no sum of inputs")
    assert "broadcast" not in said and "partial" not in said and "missing" not in said


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


def _sends_twice(comm, data):
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    requests = [comm.isend(data, right) for _ in range(2)]
    got = [comm.recv(left) for _ in range(2)][0]
    for request in requests:
        request.wait()
    return got


EXCHANGE_PLANTED = {
    "receive first": (lambda c, d: _exchange(c, d, style="recv first"), ["every rank blocks in recv", "Hint 1"]),
    "blocking send first": (lambda c, d: _exchange(c, d, style="send first"),
                            ["every rank blocks in a blocking send", "Hint 1"]),
    "own data returned": (lambda c, d: _exchange(c, d, give="own"), ["its own data"]),
    "nothing returned": (lambda c, d: _exchange(c, d, give="none"), ["returned None"]),
    "neighbours swapped": (lambda c, d: _exchange(c, d, src_step=1, dst_step=-1), ["right neighbour (rank + 1) % N"]),
    "more than one message": (_sends_twice, ["sent [2, 2] messages"]),
}
CHECK_MODULE, PLANTS = message_passing, {**TREE_PLANTED, **EXCHANGE_PLANTED}  # tests/named.py
CHECK_OF = {**{name: "check_tree_allreduce" for name in TREE_PLANTED},
            **{name: "check_exchange" for name in EXCHANGE_PLANTED}}


@pytest.mark.parametrize("name", PLANTS)
def test_each_planted_mistake_is_named(name):
    answer, words = PLANTS[name]
    with names(name) as failure:
        getattr(checks, CHECK_OF[name])(answer)
    assert all(word in str(failure.value) for word in words), str(failure.value)
