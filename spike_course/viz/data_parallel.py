"""Figures for chapter 03: data parallel."""

from __future__ import annotations

import matplotlib.pyplot as plt



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
