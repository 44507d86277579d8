"""Exercise checks for chapter 08: from a measured alpha-beta fit to a DGX B200 prediction."""

from __future__ import annotations

from ._common import CheckFailed, close, passed

# The DGX B200 of the exercise: 8 GPUs, each with 18 NVLink 5 links of 400 Gbit/s per
# direction through NVSwitch; NCCL's latency per ring step is an assumption (costmodel).
DGX_GPUS, NVLINK5_LINKS, NVLINK5_LINK_GBIT = 8, 18, 400
DGX_MODEL_PARAMS = 8.0e9  # a Llama-like 8B model, bf16 gradients


def _ring(alpha, beta, n):
    """The reference: a fit t = alpha + beta S of a whole ring all-reduce on n ranks is
    2(n-1) steps of latency a and 2(n-1)/n S bytes through each link at bus bandwidth B."""
    steps = 2 * (n - 1)
    return alpha / steps, steps / n / beta


def _predict(num_params, itemsize, n, step_latency, busbw):
    steps = 2 * (n - 1)
    return steps * step_latency + steps / n * num_params * itemsize / busbw


def _pair(value, what):
    try:
        a, b = value
        return float(a), float(b)
    except (TypeError, ValueError):
        raise CheckFailed(f"{what} returned {value!r}: return a pair (seconds per step, bus "
                          "bandwidth in bytes/s)") from None


def check_dgx_prediction(ring_from_fit, predict_allreduce, dgx_seconds, fit, world_size) -> None:
    """Check the three answers of chapter 08's exercise.

    ``ring_from_fit(alpha, beta, world_size)`` -> (seconds per ring step, bus bandwidth in
    bytes/s) of an all-reduce fit ``t = alpha + beta * bytes`` measured on ``world_size`` ranks;
    ``predict_allreduce(num_params, grad_dtype, world_size, step_latency, busbw)`` -> seconds
    of one ring all-reduce of the gradients; ``dgx_seconds``: that prediction for the 8B
    model in bf16 on one DGX B200 node. ``fit`` = (alpha, beta) the learner measured.
    """
    try:
        _check(ring_from_fit, predict_allreduce, dgx_seconds, fit, world_size)
    except NotImplementedError:
        raise CheckFailed("a function still raises NotImplementedError: write ring_from_fit and "
                          "predict_allreduce first.") from None


def _check(ring_from_fit, predict_allreduce, dgx_seconds, fit, world_size) -> None:
    import torch

    alpha, beta = (float(v) for v in fit)
    # --- 1. two made-up fits on more ranks, then the learner's own (on 2 ranks the bus
    # factor 2(n-1)/n and the steps' N-1 are 1: the learner's fit cannot tell those apart) ---
    for a, b, n in [(20e-6, 1 / 3e9, 4), (4e-6, 1 / 40e9, 8), (alpha, beta, world_size)]:
        got_latency, got_busbw = _pair(ring_from_fit(a, b, n), f"ring_from_fit({a:.3g}, {b:.3g}, {n})")
        want_latency, want_busbw = _ring(a, b, n)
        where = f"ring_from_fit(alpha={a:.3g} s, beta={b:.3g} s/B, {n} ranks)"
        if not close(got_latency, want_latency, rtol=1e-6, atol=0):
            if close(got_latency, a, rtol=1e-6, atol=0):
                raise CheckFailed(f"{where}: the latency per step is alpha itself. alpha is the fixed "
                                  f"cost of the whole all-reduce, and a ring all-reduce makes 2(N-1) = "
                                  f"{2 * (n - 1)} steps that each pay the latency: divide by 2(N-1).")
            if close(got_latency, a / (n - 1), rtol=1e-6, atol=0):
                raise CheckFailed(f"{where}: you divided alpha by N-1, the steps of one pass around the "
                                  "ring; an all-reduce is a reduce-scatter and an all-gather: 2(N-1) steps.")
            raise CheckFailed(f"{where}: latency per step {got_latency:.4g} s, expected {want_latency:.4g} s "
                              "(alpha over the ring's 2(N-1) steps).")
        if not close(got_busbw, want_busbw, rtol=1e-6, atol=0):
            algbw = 1 / b
            if close(got_busbw, algbw, rtol=1e-6, atol=0):
                raise CheckFailed(f"{where}: 1/beta = {algbw / 1e9:.4g} GB/s is the algorithm bandwidth "
                                  "(bytes of the buffer per second). Each link carries 2(N-1)/N of the "
                                  f"buffer, so the bus bandwidth is 2(N-1)/N / beta = {want_busbw / 1e9:.4g} "
                                  "GB/s. (On 2 ranks the factor is 1: your own fit could not show it.)")
            if close(got_busbw, algbw * algbw / want_busbw, rtol=1e-6, atol=0):
                raise CheckFailed(f"{where}: the factor is upside down: busbw = algbw x 2(N-1)/N "
                                  "(each link carries more than the buffer once).")
            raise CheckFailed(f"{where}: bus bandwidth {got_busbw / 1e9:.4g} GB/s, expected "
                              f"{want_busbw / 1e9:.4g} GB/s (2(N-1)/N / beta).")

    # --- 2. the prediction: latency alone (no bytes), then bandwidth alone (no latency) ---
    for dtype in (torch.bfloat16, torch.float32):
        itemsize = torch.tensor([], dtype=dtype).element_size()
        for n in (2, 8):
            got = predict_allreduce(0, dtype, n, 3e-6, 100e9)
            if got is None:
                raise CheckFailed("predict_allreduce(...) returned None: return the time in seconds")
            got, want = float(got), _predict(0, itemsize, n, 3e-6, 100e9)
            if not close(got, want, rtol=1e-6, atol=0):
                if close(got, 3e-6, rtol=1e-6, atol=0):
                    raise CheckFailed(f"predict_allreduce on {n} ranks: the latency counts once ({got:.3g} s); "
                                      f"every one of the ring's 2(N-1) = {2 * (n - 1)} steps pays it: "
                                      "2(N-1) x step_latency.")
                raise CheckFailed(f"predict_allreduce(0 parameters, {n} ranks, 3e-6 s per step) = {got:.4g} s: "
                                  f"with nothing to send only the latency is left, {want:.4g} s.")
            got = float(predict_allreduce(1e9, dtype, n, 0.0, 100e9))
            want = _predict(1e9, itemsize, n, 0.0, 100e9)
            if close(got, want, rtol=1e-6, atol=0):
                continue
            where = (f"predict_allreduce(1e9 parameters, {str(dtype).replace('torch.', '')}, {n} ranks, "
                     f"no latency, 100 GB/s) = {got:.4g} s, expected {want:.4g} s: ")
            if n > 2 and close(got, want * n / (2 * (n - 1)), rtol=1e-6, atol=0):
                raise CheckFailed(where + "that is the buffer sent once (algorithm bandwidth). At bus "
                                  "bandwidth every link carries 2(N-1)/N of the buffer: multiply by it.")
            if close(got, want / itemsize, rtol=1e-6, atol=0):
                raise CheckFailed(where + "you counted parameters, not bytes: multiply by the bytes of "
                                  "one gradient element (grad_dtype's element size).")
            if close(got, want * 4 / itemsize, rtol=1e-6, atol=0):
                raise CheckFailed(where + "you used 4 bytes per gradient whatever grad_dtype is; bf16 "
                                  "gradients are 2 bytes each (torch.tensor([], dtype=...).element_size()).")
            if close(got, want * 8, rtol=1e-6, atol=0):
                raise CheckFailed(where + "8 times too long: bits where bytes were meant. busbw is in bytes/s.")
            raise CheckFailed(where + "2(N-1)/N x num_params x bytes per element / busbw.")

    # --- 3. the DGX B200 node, from its datasheet ---
    from ..costmodel import NCCL_ALPHA

    if dgx_seconds is None:
        raise CheckFailed("dgx_seconds is None: compute the prediction for the DGX B200 node")
    busbw = NVLINK5_LINKS * NVLINK5_LINK_GBIT * 1e9 / 8
    want = _predict(DGX_MODEL_PARAMS, 2, DGX_GPUS, NCCL_ALPHA, busbw)
    latency = 2 * (DGX_GPUS - 1) * NCCL_ALPHA
    ratio = (float(dgx_seconds) - latency) / (want - latency)  # of the bandwidth terms
    where = f"dgx_seconds = {float(dgx_seconds) * 1e3:.4g} ms, expected {want * 1e3:.4g} ms: "
    if close(ratio, 1.0, rtol=1e-4, atol=0):
        passed(f"ring parameters from your fit ({_ring(alpha, beta, world_size)[0] * 1e6:.1f} us per step, "
               f"{_ring(alpha, beta, world_size)[1] / 1e9:.2f} GB/s bus bandwidth) and the all-reduce of "
               f"an 8B model's bf16 gradients on a DGX B200 node: {want * 1e3:.1f} ms")
        return
    mistakes = [
        (NVLINK5_LINKS, "18 times too long: that is one NVLink's bandwidth. A B200 has 18 links through "
                        "NVSwitch and a ring uses all of them at once: busbw = 18 x one link."),
        (1 / 8, "8 times too short: 400 Gbit/s is in bits. Divide by 8 for bytes: 50 GB/s per link "
                "per direction."),
        (8 * NVLINK5_LINKS, "144 = 8 x 18 times too long: one link, and in bits."),
        (2.0, "twice too long: the gradients are bf16, 2 bytes each, not 4 (fp32)."),
        (0.5, "half what it should be: 400 Gbit/s is one direction of a link already; a ring sends "
              "and receives at once, so don't add the other direction."),
        (DGX_GPUS / (2 * (DGX_GPUS - 1)), "that is the buffer sent once (algorithm bandwidth): each "
                                          "link carries 2(N-1)/N of it."),
    ]
    for factor, message in mistakes:
        if close(ratio, factor, rtol=1e-3, atol=0):
            raise CheckFailed(where + message)
    raise CheckFailed(where + "predict_allreduce(8.0e9, torch.bfloat16, 8, DGX_STEP_LATENCY, busbw) with "
                      "busbw = 18 links x 400 Gbit/s / 8 bits per byte.")
