"""Exercise checks for chapter 08: communication and hardware."""

from __future__ import annotations

from ._common import CheckFailed, close, passed


_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def check_bus_factor(bus_factor, world_sizes=(2, 3, 4, 8, 64)) -> None:
    """Check ``bus_factor(op, world_size)`` (busbw / algbw) against the factors nccl-tests uses."""
    from ..costmodel import BUS_FACTORS

    for op in _COLLECTIVES:
        for n in world_sizes:
            got, want = bus_factor(op, n), BUS_FACTORS[op](n)
            if got is None:
                raise CheckFailed(f"bus_factor({op!r}, {n}) returned None: return the factor as a number")
            if close(got, want):
                continue
            where = f"bus_factor({op!r}, {n}) = {float(got):.4g}, expected {want:.4g}: "
            if op == "all_reduce" and close(got, (n - 1) / n):
                raise CheckFailed(where + "the factor 2 is missing. A ring all-reduce is a reduce-scatter "
                                  "followed by an all-gather, and each sends (n-1)/n of the buffer: 2(n-1)/n.")
            if op in ("all_gather", "reduce_scatter") and close(got, 2 * (n - 1) / n):
                raise CheckFailed(where + f"that is all-reduce's factor. A {op} alone is one half of an "
                                  "all-reduce: each rank sends (n-1)/n of the buffer.")
            if op == "broadcast" and close(got, (n - 1) / n):
                raise CheckFailed(where + "a broadcast passes the whole buffer along every link of the "
                                  "chain (pipelined in chunks): every link carries all of it, factor 1.")
            if close(got, 1.0):
                raise CheckFailed(where + "busbw equals algbw only for broadcast (and reduce). For the "
                                  "others count what each rank's link carries in a ring, as a share of "
                                  "the buffer: (n-1)/n per pass over the ring.")
            if want and close(got, 1 / want):
                raise CheckFailed(where + "the factor is upside down: busbw = algbw * factor, and the "
                                  "factor is the share of the buffer each link carries, e.g. 2(n-1)/n.")
            if close(got, want * n):
                raise CheckFailed(where + "n times too big: in a ring the buffer is cut into n chunks, so "
                                  "each step sends 1/n of it; divide by n.")
            raise CheckFailed(where + "count the bytes each rank sends in a ring as a share of the buffer "
                              "(all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1).")
    passed(f"bus bandwidth factors of {', '.join(_COLLECTIVES)} for n = {', '.join(map(str, world_sizes))}")


def check_allreduce_prediction(predict) -> None:
    """Check ``predict(num_params, world_size, bidir_bandwidth, bytes_per_param, alpha)``:
    seconds of a ring all-reduce of the gradients (``costmodel.allreduce_time``, ring,
    with beta = 1 / (bidir_bandwidth / 2))."""
    from ..costmodel import NVLINK5_BIDIR, PCIE5_X16_BIDIR, allreduce_time

    # (params, ranks, bidirectional bytes/s, bytes per parameter, alpha)
    cases = [(7e9, 8, NVLINK5_BIDIR, 2, 0.0), (1e9, 4, PCIE5_X16_BIDIR, 4, 0.0),
             (70e9, 2, PCIE5_X16_BIDIR, 2, 0.0), (1e6, 8, NVLINK5_BIDIR, 2, 5e-6)]
    ratios = []
    for p, n, bidir, b, alpha in cases:
        want = allreduce_time(p * b, n, "ring", alpha, 2 / bidir)
        got = predict(p, n, bidir, b, alpha)
        if got is None:
            raise CheckFailed("predict(...) returned None: return the time in seconds")
        ratios.append((float(got) / want, p, n, b, alpha, want, float(got)))
    if all(close(r, 1.0, rtol=1e-4) for r, *_ in ratios):
        passed("ring all-reduce times of gradients on NVLink 5 and PCIe Gen 5")
        return
    no_latency = [x for x in ratios if x[4] == 0]

    def all_near(values):
        return all(close(got, expect, rtol=1e-3) for got, expect in values)

    if all_near([(r, 1 / b) for r, _, _, b, *_ in no_latency]):
        raise CheckFailed("the time is too small by the bytes per parameter: you counted parameters, "
                          "not bytes. The message is num_params * bytes_per_param bytes (2 for bf16).")
    if all_near([(r, 0.5) for r, *_ in no_latency]):
        raise CheckFailed("the time is half what it should be. Either you used the bidirectional figure "
                          "as the speed of one direction (a ring sends and receives at once: each "
                          "direction carries bidir / 2), or you left out the 2 in 2(N-1)/N (a ring "
                          "all-reduce is a reduce-scatter plus an all-gather).")
    if all_near([(r, n / (2 * (n - 1))) for r, _, n, *_ in no_latency]):
        raise CheckFailed("the time is that of sending the whole buffer once (algbw): a ring all-reduce "
                          "pushes 2(N-1)/N of it through each rank's link.")
    if all_near([(r, n / (n - 1)) for r, _, n, *_ in no_latency]):
        raise CheckFailed("you used 2 instead of 2(N-1)/N: each of the 2(N-1) steps sends only 1/N of the "
                          "buffer.")
    if all_near([(r, 1e3) for r, *_ in ratios]) or all_near([(r, 1e6) for r, *_ in ratios]):
        raise CheckFailed("the time is in milliseconds or microseconds: return seconds.")
    if all(close(r, 1.0, rtol=1e-4) for r, *_ in no_latency):
        _, p, n, b, alpha, want, got = ratios[-1]
        raise CheckFailed(f"right without latency, wrong with alpha = {alpha:g} s ({got:.4g} s instead of "
                          f"{want:.4g} s): every one of the ring's 2(N-1) steps pays alpha once.")
    _, p, n, b, alpha, want, got = next(x for x in ratios if not close(x[0], 1.0, rtol=1e-4))
    raise CheckFailed(f"predict({p:g}, {n}, ..., {b}, {alpha:g}) = {got:.4g} s, expected {want:.4g} s: "
                      "2(N-1) * (alpha + S / N / B) with S the bytes and B = bidir / 2.")
