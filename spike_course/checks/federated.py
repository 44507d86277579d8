"""Exercise checks for chapter 09: federated learning."""

from __future__ import annotations

from ._common import CheckFailed, all_close, passed


def check_fedavg(before, samples, after, collectives=None, rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    """Check a FedAvg aggregation done with collectives.

    before[r]: rank r's parameters (name -> tensor) just before aggregating; samples[r]: its
    number of training samples n_r; after[r]: what rank r holds after aggregating. Every rank
    must hold sum_r n_r before[r] / sum_r n_r. collectives[r], if given, is how many
    collectives rank r made (``CommDebugMode.get_total_counts()``): two are enough, one for
    the sample counts and one for the whole model.
    """
    from ..federated import fedavg_reference

    n = len(before)
    if not (len(samples) == len(after) == n) or n == 0:
        raise CheckFailed(f"need one entry per rank in before, samples and after; got {len(before)}, "
                          f"{len(samples)}, {len(after)}")
    missing = [k for k in before[0] if k not in after[0]]
    if missing:
        raise CheckFailed(f"the aggregated parameters lack {missing}: average every parameter of the model")
    total = float(sum(samples))
    expected = fedavg_reference(before, samples)
    ok = [all_close(a, expected, 1.0, rtol, atol) for a in after]
    if all(ok):
        if collectives is not None and max(collectives) > 2:
            raise CheckFailed(f"the weighted mean is right, but with {max(collectives)} collectives on a rank "
                              f"for {len(before[0])} parameter tensors: one all-reduce per tensor, as in the "
                              "lecture. Flatten the scaled parameters into one vector (parameters_to_vector), "
                              "all-reduce it once, and copy it back (vector_to_parameters): two in all.")
        passed(f"all {n} ranks hold the sample-weighted mean of the sites' parameters (n_k = {list(samples)})")
        return

    def scaled(weights):
        return fedavg_reference(before, weights) if sum(weights) else None

    def matches(candidate, factor=1.0):
        return all(all_close(a, candidate, factor, rtol, atol) for a in after)

    unweighted = scaled([1] * n)
    if matches(unweighted):
        raise CheckFailed("every rank holds the plain, unweighted mean of the sites' parameters: FedAvg "
                          "weights each site by its number of samples. Scale rank k's parameters by "
                          "n_k / n (n = the all-reduced sum of the n_k) before the all-reduce that adds them.")
    if matches(expected, total):
        raise CheckFailed("the result is sum_k n_k w_k, not divided by the total number of samples n: "
                          "all-reduce the n_k first and scale by n_k / n.")
    if matches(unweighted, n):
        raise CheckFailed("the result is the plain sum of the sites' parameters: all_reduce adds; scale "
                          "each site's parameters by n_k / n before it.")
    if matches(expected, total / n):
        raise CheckFailed("the result is sum_k n_k w_k / N (the number of ranks): divide by the total "
                          "number of samples n = sum_k n_k instead, all-reduced from every rank's n_k.")
    if matches(expected, 1 / n):
        raise CheckFailed("the result is N times too small: you divided by the number of ranks on top "
                          "of weighting by n_k / n, whose weights already add up to 1.")
    if all(all_close(a, b, 1.0, rtol, atol) for a, b in zip(after, before)):
        raise CheckFailed("the parameters did not change. all_reduce works in place on the tensor you pass "
                          "it: if you flattened the parameters into a new tensor (parameters_to_vector), "
                          "copy the result back (vector_to_parameters), or reduce p.data itself.")
    if all(all_close(a, b, m / total, rtol, atol) for a, b, m in zip(after, before, samples)):
        raise CheckFailed("each rank holds only its own scaled parameters n_k / n * w_k: the all-reduce "
                          "that adds them up is missing, or its result was not copied back.")
    if ok[0] and not all(ok):
        raise CheckFailed(f"rank 0 holds the right average but rank(s) {[r for r in range(n) if not ok[r]]} "
                          "do not: use all_reduce (every rank gets the result), not reduce (only the "
                          "destination does), or broadcast the result afterwards.")
    raise CheckFailed(f"rank(s) {[r for r in range(n) if not ok[r]]} hold neither the weighted mean "
                      "sum_k n_k w_k / sum_k n_k nor a recognisable mistake: check the weights and that every "
                      "parameter goes through the all-reduce.")
