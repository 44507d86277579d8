"""Federated learning (chapter 09): sites whose data differ, and FedAvg's aggregate.

``label_skew_split`` deals a labelled data set out to sites the way real sites differ:
each site sees mostly "its own" classes (a hospital's patients, a phone's photos).
``fedavg_reference`` computes, in one process, what the aggregation a site runs after
its local steps must give: every parameter becomes the mean of the sites' parameters
weighted by their numbers of samples. The aggregation itself, with collectives, is
written in chapter 09 (lecture: one all-reduce per tensor; exercise: one for the model).
"""

from __future__ import annotations

import torch


def targets_of(dataset) -> torch.Tensor:
    """The labels of a data set from ``spike_course.data.load_mnist`` (or a Subset of one)."""
    if hasattr(dataset, "targets"):
        return torch.as_tensor(dataset.targets)
    if hasattr(dataset, "indices") and hasattr(dataset, "dataset"):
        return targets_of(dataset.dataset)[torch.as_tensor(list(dataset.indices))]
    return torch.tensor([int(label) for _, label in dataset])


def label_skew_split(targets, sizes, skew: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Indices of the samples of each site: site k gets ``sizes[k]`` samples.

    Class c "belongs" to site c mod (number of sites). A share ``skew`` of each site's
    samples comes from its own classes, the rest from any class: ``skew=0`` is an IID
    split (every site sees every class in the same proportions), ``skew=1`` gives the
    sites disjoint classes. The split is the same on every rank for the same seed, and
    no sample goes to two sites.
    """
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must lie in [0, 1], got {skew!r}")
    targets = torch.as_tensor(targets)
    sites = len(sizes)
    generator = torch.Generator().manual_seed(seed)
    own_order = torch.randperm(len(targets), generator=generator).tolist()
    any_order = torch.randperm(len(targets), generator=generator).tolist()  # a fresh draw: no bias
    owner = [label % sites for label in targets.tolist()]
    taken = [False] * len(targets)
    split = [[] for _ in range(sites)]

    def draw(site, count, own_only):
        for i in (own_order if own_only else any_order):
            if count == 0:
                return
            if not taken[i] and (not own_only or owner[i] == site):
                taken[i] = True
                split[site].append(i)
                count -= 1
        if count:
            kind = "of its own classes " if own_only else ""
            raise ValueError(f"not enough samples {kind}for site {site}: {count} short; "
                             "use smaller sizes or a bigger data set")

    own = [round(skew * size) for size in sizes]
    for site in range(sites):      # each site's own classes first, while they last
        draw(site, own[site], own_only=True)
    for site in range(sites):      # then the rest from whatever is left, any class
        draw(site, sizes[site] - own[site], own_only=False)
    return split


def fedavg_reference(states, counts) -> dict:
    """The FedAvg aggregate in one process: sum_k n_k * state_k / sum_k n_k, per entry."""
    total = float(sum(counts))
    return {name: sum(float(n) * torch.as_tensor(state[name]).double() for state, n in zip(states, counts)) / total
            for name in states[0]}
