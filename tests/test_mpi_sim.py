"""The message-passing simulator of chapter 01 (spike_course.mpi_sim)."""

import threading
import time

import numpy as np
import pytest
import torch

from reference_collectives import naive_allreduce, ring_allreduce
from spike_course import viz
from spike_course.mpi_sim import DeadlockError, Message, World, waitall


def test_run_returns_values_in_rank_order_and_passes_args():
    assert World(3).run(lambda comm, x: (comm.rank, comm.size, x), "hi") == [
        (0, 3, "hi"), (1, 3, "hi"), (2, 3, "hi")]


def test_send_recv_copies_the_object_and_traces_it():
    def program(comm):
        if comm.rank == 0:
            data = np.arange(10.0)
            comm.send(data, dest=1, tag=7)
            data[:] = -1  # the message was copied when sent
        else:
            return comm.recv(source=0, tag=7)

    world = World(2, alpha=1e-6, beta=1e-9)
    _, got = world.run(program)
    np.testing.assert_array_equal(got, np.arange(10.0))
    (message,) = world.trace
    assert isinstance(message, Message)
    assert (message.source, message.dest, message.tag, message.nbytes) == (0, 1, 7, 80)
    assert message.send_time == 0.0
    assert message.arrival_time == pytest.approx(1e-6 + 80e-9)


def test_nbytes_of_tensors_is_their_buffer_and_of_objects_their_pickle():
    def program(comm):
        if comm.rank == 0:
            comm.send(torch.zeros(5, dtype=torch.float16), 1)
            comm.send(torch.zeros(100)[:3], 1, tag=1)  # a view: only its own elements count
            comm.send({"a": 1}, 1, tag=2)
        else:
            return [comm.recv(0), comm.recv(0, tag=1), comm.recv(0, tag=2)]

    world = World(2)
    got = world.run(program)[1]
    assert got[2] == {"a": 1} and torch.equal(got[1], torch.zeros(3))
    sizes = {m.tag: m.nbytes for m in world.trace}
    assert sizes[0] == 10 and sizes[1] == 12 and 0 < sizes[2] < 100


def test_messages_with_one_tag_arrive_in_order_and_tags_select():
    def program(comm):
        if comm.rank == 0:
            for i in range(5):
                comm.send(i, 1, tag=i % 2)
        else:
            odd = [comm.recv(0, tag=1) for _ in range(2)]
            even = [comm.recv(0, tag=0) for _ in range(3)]
            return even, odd

    assert World(2).run(program)[1] == ([0, 2, 4], [1, 3])


def test_isend_irecv_wait_exchange_and_waitall():
    def program(comm):
        peer = 1 - comm.rank
        requests = [comm.irecv(peer), comm.isend(f"from {comm.rank}", peer)]
        received, sent = waitall(requests)
        assert sent is None and requests[0].wait() == received  # wait twice: same value
        return received

    assert World(2, eager_limit=0).run(program) == ["from 1", "from 0"]


def test_barrier_lines_up_the_clocks():
    def program(comm):
        if comm.rank == 0:
            comm.send(np.zeros(1000), 1)
        elif comm.rank == 1:
            comm.recv(0)
        comm.barrier()
        return comm.time

    times = World(3).run(program)
    assert len(set(times)) == 1 and times[0] > 0


def test_deadlock_is_reported_at_once_naming_each_rank():
    def both_receive_first(comm):
        other = 1 - comm.rank
        got = comm.recv(other)
        comm.send(comm.rank, other)
        return got

    started = time.perf_counter()
    with pytest.raises(DeadlockError) as caught:
        World(2).run(both_receive_first)
    assert time.perf_counter() - started < 1.0
    text = str(caught.value)
    assert "rank 0 waits in recv(source=1, tag=0)" in text
    assert "rank 1 waits in recv(source=0, tag=0)" in text
    assert set(caught.value.waiting) == {0, 1}


def test_deadlock_on_a_rank_that_returned_and_on_a_tag_mismatch():
    def wrong_tag(comm):
        if comm.rank == 0:
            comm.send("x", 1, tag=1)
        elif comm.rank == 1:
            comm.recv(0, tag=2)
        # rank 2 returns at once

    with pytest.raises(DeadlockError) as caught:
        World(3).run(wrong_tag)
    text = str(caught.value)
    assert "rank 1 waits in recv(source=0, tag=2)" in text
    assert "rank 0 has returned" in text and "rank 2 has returned" in text
    assert "rank 0 -> rank 1 (tag 1" in text


def test_large_blocking_sends_wait_for_the_receiver():
    def both_send_first(comm, size):
        other = 1 - comm.rank
        comm.send(np.zeros(size), other)
        return comm.recv(other).size

    assert World(2).run(both_send_first, 100) == [100, 100]  # 800 bytes: buffered
    with pytest.raises(DeadlockError, match=r"send\(dest=1, tag=0, 800000 bytes\).*eager limit"):
        World(2).run(both_send_first, 100_000)


def test_barrier_skipped_by_one_rank_is_a_deadlock():
    with pytest.raises(DeadlockError, match="barrier"):
        World(3).run(lambda comm: comm.barrier() if comm.rank else None)


def test_recv_from_a_rank_that_does_not_exist():
    with pytest.raises(ValueError, match=r"recv from rank 4, but this world has ranks 0\.\.3"):
        World(4).run(lambda comm: comm.recv(4))
    with pytest.raises(ValueError, match="send to rank -1"):
        World(2).run(lambda comm: comm.send(1, -1))


def test_sending_an_unpicklable_object_is_a_clear_error():
    def program(comm):
        if comm.rank == 0:
            comm.send(threading.Lock(), 1)
        else:
            comm.recv(0)

    with pytest.raises(TypeError, match=r"cannot send a lock to rank 1.*pickle"):
        World(2).run(program)


def test_an_exception_on_one_rank_stops_the_others():
    def program(comm):
        if comm.rank == 2:
            raise KeyError("boom")
        return comm.recv((comm.rank + 1) % 3)  # would wait forever

    with pytest.raises(KeyError, match="boom") as caught:
        World(3).run(program)
    assert any("rank 2" in note for note in caught.value.__notes__)


def test_trace_is_deterministic():
    def once():
        world = World(6)
        world.run(lambda comm: naive_allreduce(comm, np.ones(50)))
        return world.trace

    assert once() == once()


def test_message_timeline_draws_one_arrow_per_message():
    world = World(4)
    world.run(lambda comm: ring_allreduce(comm, np.ones(40)))
    fig = viz.message_timeline(world.trace, 4)
    ax = fig.axes[0]
    assert len(ax.texts) == len(world.trace) == 24
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
