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


def _all_to_all(comm, items, *, order="receives first", send="theirs", place="by sender", to_self=False):
    """A correct all-to-all, or one with a planted mistake."""
    others = [peer for peer in range(comm.size) if peer != comm.rank or to_self]
    if order == "blocking receives first":
        got = {peer: comm.recv(peer) for peer in others}
    posted = {peer: comm.irecv(peer) for peer in others} if order == "receives first" else {}
    for peer in others:
        comm.send({"theirs": items[peer], "mine": items[comm.rank], "all": items}[send], peer)
    if order == "blocking sends first":
        got = {peer: comm.recv(peer) for peer in others}
    elif order == "receives first":
        got = {peer: request.wait() for peer, request in posted.items()}
    own = items[comm.rank] if place != "own first of nothing" else None
    if place == "by sender":
        return [own if peer == comm.rank else got[peer] for peer in range(comm.size)]
    if place == "own first":
        return [own] + [got[peer] for peer in others]
    return [None if peer == comm.rank else got[peer] for peer in range(comm.size)] if place == "own dropped" else None


def _in_rounds(comm, items):
    """Another right answer: in round k, receive from rank - k (posted first) while sending to rank + k."""
    n, got = comm.size, list(items)
    for k in range(1, n):
        request = comm.irecv((comm.rank - k) % n)
        comm.send(items[(comm.rank + k) % n], (comm.rank + k) % n)
        got[(comm.rank - k) % n] = request.wait()
    return got


@pytest.mark.parametrize("answer", [_all_to_all, _in_rounds])
def test_the_all_to_all_check_passes_right_answers(answer, capsys):
    checks.check_all_to_all(answer)
    assert "check passed" in capsys.readouterr().out


EXCHANGE_PLANTED = {
    "receive first": (lambda c, i: _all_to_all(c, i, order="blocking receives first"), ["blocks in a receive", "Hint 1"]),
    "blocking send first": (lambda c, i: _all_to_all(c, i, order="blocking sends first"),
                            ["every rank blocks in a send", "Hint 1"]),
    "nothing returned": (lambda c, i: _all_to_all(c, i, place="none"), ["returned NoneType"]),
    "own items returned": (lambda c, i: list(i), ["returned the items it had for the others"]),
    "whole list sent": (lambda c, i: _all_to_all(c, i, send="all"), ["received whole lists"]),
    "own slot sent to all": (lambda c, i: _all_to_all(c, i, send="mine"), ["rank j sent items[j]"]),
    "own item misplaced": (lambda c, i: _all_to_all(c, i, place="own dropped"), ["own place holds nothing"]),
    "out of order": (lambda c, i: _all_to_all(c, i, place="own first"), ["in another order", "from ranks [1, 0]"]),
    "not one message per peer": (lambda c, i: _all_to_all(c, i, to_self=True), ["sent [2, 2] messages"]),
}
CHECK_MODULE, PLANTS = message_passing, {**TREE_PLANTED, **EXCHANGE_PLANTED}  # tests/named.py
CHECK_OF = {**{name: "check_tree_allreduce" for name in TREE_PLANTED},
            **{name: "check_all_to_all" for name in EXCHANGE_PLANTED}}


@pytest.mark.parametrize("name", PLANTS)
def test_each_planted_mistake_is_named(name):
    answer, words = PLANTS[name]
    with names(name) as failure:
        getattr(checks, CHECK_OF[name])(answer)
    assert all(word in str(failure.value) for word in words), str(failure.value)
