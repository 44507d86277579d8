"""Exercise checks for chapter 09: federated learning."""

from __future__ import annotations

from ._common import CheckFailed, launch_reports, passed

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
    if max(counts) > 1:
        many = max(counts)
        what = (f"{many} collectives: one per parameter tensor ({tensors}) and one more for the samples, as the "
                "lecture's fedavg_" if many > tensors else
                "2 collectives, the samples present and the parameters in separate messages" if many == 2 else
                f"{many} collectives")
        raise CheckFailed(f"every rank holds the right model after every round, but a call made {what}. One "
                          "collective per round is the constraint: each one pays its latency, and across "
                          "institutions that latency is a wide-area round trip. See Hint 1.")
    if min(counts) < 1:
        raise CheckFailed("a rank made no collective in a round, yet holds the right model: the harness was "
                          "changed, or fedavg_ found the other sites' parameters by other means. Run the worker "
                          "as given.")
    samples = [site["samples"] for site in rounds[0]]
    passed(f"after each of {len(rounds)} rounds all {n} sites hold the mean over the sites present, weighted by "
           f"n_k = {samples} (stale and NaN parameters of absent sites left out), with one collective per call")


def _check_round(number: int, sites: list, n: int) -> None:
    before = [site["before"] for site in sites]
    after = [site["after"] for site in sites]
    samples = [float(site["samples"]) for site in sites]
    present = [bool(site["took_part"]) for site in sites]
    absent = [k for k in range(n) if not present[k]]
    total, everyone = sum(m for m, p in zip(samples, present) if p), sum(samples)
    right = _combine(before, [m / total if p else 0.0 for m, p in zip(samples, present)])
    ok = [_holds(a, right) for a in after]
    if all(ok):
        return
    wrong = [k for k in range(n) if not ok[k]]
    where = (f"after round {number} (sites present: {[k for k in range(n) if present[k]]}, "
             f"n_k = {[site['samples'] for site in sites]})")
    missing = sorted({name for a in after for name in before[0] if name not in a})
    if missing:
        raise CheckFailed(f"{where}, the parameters {missing} are missing: every parameter of the model is part "
                          "of the global model.")
    if not all(_finite(a) for a in after):
        diverged = [k for k in absent if not _finite(before[k])]
        if diverged:
            raise CheckFailed(
                f"{where}, rank(s) {[k for k in range(n) if not _finite(after[k])]} hold NaN or inf. Site(s) "
                f"{diverged} sat out with non-finite parameters (their training diverged) and these reached "
                "the result: a weight of zero does not remove a NaN, 0 * NaN is NaN. See Hint 1.")
        raise CheckFailed(f"{where}, rank(s) {[k for k in range(n) if not _finite(after[k])]} hold NaN or inf "
                          "although no site's parameters did: a division by a sum that came out zero? See Hint 1.")
    if all(_holds(a, (b, {k: 0 * v for k, v in b.items()})) for a, b in zip(after, before)):
        raise CheckFailed(f"{where}, no rank's parameters changed: the result of the collective never reached "
                          "the model's parameters (a collective works in place on the tensor it is given). "
                          "See Hint 2.")
    if all(ok[k] for k in range(n) if present[k]) and all(_holds(after[k], (before[k], {
            name: 0 * v for name, v in before[k].items()})) for k in absent):
        raise CheckFailed(f"{where}, the sites present hold the new global model, but site(s) {absent}, which "
                          "sat out, still hold their own parameters: every site starts the next round from the "
                          "new global model. See Hint 1.")

    def matches(weights):
        return all(_holds(a, _combine(before, weights)) for a in after)

    if absent and all(_finite(b) for b in before) and matches([m / everyone for m in samples]):
        raise CheckFailed(
            f"{where}, every rank holds the weighted mean over all {n} sites: site(s) {absent} sat out this round "
            "and were averaged in all the same, with their n_k. A site that did not take part counts for "
            "nothing. See Hint 1.")
    if absent and matches([m / everyone if p else 0.0 for m, p in zip(samples, present)]):
        raise CheckFailed(
            f"{where}, each site present is weighted by n_k / {everyone:g}, its share of ALL sites' samples, "
            f"so the weights add up to {total / everyone:.2f}, not 1, and the model shrinks towards zero. The "
            "samples that count are those of the sites present. See Hint 1.")
    if matches([1 / sum(present) if p else 0.0 for p in present]):
        raise CheckFailed(f"{where}, every rank holds the plain, unweighted mean of the sites present: FedAvg "
                          "weights each site by its number of samples. See Hint 1.")
    if matches([m if p else 0.0 for m, p in zip(samples, present)]):
        raise CheckFailed(f"{where}, every rank holds the sum of n_k w_k over the sites present, not divided by "
                          "their total number of samples. See Hint 1.")
    if all(_holds(after[k], _combine(before, [samples[k] / total if k == j else 0.0 for j in range(n)]))
           for k in range(n) if present[k]):
        raise CheckFailed(f"{where}, each site holds only its own weighted parameters n_k w_k / n: they were "
                          "never added up across the sites (or the sum never reached the model). See Hint 2.")
    if ok[min(k for k in range(n) if present[k])] and not all(ok):
        raise CheckFailed(f"{where}, rank(s) {[k for k in range(n) if ok[k]]} hold the right model but rank(s) "
                          f"{wrong} do not: every site must end with it, not only one. See Hint 2.")
    raise CheckFailed(f"{where}, rank(s) {wrong} hold neither the mean over the sites present weighted by their "
                      "samples nor a mistake this check knows. Check each site's weight, that the sites that sat "
                      "out add nothing, and that every parameter goes through the collective. See Hint 1.")
