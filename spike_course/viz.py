"""Matplotlib figures for the course. Every function returns the Figure it drew, so a
notebook shows it and a test can inspect it; none calls ``plt.show()``.

Sections (each chapter adds its own): message timelines, sampler index maps, pipeline
schedules, memory bars, bandwidth curves.
"""

from __future__ import annotations

import matplotlib.pyplot as plt  # noqa: F401


# --- chapter 01: message timelines and all-reduce cost curves ---


def message_timeline(trace, world_size: int | None = None, title: str | None = None, ax=None):
    """One horizontal line per rank, one arrow per message of an ``mpi_sim`` trace.

    An arrow leaves its sender's line at the message's send time and reaches the
    receiver's line at its arrival time (microseconds of simulated time); its colour is
    the message's tag, so the steps of an algorithm that tags its steps read apart.
    """
    import matplotlib.colors as mcolors

    trace = list(trace)
    n = world_size or (1 + max((max(m.source, m.dest) for m in trace), default=0))
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.9 + 0.45 * n))
    else:
        fig = ax.figure
    end = max((m.arrival_time for m in trace), default=0.0) * 1e6 or 1.0
    for rank in range(n):
        ax.axhline(rank, color="0.8", linewidth=1, zorder=0)
    tags = sorted({m.tag for m in trace})
    colors = list(mcolors.TABLEAU_COLORS.values())
    for m in trace:
        color = colors[tags.index(m.tag) % len(colors)]
        ax.annotate("", xy=(m.arrival_time * 1e6, m.dest), xytext=(m.send_time * 1e6, m.source),
                    arrowprops=dict(arrowstyle="->", color=color, linewidth=1.2,
                                    shrinkA=0, shrinkB=0))
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(-0.02 * end, 1.02 * end)
    ax.set_xlabel("simulated time (microseconds)")
    ax.set_title(title or f"{len(trace)} messages, {sum(m.nbytes for m in trace):,} bytes")
    fig.tight_layout()
    return fig


def allreduce_cost_curves(nbytes: float, world_size: int, alpha: float, beta: float,
                          title: str | None = None):
    """Alpha-beta all-reduce times of naive, ring and tree (``costmodel.allreduce_time``):
    against the message size at ``world_size`` ranks (left), and against the world size
    for ``nbytes`` (right). The dot marks the chosen point on each curve."""
    import numpy as np

    from .costmodel import ALLREDUCE_ALGORITHMS, allreduce_time

    sizes = np.logspace(2, 10, 81)
    worlds = np.arange(2, 129)
    fig, (size_ax, world_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, algorithm in enumerate(ALLREDUCE_ALGORITHMS):
        color = f"C{i}"
        size_ax.loglog(sizes, allreduce_time(sizes, world_size, algorithm, alpha, beta),
                       color=color, label=algorithm)
        size_ax.plot(nbytes, allreduce_time(nbytes, world_size, algorithm, alpha, beta), "o",
                     color=color)
        world_ax.loglog(worlds, [allreduce_time(nbytes, int(w), algorithm, alpha, beta) for w in worlds],
                        color=color, label=algorithm)
        world_ax.plot(world_size, allreduce_time(nbytes, world_size, algorithm, alpha, beta), "o",
                      color=color)
    size_ax.set(xlabel="message size (bytes)", ylabel="seconds", title=f"{world_size} ranks")
    world_ax.set(xlabel="world size (ranks)", ylabel="seconds", title=f"{nbytes:,.0f} bytes")
    for ax in (size_ax, world_ax):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# --- chapter 02: sampler index maps ---


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


# --- chapter 04: pipeline schedules ---

PHASE_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def pipeline_schedule(events, ax=None, title: str | None = None, unit: str = "s",
                      scale: float = 1.0, label: bool = True):
    """Gantt chart of a pipeline step: one row per rank, one box per micro-batch's
    forward (blue) or backward (orange), numbered by micro-batch; white space is idle.

    ``events``: dicts ``{"rank", "microbatch", "phase", "start", "end"}`` (or tuples in
    that order), measured by a worker or made by
    :func:`spike_course.costmodel.pipeline_schedule`. An optional ``"stage"`` key (an
    interleaved schedule runs several stages per rank) draws later stages hatched.
    Times are shifted so the step starts at 0 and multiplied by ``scale`` (e.g. 1e3 with
    ``unit="ms"``). Pass ``ax`` to draw into an existing subplot; returns the Figure.
    """
    events = [e if isinstance(e, dict) else dict(zip(("rank", "microbatch", "phase", "start", "end"), e))
              for e in events]
    if ax is None:
        ranks = len({e["rank"] for e in events}) or 1
        fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * ranks))
    fig = ax.figure
    if not events:
        return fig
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    n_ranks = len(ranks)
    for e in events:
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        row = ranks.index(e["rank"])
        hatch = "//" if e.get("stage", e["rank"]) >= n_ranks else None
        ax.barh(row, width, left=start, height=0.8, color=PHASE_COLORS.get(e["phase"], "tab:gray"),
                edgecolor="black", linewidth=0.5, hatch=hatch)
        if label:
            ax.text(start + width / 2, row, str(e["microbatch"]), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS[p]) for p in ("F", "B")]
    ax.legend(handles, ["forward", "backward"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


# --- chapter 06: fully sharded data parallel (memory bars) ---

MEMORY_KINDS = ("parameters", "gradients", "optimizer")
MEMORY_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green"}


def _stacked_memory_bar(ax, x, parts, scale, width=0.7, labels=True, **style):
    bottom = 0.0
    for kind in MEMORY_KINDS:
        value = parts.get(kind, 0.0) / scale
        ax.bar(x, value, width, bottom=bottom, color=MEMORY_COLORS[kind],
               label=kind if labels else None, **style)
        bottom += value
    return bottom


def zero_memory_bars(breakdowns: dict, highlight=None, capacity: float | None = None,
                     unit: str = "GB", title: str | None = None):
    """Stacked bars of bytes per device, one bar per entry of ``breakdowns``.

    ``breakdowns[label]`` is a dict with "parameters", "gradients" and "optimizer" bytes
    (what ``costmodel.zero_memory_breakdown`` returns); ``highlight`` is the label to
    show solid (the others are faded), ``capacity`` (bytes) draws the memory of one
    device as a dashed line.
    """
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (label, parts) in enumerate(breakdowns.items()):
        chosen = highlight is None or label == highlight
        top = _stacked_memory_bar(ax, i, parts, scale, labels=False, alpha=1.0 if chosen else 0.35)
        ax.text(i, top, f"{top:,.3g} {unit}", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if label == highlight else "normal")
    if capacity is not None:
        ax.axhline(capacity / scale, color="red", linestyle="--",
                   label=f"one device: {capacity / scale:,.0f} {unit}")
    for kind in MEMORY_KINDS:  # legend entries in full colour, whichever bar is faded
        ax.bar(0, 0, color=MEMORY_COLORS[kind], label=kind)
    ax.set_xticks(range(len(breakdowns)), list(breakdowns))
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title or "model states per device")
    ax.legend(loc="upper right", fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def memory_measured_vs_model(measured: dict, modeled: dict, unit: str = "KB",
                             title: str | None = None):
    """Measured bytes per rank beside the cost model's, as pairs of stacked bars.

    ``measured[label]`` and ``modeled[label]`` are dicts of "parameters", "gradients" and
    "optimizer" bytes; each label (e.g. "F = 2") gets a solid bar (measured) and a hatched
    one (cost model) side by side.
    """
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, label in enumerate(measured):
        _stacked_memory_bar(ax, i - 0.2, measured[label], scale, width=0.38, labels=i == 0)
        top = _stacked_memory_bar(ax, i + 0.2, modeled[label], scale, width=0.38, labels=False,
                                  hatch="//", alpha=0.55, edgecolor="black")
        ax.text(i + 0.2, top, "model", ha="center", va="bottom", fontsize=8)
        ax.text(i - 0.2, sum(measured[label].values()) / scale, "measured", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(measured)), list(measured))
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title or "bytes each rank holds: measured (solid) and cost model (hatched)")
    ax.legend(loc="upper right", fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


# --- chapter 08: bandwidth curves and strategy bars ---


def bandwidth_curves(rows, fits: dict | None = None, limit: float | None = None,
                     limit_label: str = "memory copy", title: str | None = None):
    """Collective benchmark results on log axes: time per call (left) and bus bandwidth (right).

    ``rows``: dicts with op, bytes, seconds and busbw (what the benchmark worker reports).
    ``fits``: op -> (alpha, beta) drawn as dashed lines alpha + beta * bytes on the left.
    ``limit``: a bandwidth in bytes/s drawn as a horizontal line on the right.
    """
    import numpy as np

    fig, (time_ax, bw_ax) = plt.subplots(1, 2, figsize=(11, 4))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for i, op in enumerate(ops):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        x = np.array([r["bytes"] for r in mine], dtype=float)
        color = f"C{i}"
        time_ax.loglog(x, [r["seconds"] for r in mine], "o-", color=color, label=op, markersize=4)
        bw_ax.loglog(x, [r["busbw"] / 1e9 for r in mine], "o-", color=color, label=op, markersize=4)
        if fits and op in fits:
            alpha, beta = fits[op]
            time_ax.loglog(x, alpha + beta * x, "--", color=color, alpha=0.7)
    if limit:
        bw_ax.axhline(limit / 1e9, color="black", linestyle=":", label=f"{limit_label} {limit / 1e9:.1f} GB/s")
    time_ax.set(xlabel="message size (bytes)", ylabel="seconds per call",
                title="time (dashed: fitted alpha + beta * bytes)")
    bw_ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
    for ax in (time_ax, bw_ax):
        ax.grid(True, which="major", alpha=0.3)
    time_ax.legend(fontsize=8)
    bw_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def step_time_curves(num_params, curves: dict, title: str | None = None, ylabel: str = "seconds per step"):
    """Predicted seconds per training step against model size, one line per label, log axes.

    ``curves``: label -> seconds (one per entry of ``num_params``). Labels that start with
    "compute" are drawn dashed (then dotted, ...) in grey, so communication and compute read apart.
    """
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dashes = iter(["--", ":", "-."] * len(curves))
    for i, (label, seconds) in enumerate(curves.items()):
        compute = label.startswith("compute")
        ax.loglog(num_params, seconds, next(dashes) if compute else "o-", label=label, markersize=4,
                  color="0.3" if compute else f"C{i}")
    ax.set(xlabel="parameters", ylabel=ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def strategy_bars(rows, gpu_memory: float, budget: float | None = None, title: str | None = None):
    """The decision guide's figure: memory per GPU (left, against the GPU's memory) and
    communication and compute per step (right) for each strategy of
    ``costmodel.plan_parallelism``; the recommended one is marked with a star."""
    import numpy as np

    names = [("* " if r["recommended"] else "") + r["strategy"] for r in rows]
    y = np.arange(len(rows))
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 0.5 + 0.55 * len(rows)), sharey=True)
    mem = [r["memory"] / 1e9 for r in rows]
    mem_ax.barh(y, mem, color=["C2" if r["fits"] else "C3" for r in rows])
    mem_ax.axvline(gpu_memory / 1e9, color="black", label=f"GPU memory {gpu_memory / 1e9:.0f} GB")
    if budget:
        mem_ax.axvline(budget / 1e9, color="black", linestyle=":", label="left after activations")
    mem_ax.set_xscale("log")
    mem_ax.set(xlabel="model states per GPU (GB, log)", yticks=y)
    mem_ax.set_yticklabels(names)
    mem_ax.invert_yaxis()
    mem_ax.legend(fontsize=8, loc="lower right")
    comm = np.array([r["comm"] * 1e3 for r in rows])
    compute = np.array([r["compute"] * 1e3 for r in rows])
    time_ax.barh(y - 0.2, compute, height=0.4, color="0.6", label="compute")
    time_ax.barh(y + 0.2, comm, height=0.4, color="C0", label="communication (PP: bubble)")
    time_ax.set(xlabel="milliseconds per step")
    time_ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# --- chapter 03: data parallel ---


def ddp_buckets(measured: dict, title: str | None = None):
    """When DDP's gradient buckets were ready during one backward pass, per ``bucket_cap_mb``.

    ``measured[cap]`` is a dict with ``end_ms`` (when backward returned, all-reduces done) and
    ``buckets``: a list of dicts with ``ready_ms`` (when the bucket was handed to all-reduce,
    from the start of backward), ``megabytes`` and ``params`` (parameter names).
    """
    caps = sorted(measured)
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.8 * len(caps)))
    for row, cap in enumerate(caps):
        step = measured[cap]
        ax.barh(row, step["end_ms"], color="lightgrey", height=0.5)
        for bucket in step["buckets"]:
            ax.plot(bucket["ready_ms"], row, marker="v", markersize=10, color="tab:red")
            layers = sorted({name.split(".")[0] for name in bucket["params"]})
            ax.annotate(f"{bucket['megabytes']:.2f} MB: {', '.join(layers)}", (bucket["ready_ms"], row),
                        xytext=(4, 10), textcoords="offset points", fontsize=8)
    ax.set_yticks(range(len(caps)), [f"bucket_cap_mb={cap:g}" for cap in caps])
    ax.set_ylim(-0.6, len(caps) - 0.2)
    ax.set_xlabel("ms since backward started (grey: until backward returned; red: a bucket's all-reduce starts)")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


# --- chapter 09: federated learning ---


def site_classes(counts: dict, title: str | None = None):
    """Bars of how many samples of each class every site holds.

    ``counts``: panel title -> list (one per site) of per-class counts, e.g.
    {"IID": [site0_counts, site1_counts], "non-IID": [...]}.
    """
    import numpy as np

    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 3), squeeze=False, sharey=True)
    for ax, (name, sites) in zip(axes[0], counts.items()):
        sites = [np.asarray(c) for c in sites]
        classes = np.arange(len(sites[0]))
        width = 0.8 / len(sites)
        for k, c in enumerate(sites):
            ax.bar(classes + (k - (len(sites) - 1) / 2) * width, c, width, label=f"site {k} ({int(c.sum())})")
        ax.set(title=name, xlabel="class", xticks=classes)
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncols=min(len(sites), 4))
    axes[0][0].set_ylabel("samples")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def federated_curves(curves: dict, alone=None, title: str | None = None):
    """Test accuracy against communication: all-reduces of the model (left, log) and
    megabytes each rank sent (right, log). ``curves``: label -> [(all_reduces, bytes,
    accuracy), ...]; ``alone``: accuracies of sites trained without communication."""
    fig, (round_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (label, points) in enumerate(curves.items()):
        points = [p for p in points if p[0] > 0]  # the start has sent nothing: no place on a log axis
        rounds, sent, acc = zip(*points)
        style = "s--" if label.startswith("DDP") else "o-"
        round_ax.plot(rounds, acc, style, color=f"C{i}", label=label, markersize=4)
        bytes_ax.plot([b / 1e6 for b in sent], acc, style, color=f"C{i}", label=label, markersize=4)
    if alone is not None:
        for ax in (round_ax, bytes_ax):
            ax.axhline(max(alone), color="0.5", linestyle=":", label="best site alone")
    round_ax.set(xscale="log", xlabel="all-reduces of the model (communication rounds)", ylabel="test accuracy")
    bytes_ax.set(xscale="log", xlabel="MB sent by each rank")
    for ax in (round_ax, bytes_ax):
        ax.grid(True, alpha=0.3)
    round_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
