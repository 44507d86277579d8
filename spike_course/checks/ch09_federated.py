"""Exercise checks for chapter 09: federated learning."""

from __future__ import annotations

from ._common import CheckFailed, Mistake, launch_reports, name_the_first, passed

U32 = 2.0 ** -24  # float32's unit roundoff


def _combine(states, weights):
    """sum_k weights[k] * states[k] per entry, in float64, skipping the sites whose weight is 0
    (their tensors may be NaN: 0 * NaN would be NaN), and the bound on a float32 computation of
    it: gamma_m * sum_k |weights[k]| |states[k]|, with m = the number of ranks + 2."""
    import torch

    m = len(states) + 2
    gamma = m * U32 / (1 - m * U32)
    value, bound = {}, {}
    for name in states[0]:
        terms = [(float(c), torch.as_tensor(s[name]).double()) for c, s in zip(weights, states) if c]
        value[name] = sum(c * t for c, t in terms)
        bound[name] = gamma * sum(abs(c) * t.abs() for c, t in terms)
    return value, bound


def _holds(after: dict, candidate) -> bool:
    """True when every tensor of ``after`` lies within the float32 bound of ``candidate``."""
    import torch

    value, bound = candidate
    return all(name in after and torch.as_tensor(after[name]).shape == value[name].shape
               and bool(((torch.as_tensor(after[name]).double() - value[name]).abs() <= bound[name]).all())
               for name in value)


def _finite(state: dict) -> bool:
    import torch

    return all(bool(torch.isfinite(torch.as_tensor(t)).all()) for t in state.values())


def check_fedavg(job) -> None:
    """Check FedAvg's aggregation over the sites that took part in a round, with one collective.

    ``job`` is the launch of ``fedavg_exercise.py`` (``launch(..., check=False)``, so that a
    blank exercise reaches this check) or its reports {rank: report}. Each rank reports
    ``"rounds"``, one dict per round: ``"before"`` and ``"after"`` (its parameters, name ->
    tensor, around the call), ``"samples"`` (its n_k), ``"took_part"`` and ``"collectives"``
    (``CommDebugMode.get_total_counts()`` of the call).

    After every round every rank, present or not, must hold sum_{k present} n_k w_k / sum_{k
    present} n_k, computed here in float64 from the float32 ``before``. The tolerance is the
    standard bound on a float32 sum of products: each site's term is rounded once or twice
    (n_k w_k, or a share n_k / n times w_k), the N-site sum adds N - 1 roundings, the division
    one more; so |result - exact| <= gamma_{N+2} sum_k (n_k / n) |w_k|, gamma_m = m u / (1 - m u),
    u = 2^-24, element by element. A wrong weight or a site wrongly counted moves the result by
    a share of the parameters themselves, far outside that bound.
    """
    ranks = launch_reports(job, "fedavg_")
    order = sorted(ranks)
    if any("rounds" not in ranks[r] for r in order):
        raise CheckFailed("a rank did not report its rounds: run the worker as given, with only fedavg_ changed.")
    n = len(order)
    rounds = [[ranks[r]["rounds"][i] for r in order] for i in range(len(ranks[order[0]]["rounds"]))]
    for number, sites in enumerate(rounds, 1):
        _check_round(number, sites, n)
    tensors = len(rounds[0][0]["before"])
    counts = [site["collectives"] for sites in rounds for site in sites]
    right_but = "every rank holds the right model after every round, but "
    name_the_first(COLLECTIVE_MISTAKES, counts, tensors, before=right_but)
    if max(counts) > 1:
        raise CheckFailed(right_but + f"a call made {max(counts)} collectives. " + ONE_COLLECTIVE)
    if min(counts) < 1:
        raise CheckFailed("a rank made no collective in a round, yet holds the right model: the harness was "
                          "changed, or fedavg_ found the other sites' parameters by other means. Run the worker "
                          "as given.")
    samples = [site["samples"] for site in rounds[0]]
    passed(f"after each of {len(rounds)} rounds all {n} sites hold the mean over the sites present, weighted by "
           f"n_k = {samples} (stale and NaN parameters of absent sites left out), with one collective per call")


class _Round:
    """One round as the ranks reported it: each site's parameters before and after the call,
    its samples and whether it took part; and what each candidate aggregate would have given."""

    def __init__(self, number: int, sites: list, n: int):
        self.n, self.before, self.after = n, [site["before"] for site in sites], [site["after"] for site in sites]
        self.samples = [float(site["samples"]) for site in sites]
        self.present = [bool(site["took_part"]) for site in sites]
        self.absent = [k for k in range(n) if not self.present[k]]
        self.total = sum(m for m, p in zip(self.samples, self.present) if p)
        self.everyone = sum(self.samples)
        self.ok = [_holds(a, _combine(self.before, [m / self.total if p else 0.0
                                                    for m, p in zip(self.samples, self.present)]))
                   for a in self.after]
        self.wrong = [k for k in range(n) if not self.ok[k]]
        self.where = (f"after round {number} (sites present: {[k for k in range(n) if self.present[k]]}, "
                      f"n_k = {[site['samples'] for site in sites]})")

    def matches(self, weights) -> bool:
        """Every rank holds sum_k weights[k] w_k."""
        return all(_holds(a, _combine(self.before, weights)) for a in self.after)

    def unchanged(self, k) -> bool:
        return _holds(self.after[k], (self.before[k], {name: 0 * v for name, v in self.before[k].items()}))

    @property
    def missing(self) -> list[str]:
        return sorted({name for a in self.after for name in self.before[0] if name not in a})

    @property
    def not_finite(self) -> list[int]:
        return [k for k in range(self.n) if not _finite(self.after[k])]

    @property
    def diverged(self) -> list[int]:
        """The absent sites whose parameters were not finite (their training diverged)."""
        return [k for k in self.absent if not _finite(self.before[k])]


# A wrong aggregate, told by what the ranks hold instead (readings: the round).
ROUND_MISTAKES = (
    Mistake("a parameter left out", lambda r: bool(r.missing),
            lambda r: f"the parameters {r.missing} are missing: every parameter of the model is part of the global "
                      "model."),
    Mistake("absent site times zero", lambda r: bool(r.not_finite and r.diverged),
            lambda r: f"rank(s) {r.not_finite} hold NaN or inf. Site(s) {r.diverged} sat out with non-finite "
                      "parameters (their training diverged) and these reached the result: a weight of zero does not "
                      "remove a NaN, 0 * NaN is NaN. See Hint 1."),
    Mistake("division by zero", lambda r: bool(r.not_finite),
            lambda r: f"rank(s) {r.not_finite} hold NaN or inf although no site's parameters did: a division by a "
                      "sum that came out zero? See Hint 1."),
    Mistake("result never reached the parameters", lambda r: all(r.unchanged(k) for k in range(r.n)),
            "no rank's parameters changed: the result of the collective never reached the model's parameters (a "
            "collective works in place on the tensor it is given). See Hint 2."),
    Mistake("absent sites keep their own",
            lambda r: all(r.ok[k] for k in range(r.n) if r.present[k]) and all(r.unchanged(k) for k in r.absent),
            lambda r: f"the sites present hold the new global model, but site(s) {r.absent}, which sat out, still "
                      "hold their own parameters: every site starts the next round from the new global model. See "
                      "Hint 1."),
    Mistake("absent sites averaged in",
            lambda r: bool(r.absent) and all(_finite(b) for b in r.before)
            and r.matches([m / r.everyone for m in r.samples]),
            lambda r: f"every rank holds the weighted mean over all {r.n} sites: site(s) {r.absent} sat out this "
                      "round and were averaged in all the same, with their n_k. A site that did not take part "
                      "counts for nothing. See Hint 1."),
    Mistake("weights not renormalised",
            lambda r: bool(r.absent)
            and r.matches([m / r.everyone if p else 0.0 for m, p in zip(r.samples, r.present)]),
            lambda r: f"each site present is weighted by n_k / {r.everyone:g}, its share of ALL sites' samples, so "
                      f"the weights add up to {r.total / r.everyone:.2f}, not 1, and the model shrinks towards zero. "
                      "The samples that count are those of the sites present. See Hint 1."),
    Mistake("unweighted mean", lambda r: r.matches([1 / sum(r.present) if p else 0.0 for p in r.present]),
            "every rank holds the plain, unweighted mean of the sites present: FedAvg weights each site by its "
            "number of samples. See Hint 1."),
    Mistake("not divided by the samples", lambda r: r.matches([m if p else 0.0 for m, p in zip(r.samples, r.present)]),
            "every rank holds the sum of n_k w_k over the sites present, not divided by their total number of "
            "samples. See Hint 1."),
    Mistake("never added up",
            lambda r: all(_holds(r.after[k], _combine(r.before, [r.samples[k] / r.total if k == j else 0.0
                                                                 for j in range(r.n)]))
                          for k in range(r.n) if r.present[k]),
            "each site holds only its own weighted parameters n_k w_k / n: they were never added up across the "
            "sites (or the sum never reached the model). See Hint 2."),
    Mistake("only some ranks hold it", lambda r: r.ok[min(k for k in range(r.n) if r.present[k])],
            lambda r: f"rank(s) {[k for k in range(r.n) if r.ok[k]]} hold the right model but rank(s) {r.wrong} do "
                      "not: every site must end with it, not only one. See Hint 2."),
)

ONE_COLLECTIVE = ("One collective per round is the constraint: each one pays its latency, and across "
                  "institutions that latency is a wide-area round trip. See Hint 1.")

# More than one collective per call, told by the most any call made (readings: the counts of
# every call, and the number of parameter tensors).
COLLECTIVE_MISTAKES = (
    Mistake("one collective per tensor", lambda counts, tensors: max(counts) > tensors,
            lambda counts, tensors: f"a call made {max(counts)} collectives: one per parameter tensor ({tensors}) "
                                    "and one more for the samples, as the lecture's fedavg_. " + ONE_COLLECTIVE),
    Mistake("samples in a second message", lambda counts, tensors: max(counts) == 2,
            "a call made 2 collectives, the samples present and the parameters in separate messages. "
            + ONE_COLLECTIVE),
)


def _check_round(number: int, sites: list, n: int) -> None:
    """After the round every rank holds the mean over the sites present, weighted by their samples."""
    r = _Round(number, sites, n)
    if all(r.ok):
        return
    name_the_first(ROUND_MISTAKES, r, before=f"{r.where}, ")
    raise CheckFailed(f"{r.where}, rank(s) {r.wrong} hold neither the mean over the sites present weighted by their "
                      "samples nor a mistake this check knows. Check each site's weight, that the sites that sat "
                      "out add nothing, and that every parameter goes through the collective. See Hint 1.")
