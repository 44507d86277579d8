"""Exercise check for chapter 12, exercise 1: one step of ring attention in the streaming
form (a running maximum, normaliser and accumulator), run around a ring and probed alone."""

from __future__ import annotations

import functools
import importlib.util
import math

from ._common import CheckFailed, Mistake, launch_reports, name_the_first, passed

U = 2.0 ** -53  # float64's unit roundoff
# The probes below compare a handful of operations (a score, an exp, a product, a sum) on
# numbers of size at most e: each rounds by at most 2 ulp (exp) or 1 ulp, so 16 u of the
# largest value covers the learner's rounding and the check's own.
PROBE_RTOL = 16 * U


def load_merge_block(path):
    """The learner's merge_block, imported from its file (the harness imports the same file)."""
    spec = importlib.util.spec_from_file_location("ring_merge_under_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.merge_block


def attention(q, k, v, causal):
    """One process, the whole sequence: softmax(q k^T / sqrt(d)) v, masked above the diagonal."""
    import torch

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def ring_bound(q, k, v, world) -> float:
    """How far the ring's rows may lie from one process's, in float64 (derived in the statement):
    (6 S + 4 d kappa + (W + 1)(kappa + 4)) u max|v|, kappa the largest sum |q_l k_l| / sqrt(d)."""
    seq, d = q.shape[-2:]
    kappa = (q.abs() @ k.abs().transpose(-2, -1) / math.sqrt(d)).max().item()
    return (6 * seq + 4 * d * kappa + (world + 1) * (kappa + 4)) * U * v.abs().max().item()


def check_ring_attention(jobs: dict, merge_file) -> None:
    """Check merge_block (the learner's ``merge_file``) through ``jobs``: {world size: the
    launch of ring_check.py with check=False}. The rows the ranks computed must match one
    process's attention, without and with a causal mask; then probes of merge_block alone
    (a state and a block chosen so that each classic mistake shows) name what is wrong, and
    make sure a right ring did not hide a merge that overflows on large scores."""
    import torch

    gaps = {}
    for world, job in sorted(jobs.items()):
        reports = launch_reports(job, "merge_block")
        q, k, v = (reports[0][name] for name in ("q", "k", "v"))
        bound = ring_bound(q, k, v, world)
        for causal in (False, True):
            got = torch.full_like(q, float("nan"))  # a position no rank filled stays nan
            for rank in range(world):
                out = reports[rank]["out"][causal]
                if out.shape != got[:, reports[rank]["positions"]].shape:
                    raise CheckFailed(f"on {world} ranks rank {rank}'s output rows have shape {tuple(out.shape)}, "
                                      f"expected {tuple(got[:, reports[rank]['positions']].shape)} (heads, "
                                      "its queries, d): merge_block must return m and l shaped (heads, s_q) "
                                      "and acc shaped like q. See hint 1.")
                got[:, reports[rank]["positions"]] = out
            gap = (got - attention(q, k, v, causal)).abs().max().item()
            if not gap <= bound:  # nan fails too
                gaps[world, causal] = gap
    _probe(load_merge_block(merge_file))
    if gaps:
        (world, causal), gap = next(iter(gaps.items()))
        raise CheckFailed(f"merge_block: on {world} ranks, {'causal' if causal else 'without a mask'}, the "
                          f"ring's rows differ from one process's attention by up to {gap:.3g}, beyond the "
                          "rounding bound. The check's probes of one block found no classic mistake: "
                          "compare your state after two blocks with the formula in hint 2.")
    passed(f"ring attention with your merge_block matches one process on {', '.join(map(str, sorted(jobs)))} "
           "ranks, without and with a causal mask, and survives scores hundreds apart")


def _state(m, l, acc):
    import torch

    return tuple(torch.tensor(x, dtype=torch.float64) for x in (m, l, acc))


def _block(scores, values, q_pos=None, k_pos=None):
    """One head, one query row per entry of ``scores`` (a list of rows), d = 4: q and k made
    so that q k^T / sqrt(4) is exactly ``scores``; values one row per key."""
    import torch

    scores = torch.tensor(scores, dtype=torch.float64)
    rows, keys = scores.shape
    q = torch.zeros(1, rows, 4, dtype=torch.float64)
    q[0, :, :keys] = 2 * scores  # k = the first unit vectors: q . k_j / sqrt(4) = scores[:, j]
    k = torch.eye(4, dtype=torch.float64)[:keys].unsqueeze(0)
    v = torch.tensor(values, dtype=torch.float64).unsqueeze(0)
    q_pos = torch.arange(rows) if q_pos is None else torch.tensor(q_pos)
    k_pos = torch.arange(keys) if k_pos is None else torch.tensor(k_pos)
    return q, k, v, q_pos, k_pos


def _same(got, want) -> bool:
    import torch

    got, want = torch.as_tensor(got).double(), torch.as_tensor(want, dtype=torch.float64)
    return (got.shape == want.shape and bool(torch.isfinite(got).all())
            and torch.allclose(got, want, rtol=PROBE_RTOL, atol=0))


class _Probe:
    """merge_block on the check's small hand-made cases (one head, d = 4), each case run once,
    when a mistake of the table first asks for it: the table's order is the cases' order, so
    a case runs only when the ones before it showed nothing."""

    def __init__(self, merge_block):
        self.merge_block = merge_block

    def run(self, state, block, causal=False):
        try:
            m, l, acc = self.merge_block(*state, *block, causal)
        except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
            if isinstance(error, NotImplementedError):
                raise CheckFailed("merge_block is not written yet: it raises NotImplementedError.") from None
            raise CheckFailed(f"merge_block raised {type(error).__name__}: {error} on a block of one head, "
                              "one query and two keys (see the traceback above). See hint 1.") from None
        return m, l, acc

    @functools.cached_property
    def first_block(self):
        """Scores must be q.k / sqrt(d), m the largest score: state empty, scores 2 and 0."""
        return self.run(_state([[-math.inf]], [[0.0]], [[[0.0] * 4]]),
                        _block([[2.0, 0.0]], [[1, 0, 0, 0], [0, 1, 0, 0]]))

    @functools.cached_property
    def carried(self):
        """The maximum carried: m = 800 from earlier blocks, then a block of scores 0."""
        return self.run(_state([[800.0]], [[1.0]], [[[1, 0, 0, 0]]]),
                        _block([[0.0, 0.0]], [[0, 1, 0, 0], [0, 0, 1, 0]]))

    @functools.cached_property
    def updated(self):
        """The maximum updated: m = 0, then a block whose score is 800."""
        return self.run(_state([[0.0]], [[1.0]], [[[1, 0, 0, 0]]]), _block([[800.0]], [[0, 1, 0, 0]]))

    @functools.cached_property
    def rescaled(self):
        """The old sums rescaled: state m = 0, l = 1, acc = v0; one key with score 2 and value v1."""
        return self.run(_state([[0.0]], [[1.0]], [[[1, 0, 0, 0]]]), _block([[2.0]], [[0, 1, 0, 0]]))

    @functools.cached_property
    def keys_used(self):
        """The causal mask on global positions: queries at 5 and 7, keys at 4..7, all scores 0, so
        acc (with one-hot values) shows which keys each query used: a list per query, or None."""
        import torch

        _, _, acc = self.run(_state([[-math.inf] * 2], [[0.0] * 2], [[[0.0] * 4] * 2]),
                             _block([[0.0] * 4] * 2, torch.eye(4).tolist(), q_pos=[5, 7], k_pos=[4, 5, 6, 7]),
                             causal=True)
        return acc[0].round().int().tolist() if torch.isfinite(acc).all() else None

    def masked_as(self, rule) -> bool:
        """Whether the keys each query used are those ``rule`` (a comparison of key and query
        positions, global or local) lets through."""
        import torch

        q_at, k_at = torch.tensor([5, 7]), torch.tensor([4, 5, 6, 7])
        masks = {"causal": k_at[None, :] <= q_at[:, None], "none": torch.ones(2, 4, dtype=torch.bool),
                 "local": torch.arange(4)[None, :] <= torch.arange(2)[:, None],
                 "reversed": k_at[None, :] >= q_at[:, None], "diagonal": k_at[None, :] < q_at[:, None]}
        return self.keys_used == masks[rule].int().tolist()


E = math.e
# The classic mistakes, in the order of the probe's cases (a mistake asks for its case).
MERGE_MISTAKES = (
    Mistake("scores not scaled", lambda p: _same(p.first_block[0], [[4.0]]),
            "the scores are not scaled: with q.k = 4 and d = 4 the score is q.k / sqrt(d) = 2, and m became 4. "
            "See hint 1."),
    Mistake("m not the largest score", lambda p: not _same(p.first_block[0], [[2.0]]),
            lambda p: f"after a first block with scores 2 and 0, m is {p.first_block[0].item():.6g}: it must be the "
                      "largest score seen so far (2), not a log-sum-exp or a running sum. See hint 1."),
    Mistake("maximum not carried", lambda p: not (_same(p.carried[0], [[800.0]]) and _same(p.carried[1], [[1.0]])),
            lambda p: f"the maximum is not carried: with m = 800 from the blocks before and scores of 0 in this one, "
                      f"the new m is {p.carried[0].item():.6g} and l is {p.carried[1].item():.6g} (expected 800 and "
                      "1): exp overflows as soon as the old scores exceed this block's by about 709, and a row that "
                      "sees no key of a block meets exp(-inf - (-inf)). See hint 2."),
    Mistake("maximum not updated", lambda p: not _same(p.updated[0], [[800.0]]),
            lambda p: "the maximum is not updated with this block's scores: m = 0 so far, a score of 800 arrives, "
                      f"and the new m is {p.updated[0].item():.6g}. exp(800 - 0) overflows. See hint 2."),
    Mistake("normaliser not rescaled", lambda p: not _same(p.rescaled[1], [[1 / E ** 2 + 1]]),
            lambda p: "the normaliser is not rescaled: with l = 1 measured against m = 0 and a new key of score 2, "
                      f"l against the new m = 2 is exp(-2) + 1, and yours is {p.rescaled[1].item():.6g}"
                      + (" (the old l plus this block's 1)" if _same(p.rescaled[1], [[2.0]]) else "")
                      + ". See hint 2."),
    Mistake("accumulator not rescaled", lambda p: not _same(p.rescaled[2], [[[1 / E ** 2, 1, 0, 0]]]),
            lambda p: "the accumulator is not rescaled like l: expected exp(-2) v0 + v1 = [0.135, 1, 0, 0], got "
                      f"{[round(x, 3) for x in p.rescaled[2].flatten().tolist()]}. See hint 2."),
    Mistake("causal mask ignored", lambda p: p.masked_as("none"),
            "the causal mask is not applied: the query at position 5 used the keys at 6 and 7. See hint 3."),
    Mistake("mask on local indices", lambda p: p.masked_as("local"),
            "the causal mask compares local indices, not global positions: the queries at positions 5, 7 and the "
            "keys at 4..7 were masked as if both started at 0, so the query at 5 used only the key at 4. See "
            "hint 3."),
    Mistake("mask reversed", lambda p: p.masked_as("reversed"),
            "the causal mask is reversed: the query at position 5 used the keys at 5, 6, 7 and not 4. See hint 3."),
    Mistake("diagonal masked", lambda p: p.masked_as("diagonal"),
            "the causal mask hides the diagonal: the query at position 5 did not use the key at 5, its own "
            "position. See hint 3."),
)


def _probe(merge_block) -> None:
    """Fail with the first classic mistake merge_block shows on the probe's cases, if any."""
    p = _Probe(merge_block)
    m, l, acc = p.first_block
    if m.shape != (1, 1) or l.shape != (1, 1) or acc.shape != (1, 1, 4):
        raise CheckFailed(f"merge_block: on one head, one query and two keys it returned shapes {tuple(m.shape)}, "
                          f"{tuple(l.shape)}, {tuple(acc.shape)}; expected (1, 1), (1, 1), (1, 1, 4). See hint 1.")
    name_the_first(MERGE_MISTAKES, p, before="merge_block: ")
    if not p.masked_as("causal"):
        raise CheckFailed(f"merge_block: with queries at positions 5, 7 and keys at 4..7, the keys each query used "
                          f"are {p.keys_used} (1 = used; expected [[1, 1, 0, 0], [1, 1, 1, 1]]). See hint 3.")
