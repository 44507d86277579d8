"""Figures for chapter 02: sampler index maps."""

from __future__ import annotations

import matplotlib.pyplot as plt



def sampler_index_map(orders, dataset_size: int | None = None, title: str | None = None):
    """Draw which dataset indices each rank reads, and in what order, epoch by epoch.

    ``orders[epoch][rank]`` is the list of indices that rank reads in that epoch (what
    ``list(sampler)`` gives after ``sampler.set_epoch(epoch)``); a list of lists or a dict.
    One row of panels per epoch. Left: one line per rank, one cell per step, labelled and
    coloured by the dataset index read there; a red frame marks an index read a second time
    (DistributedSampler's padding). Right: one cell per dataset index, coloured by the rank
    that reads it, grey when no rank does (``drop_last``), black when several do.
    """
    import matplotlib.colors as mcolors
    import numpy as np

    epochs = list(orders.items()) if isinstance(orders, dict) else list(enumerate(orders))
    ranks = [list(map(int, r)) for _, per_rank in epochs for r in
             (per_rank.values() if isinstance(per_rank, dict) else per_rank)]
    n_ranks = len(ranks) // len(epochs)
    steps = max(len(r) for r in ranks)
    size = dataset_size or (max(max(r) for r in ranks if r) + 1)
    annotate = size <= 40 and steps <= 40
    rank_colors = plt.get_cmap("tab10").colors

    figsize = (min(14.0, 2.5 + 0.45 * (steps + size)), 0.5 + (0.35 * n_ranks + 0.7) * len(epochs))
    fig, axes = plt.subplots(len(epochs), 2, squeeze=False, figsize=figsize,
                             gridspec_kw={"width_ratios": [max(steps, 1), size]})
    for row, (epoch, per_rank) in enumerate(epochs):
        per_rank = list(per_rank.values()) if isinstance(per_rank, dict) else list(per_rank)
        order_ax, owner_ax = axes[row]
        grid = np.full((n_ranks, steps), np.nan)
        owners = [[] for _ in range(size)]
        for rank, indices in enumerate(per_rank):
            grid[rank, :len(indices)] = indices
            for index in indices:
                owners[index].append(rank)
        order_ax.imshow(grid, cmap="viridis", vmin=0, vmax=size - 1, aspect="auto")
        seen = set()
        for step in range(steps):  # walk the steps in time order, as the ranks read them
            for rank, indices in enumerate(per_rank):
                if step >= len(indices):
                    continue
                index = indices[step]
                if annotate:
                    order_ax.text(step, rank, str(index), ha="center", va="center", fontsize=8,
                                  color="white" if index < 0.6 * size else "black")
                if index in seen:
                    order_ax.add_patch(plt.Rectangle((step - 0.5, rank - 0.5), 1, 1, fill=False,
                                                     edgecolor="red", linewidth=2))
                seen.add(index)
        order_ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
        order_ax.set_xticks(range(steps))
        order_ax.set_ylabel(f"epoch {epoch}")
        if row == len(epochs) - 1:
            order_ax.set_xlabel("step (red: read twice)")

        owner_colors = [mcolors.to_rgb("lightgrey") if not who else
                        mcolors.to_rgb("black") if len(who) > 1 else rank_colors[who[0] % 10]
                        for who in owners]
        owner_ax.imshow(np.array(owner_colors)[None], aspect="auto")
        if annotate:
            for index in range(size):
                owner_ax.text(index, 0, str(index), ha="center", va="center", fontsize=8,
                              color="white" if len(owners[index]) > 1 else "black")
        owner_ax.set_yticks([])
        owner_ax.set_xticks(range(0, size, max(1, size // 20)))
        if row == 0:
            owner_ax.set_title("who reads each dataset index")
            handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colors[r % 10]) for r in range(n_ranks)]
            handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("black", "lightgrey")]
            labels = [f"rank {r}" for r in range(n_ranks)] + ["several ranks", "no rank"]
            owner_ax.legend(handles, labels,
                            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        if row == len(epochs) - 1:
            owner_ax.set_xlabel("dataset index")
    axes[0][0].set_title("indices each rank reads, in order")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def rank_curves(curves, xlabel: str = "step", ylabel: str = "loss", title: str | None = None):
    """One line per rank: ``curves[rank]`` is a sequence of values (say, that rank's losses)."""
    items = sorted(curves.items()) if isinstance(curves, dict) else list(enumerate(curves))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for rank, values in items:
        ax.plot(range(len(values)), [float(v) for v in values], label=f"rank {rank}", alpha=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
