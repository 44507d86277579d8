"""Exercise checks for chapter 08: from a measured alpha-beta fit to a DGX B200 prediction.

The check calls each answer on jobs of its own choosing (other fits, sizes, dtypes and numbers
of ranks) and names a known slip only when the answer gives that slip's results on every job.
The jobs are chosen so that no two slips give the same results (the tests assert it): one
number cannot tell apart, say, adding a link's other direction from counting bf16 gradients as
parameters (both halve a time), while a job in fp32 can."""

from __future__ import annotations

from ..costmodel import GPUS_PER_NODE, NCCL_ALPHA  # NCCL_ALPHA: the statement's DGX_STEP_LATENCY
from ._common import CheckFailed, Mistake, close, name_the_first, passed
from ._guard import borrowing_refused

# The DGX B200 of the exercise: 8 GPUs, each with 18 NVLink 5 links of 400 Gbit/s per
# direction through NVSwitch; NCCL's latency per ring step is an assumption (costmodel).
NVLINK5_LINKS, NVLINK5_LINK_GBIT = 18, 400
DGX_BUSBW = NVLINK5_LINKS * NVLINK5_LINK_GBIT * 1e9 / 8  # bytes/s in one direction: 900 GB/s
DGX_MODEL_PARAMS = 8.0e9  # a Llama-like 8B model

# An answer is a few float64 operations, each rounding by about 1e-16, so honest ways of writing
# it agree to 1e-14; 1e-6 also accepts constants written out (1.8e12 / 2 for 18 * 400e9 / 8).
# The slips' results differ from the right ones, and from each other's, by a ninth or more on
# some job (a bus bandwidth of 400 GB/s against 450 is the closest pair), so none passes or is
# taken for another.
RTOL = 1e-6


def _slip(name: str, results, message) -> Mistake:
    """A known slip, told by its results: seen when the answer gives, on every job the check
    runs it on, what ``results(*job, *context)`` gives (``context``: what the slip depends on
    beyond the job, such as the learner's own fit). ``seen.results`` is kept for the test that
    no two slips give the same results on the check's jobs."""
    def seen(jobs, got, *context):
        return all(close(value, results(*job, *context), RTOL, 0) for job, value in zip(jobs, got))

    seen.results = results
    return Mistake(name, seen, message)


def _size(dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ring(alpha, beta, n):
    """The reference: a fit t = alpha + beta S of a whole ring all-reduce on n ranks is
    2(n-1) steps of latency a and 2(n-1)/n S bytes through each link at bus bandwidth B."""
    steps = 2 * (n - 1)
    return alpha / steps, steps / n / beta


def _predict(num_params, itemsize, n, step_latency, busbw):
    steps = 2 * (n - 1)
    return steps * step_latency + steps / n * num_params * itemsize / busbw


def _number(value, call: str, unit: str = "seconds") -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckFailed(f"{call} {value!r}, not a number of {unit}") from None


def _pair(value, call: str) -> tuple[float, float]:
    try:
        a, b = value
        return float(a), float(b)
    except (TypeError, ValueError):
        raise CheckFailed(f"{call} returned {value!r}: return a pair (seconds per step, bus "
                          "bandwidth in bytes/s)") from None


def _name_the_slip(answer, reference, slips, jobs, show, otherwise: str, context=()) -> None:
    """Fail unless ``answer(*job)`` agrees with ``reference(*job)`` on every job: name the slip
    whose results are the answer's on every job, else say what is expected. ``show(job, got,
    want)`` tells the first job the answer gets wrong."""
    got = [answer(*job) for job in jobs]
    wrong = [(job, value) for job, value in zip(jobs, got) if not close(value, reference(*job), RTOL, 0)]
    if not wrong:
        return
    job, value = wrong[0]
    shown = f"{show(job, value, reference(*job))}: "
    name_the_first(slips, jobs, got, *context, before=shown)
    raise CheckFailed(shown + otherwise)


# Part 1, ring_from_fit(alpha, beta, n): its two numbers, each on every fit.
STEP_LATENCY_SLIPS = (
    _slip("alpha is not per step", lambda a, b, n: a,
          "the latency per step is alpha itself. alpha is the fixed cost of the "
          "whole all-reduce, and the ring's 2(N-1) steps each pay a share of it (hint 2)."),
    _slip("one pass of steps", lambda a, b, n: a / (n - 1),
          "you divided alpha by N-1, the steps of one pass around the ring; an "
          "all-reduce is a reduce-scatter and then an all-gather (hint 2)."),
)
BUS_BANDWIDTH_SLIPS = (
    _slip("algorithm bandwidth from the fit", lambda a, b, n: 1 / b,
          "1/beta is the algorithm bandwidth (bytes of the buffer per second), while "
          "each link carries 2(N-1)/N of the buffer in that time (hint 2). On 2 ranks "
          "the two are equal: your own fit could not show it."),
    _slip("bus factor upside down", lambda a, b, n: n / (2 * (n - 1)) / b,
          "the factor is upside down: each link carries more than the "
          "buffer once, so the bus bandwidth is above 1/beta (hint 2)."),
)


def _check_ring(ring_from_fit, fit, world_size) -> None:
    """Two made-up fits on more ranks, then the learner's own: on 2 ranks the bus factor
    2(N-1)/N and the steps' N-1 are 1, so the learner's fit alone cannot show them."""
    jobs = [(20e-6, 1 / 3e9, 4), (4e-6, 1 / 40e9, 8), (*fit, world_size)]

    def answer(a, b, n):
        return _pair(ring_from_fit(a, b, n), f"ring_from_fit({a:.3g}, {b:.3g}, {n})")

    def show(what, unit, scale):
        def begin(job, got, want):  # how a message about one of the pair begins
            a, b, n = job
            return (f"ring_from_fit(alpha={a:.3g} s, beta={b:.3g} s/B, {n} ranks): {what} {got / scale:.4g} "
                    f"{unit}, expected {want / scale:.4g} {unit}")
        return begin

    _name_the_slip(lambda *job: answer(*job)[0], lambda *job: _ring(*job)[0], STEP_LATENCY_SLIPS, jobs,
                   show("latency per step", "s", 1), "alpha over the ring's steps (hint 2).")
    _name_the_slip(lambda *job: answer(*job)[1], lambda *job: _ring(*job)[1], BUS_BANDWIDTH_SLIPS, jobs,
                   show("bus bandwidth", "GB/s", 1e9), "beta against the ring's factor of S (hint 2).")


# Part 2, predict_allreduce(num_params, grad_dtype, n, a, busbw): the latency with nothing to
# send, then the bytes with no latency, on 8 and 4 ranks and in bf16 and fp32.
LATENCY_SLIPS = (
    _slip("latency once", lambda p, d, n, a, bw: a,
          "the latency counts once; every one of the ring's 2(N-1) steps pays it "
          "(hint 3)."),
    _slip("latency of one pass", lambda p, d, n, a, bw: (n - 1) * a,
          "N-1 steps are one pass around the ring; an all-reduce is a "
          "reduce-scatter and then an all-gather (hint 3)."),
)
BYTES_SLIPS = (
    _slip("algorithm bandwidth in the prediction", lambda p, d, n, a, bw: p * _size(d) / bw,
          "that is the buffer sent once (algorithm bandwidth). At bus bandwidth each link carries 2(N-1)/N "
          "of the buffer (hint 3)."),
    _slip("bytes of one pass", lambda p, d, n, a, bw: (n - 1) / n * p * _size(d) / bw,
          "each link carries (N-1)/N of the buffer: one pass around the ring, but the reduce-scatter and the "
          "all-gather each make one (hint 3)."),
    _slip("whole buffer every step", lambda p, d, n, a, bw: 2 * (n - 1) * p * _size(d) / bw,
          "every one of the 2(N-1) steps sends the whole buffer; a step sends one chunk of it, 1/N (hint 3)."),
    _slip("parameters not bytes", lambda p, d, n, a, bw: 2 * (n - 1) / n * p / bw,
          "you counted parameters, not bytes: the message is the gradients' bytes (hints 1 and 2)."),
    _slip("always fp32", lambda p, d, n, a, bw: 2 * (n - 1) / n * p * 4 / bw,
          "you used 4 bytes per gradient whatever grad_dtype is; bf16 gradients are 2 bytes each (hint 2)."),
    _slip("bits for bytes in the prediction", lambda p, d, n, a, bw: 2 * (n - 1) / n * p * _size(d) * 8 / bw,
          "8 times too long: bits where bytes were meant (busbw is in bytes/s; hint 2)."),
)


def _check_prediction(predict_allreduce) -> None:
    import torch

    def answer(p, d, n, a, bw):
        return _number(predict_allreduce(p, d, n, a, bw), "predict_allreduce(...) returned")

    def reference(p, d, n, a, bw):
        return _predict(p, _size(d), n, a, bw)

    def show(job, got, want):
        p, d, n, a, bw = job
        return (f"predict_allreduce({p:.3g} parameters, {_name(d)}, {n} ranks, {a:.3g} s per step, "
                f"{bw / 1e9:.3g} GB/s) = {got:.4g} s, expected {want:.4g} s")

    latency = [(0, torch.bfloat16, n, 3e-6, 100e9) for n in (8, 4)]
    _name_the_slip(answer, reference, LATENCY_SLIPS, latency, show,
                   "with nothing to send only the steps' latency is left (hint 3).")
    nbytes = [(1e9, torch.bfloat16, 8, 0.0, 100e9), (1e9, torch.float32, 8, 0.0, 100e9),
              (1e9, torch.bfloat16, 4, 0.0, 100e9)]
    _name_the_slip(answer, reference, BYTES_SLIPS, nbytes, show,
                   "with no latency only the bytes through each link at busbw are left (hint 3).")


# Part 3: the node's bus bandwidth from its datasheet, one number.
DGX_BUSBW_SLIPS = (
    _slip("one NVLink", lambda: DGX_BUSBW / NVLINK5_LINKS,
          "18 times too small: one NVLink's bandwidth. A B200 has 18 links through NVSwitch and a ring uses "
          "all of them at once (hint 1)."),
    _slip("bits for bytes", lambda: DGX_BUSBW * 8,
          "8 times too large: 400 Gbit/s is in bits, busbw in bytes/s (hint 1)."),
    _slip("one link, in bits", lambda: NVLINK5_LINK_GBIT * 1e9,
          "one link's 400 Gbit/s, taken as bytes: a ring over NVSwitch "
          "uses all 18 links, and 400 Gbit/s is in bits (hint 1)."),
    _slip("both directions", lambda: DGX_BUSBW * 2,
          "twice too large: you added the other direction (like the headline 1.8 TB/s). "
          "400 Gbit/s is one direction of a link already; a ring sends and receives at "
          "once, so one direction bounds it (hint 1)."),
    _slip("a direction split in two", lambda: DGX_BUSBW / 2,
          "half of it: 400 Gbit/s is what a link carries in each direction; a "
          "ring's sending does not take from its receiving (hint 1)."),
)


def _check_busbw(dgx_busbw) -> None:
    if dgx_busbw is None:
        raise CheckFailed("dgx_busbw is None: set the DGX B200 node's bus bandwidth from its datasheet")
    busbw = _number(dgx_busbw, "dgx_busbw is", "bytes per second")
    # the expected value is not shown: finding it is the exercise
    _name_the_slip(lambda: busbw, lambda: DGX_BUSBW, DGX_BUSBW_SLIPS, [()],
                   lambda job, got, want: f"dgx_busbw = {got / 1e9:.4g} GB/s",
                   "not what bounds a GPU's ring traffic through NVSwitch (hint 1).")


def _node(p, d, n, size=None, latency=NCCL_ALPHA, busbw=DGX_BUSBW):
    """Part 2's prediction with the node's numbers, or with one of them changed."""
    return _predict(p, _size(d) if size is None else size, n, latency, busbw)


# dgx_allreduce_seconds(num_params, grad_dtype, gpus) with each known slip: each takes the job and
# the context (own_latency, own_busbw, world_size), the ring of the learner's fit on world_size ranks.
DGX_SLIPS = (
    _slip("fp32 gradients on the DGX", lambda p, d, n, *own: _node(p, d, n, size=4),
          "4 bytes per gradient whatever grad_dtype is: bf16 gradients are 2 bytes each (hint 2)."),
    _slip("bf16 whatever the dtype", lambda p, d, n, *own: _node(p, d, n, size=2),
          "bf16 whatever grad_dtype is: the function is asked for fp32 gradients too (hint 2)."),
    _slip("bytes passed as parameters", lambda p, d, n, *own: _node(p * _size(d), d, n),
          "the bytes are counted twice: predict_allreduce takes the number of parameters (hint 2)."),
    _slip("parameters not bytes on the DGX", lambda p, d, n, *own: _node(p, d, n, size=1),
          "you counted parameters, not bytes: the message is the gradients' bytes (hint 2)."),
    _slip("algorithm bandwidth on the DGX", lambda p, d, n, *own: 2 * (n - 1) * NCCL_ALPHA + p * _size(d) / DGX_BUSBW,
          "that is the buffer sent once (algorithm bandwidth); at bus bandwidth each link carries 2(N-1)/N of it "
          "(hint 2)."),
    _slip("always 8 GPUs", lambda p, d, n, *own: _node(p, d, 8),
          "the same on 4 GPUs as on 8: the ring has `gpus` ranks (hint 2)."),
    _slip("the measurement's world size", lambda p, d, n, latency, busbw, world_size: _node(p, d, world_size),
          lambda jobs, got, latency, busbw, world_size: f"a ring of {world_size} ranks whatever `gpus` is: the "
                                                         "number of ranks of your own measurement (hint 2)."),
    _slip("this machine's ring", lambda p, d, n, latency, busbw, world: _node(p, d, n, latency=latency, busbw=busbw),
          "that is this machine's ring, from your fit: the node's latency per step and bus bandwidth are its own "
          "(hint 2)."),
    _slip("this machine's latency", lambda p, d, n, latency, busbw, world: _node(p, d, n, latency=latency),
          "the latency per step is this machine's, from your fit: the node's is DGX_STEP_LATENCY (hint 2)."),
    _slip("the 8B model whatever", lambda p, d, n, *own: _node(DGX_MODEL_PARAMS, d, n),
          "the 8B model whatever num_params is (hint 2)."),
)


def _jobs(first: int, second: int) -> list:
    """Latency alone (0 parameters) on ``first`` and ``second`` ranks, then the 8B model in bf16 and
    fp32 on ``first`` and in bf16 on ``second``: each known slip changes one of these, each differently."""
    import torch

    return [(0, torch.bfloat16, first), (0, torch.bfloat16, second), (DGX_MODEL_PARAMS, torch.bfloat16, first),
            (DGX_MODEL_PARAMS, torch.float32, first), (DGX_MODEL_PARAMS, torch.bfloat16, second)]


def _timed(function, call: str, ranks: str):
    """(answer, show) for ``_name_the_slip`` of an answer ``function(num_params, grad_dtype, n)`` in seconds,
    ``n`` counting ``ranks`` (GPUs, nodes)."""
    def answer(p, d, n):
        return _number(function(p, d, n), f"{call}(...) returned")

    def show(job, got, want):
        p, d, n = job
        return (f"{call}({p:.3g} parameters, {_name(d)}, {n} {ranks}) = {got * 1e3:.4g} ms, "
                f"expected {want * 1e3:.4g} ms")
    return answer, show


def _course_times() -> tuple:
    """The cost model's collective times: the course's own answers to parts 2 to 4."""
    from .. import costmodel

    return costmodel.allreduce_time, costmodel.collective_time, costmodel.dp_comm_time


def _check_dgx(dgx_allreduce_seconds, own_ring, world_size) -> None:
    """The node's all-reduce on 8 and 4 GPUs (``_jobs``)."""
    answer, show = _timed(dgx_allreduce_seconds, "dgx_allreduce_seconds", "GPUs")
    jobs = _jobs(8, 4)
    _name_the_slip(answer, _node, DGX_SLIPS, jobs, show,
                   "the node's all-reduce is part 2's prediction with the node's numbers (hint 2).",
                   context=(*own_ring, world_size))


def check_dgx_prediction(ring_from_fit, predict_allreduce, dgx_busbw, dgx_allreduce_seconds, fit,
                         world_size) -> None:
    """Check the answers of chapter 08's exercise.

    ``ring_from_fit(alpha, beta, world_size)`` -> (seconds per ring step, bus bandwidth in
    bytes/s) of an all-reduce fit ``t = alpha + beta * bytes`` measured on ``world_size`` ranks;
    ``predict_allreduce(num_params, grad_dtype, world_size, step_latency, busbw)`` -> seconds
    of one ring all-reduce of the gradients; ``dgx_busbw``: a DGX B200 node's bus bandwidth;
    ``dgx_allreduce_seconds(num_params, grad_dtype, gpus)`` -> that all-reduce on ``gpus`` GPUs
    of the node. ``fit`` = (alpha, beta) the learner measured.
    """
    own_ring = _ring(*(float(v) for v in fit), world_size)
    try:
        with borrowing_refused("your answer", _course_times(), "Write the ring's time from its steps yourself.",
                               answers=[ring_from_fit, predict_allreduce, dgx_allreduce_seconds]):
            _check_ring(ring_from_fit, fit, world_size)
            _check_prediction(predict_allreduce)
            _check_busbw(dgx_busbw)
            _check_dgx(dgx_allreduce_seconds, own_ring, world_size)
    except NotImplementedError:
        raise CheckFailed("a function still raises NotImplementedError: write ring_from_fit, "
                          "predict_allreduce and dgx_allreduce_seconds first.") from None
    import torch

    model = _predict(DGX_MODEL_PARAMS, _size(torch.bfloat16), 8, NCCL_ALPHA, DGX_BUSBW)
    passed(f"ring parameters from your fit ({own_ring[0] * 1e6:.1f} us per step, {own_ring[1] / 1e9:.2f} GB/s "
           f"bus bandwidth), the prediction on 5 jobs and the DGX B200 node's on 5 more: the gradient "
           f"all-reduce of an 8B model in bf16 on its 8 GPUs takes {model * 1e3:.1f} ms")


# Part 4: an all-reduce over whole DGX nodes in two levels, by hand: a reduce-scatter inside each
# node over NVLink, an all-reduce of each GPU's eighth across the nodes over that GPU's own NIC
# (its rail), an all-gather inside each node.
IB_STEP_LATENCY = 5e-6  # seconds per ring step between nodes: the statement's assumption
IB_NIC_GBIT = 400  # one NDR NIC per GPU, per direction


def _two_level(p, d, nodes, *, size=None, inside=2, across_bytes=None, nic=IB_NIC_GBIT * 1e9 / 8,
               across_steps=None, across_latency=IB_STEP_LATENCY):
    """The reference (no keywords), or the time with one of its terms changed (a slip's)."""
    g, nbytes = GPUS_PER_NODE, p * (_size(d) if size is None else size)
    steps = 2 * (nodes - 1) if across_steps is None else across_steps(nodes)
    within = inside * ((g - 1) * NCCL_ALPHA + (g - 1) / g * nbytes / DGX_BUSBW)
    shard = nbytes / g if across_bytes is None else across_bytes
    return within + steps * across_latency + steps / nodes * shard / nic


TWO_LEVEL_SLIPS = (
    _slip("the whole buffer across the nodes", lambda p, d, n: _two_level(p, d, n, across_bytes=p * _size(d)),
          "the whole buffer crosses the network: after the reduce-scatter inside the node each GPU holds one "
          "eighth of the sum, and only that eighth travels on its rail (hint 1)."),
    # 8 NICs of 50 GB/s and one NIC's 400 Gbit/s read as bytes are the same 400 GB/s: one slip, both causes
    _slip("8 times too fast across the nodes", lambda p, d, n: _two_level(p, d, n, nic=IB_NIC_GBIT * 1e9),
          "each GPU's eighth crossed the network at 400 GB/s: either at all 8 NICs' bandwidth, where it travels "
          "on its own rail through one NIC while the others carry the other eighths, or at 400 Gbit/s read as "
          "bytes (hints 1 and 2)."),
    _slip("no all-gather", lambda p, d, n: _two_level(p, d, n, inside=1),
          "one pass inside the node: after the all-reduce across the nodes each GPU holds one eighth of the "
          "result, and the all-gather that hands it to the node's other GPUs takes as long as the reduce-scatter "
          "(hint 1)."),
    _slip("one pass across the nodes", lambda p, d, n: _two_level(p, d, n, across_steps=lambda k: k - 1),
          "the part across the nodes is an all-reduce of each eighth, a reduce-scatter and an all-gather of its "
          "own: two passes around the ring of nodes, not one (hint 2)."),
    _slip("the node's latency across the nodes", lambda p, d, n: _two_level(p, d, n, across_latency=NCCL_ALPHA),
          "the steps between the nodes paid NVLink's latency: a step through the network costs IB_STEP_LATENCY "
          "(hint 2)."),
)


def check_two_level_allreduce(two_level_allreduce_seconds) -> None:
    """``two_level_allreduce_seconds(num_params, grad_dtype, nodes)``: the seconds of a two-level
    all-reduce of the gradients over ``nodes`` DGX B200 nodes (reduce-scatter inside each node,
    all-reduce of each eighth across the nodes on its rail, all-gather inside each node)."""
    import torch

    from ..costmodel import group_bandwidth

    answer, show = _timed(two_level_allreduce_seconds, "two_level_allreduce_seconds", "nodes")
    try:
        with borrowing_refused("your answer", (*_course_times(), group_bandwidth),  # the rails' bandwidth too
                               "Write each level's time from its steps yourself.",
                               answers=[two_level_allreduce_seconds]):
            _name_the_slip(answer, _two_level, TWO_LEVEL_SLIPS, _jobs(2, 4), show,
                           "each level is a ring of its own: its steps' latency and each link's share of the bytes "
                           "that cross it, at that link's bandwidth (hint 2).")
    except NotImplementedError:
        raise CheckFailed("two_level_allreduce_seconds still raises NotImplementedError: write it first.") from None
    flat = _predict(DGX_MODEL_PARAMS, 2, 2 * GPUS_PER_NODE, IB_STEP_LATENCY, GPUS_PER_NODE * IB_NIC_GBIT * 1e9 / 8)
    passed(f"two levels on 5 jobs: the 8B model's bf16 gradients over 2 nodes take "
           f"{_two_level(DGX_MODEL_PARAMS, torch.bfloat16, 2) * 1e3:.1f} ms, against {flat * 1e3:.1f} ms for one "
           "ring over the 16 GPUs whose bytes cross the network on the 8 rails")
