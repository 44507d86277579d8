"""The figures of chapters 02 and 03 draw what they are given."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from spike_course import viz  # noqa: E402


def _orders(size, replicas, epochs, **options):
    result = []
    for epoch in range(epochs):
        samplers = [DistributedSampler(range(size), num_replicas=replicas, rank=r, **options) for r in range(replicas)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        result.append([list(sampler) for sampler in samplers])
    return result


def _owner_row(fig, epoch):
    owner_ax = fig.axes[2 * epoch + 1]
    return np.asarray(owner_ax.images[0].get_array())[0]


def test_index_map_marks_padding_and_dropped_indices():
    # 10 samples on 3 ranks: padding repeats 2 indices (black); drop_last leaves 1 out (grey).
    fig = viz.sampler_index_map(_orders(10, 3, 2), 10)
    assert len(fig.axes) == 4  # two epochs, two panels each
    black = np.all(np.isclose(_owner_row(fig, 0), 0.0), axis=1)
    assert black.sum() == 2
    red_frames = [p for p in fig.axes[0].patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(red_frames) == 2
    fig = viz.sampler_index_map(_orders(10, 3, 1, drop_last=True), 10)
    grey = np.all(np.isclose(_owner_row(fig, 0), matplotlib.colors.to_rgb("lightgrey")), axis=1)
    assert grey.sum() == 1


def test_rank_curves_and_buckets_draw_one_mark_each():
    fig = viz.rank_curves({0: [3, 2, 1], 1: [3, 2.5, 1.5]})
    assert len(fig.axes[0].lines) == 2
    measured = {1.0: {"end_ms": 10.0, "buckets": [
        {"ready_ms": 2.0, "megabytes": 4.5, "params": ["fc2.bias", "fc1.weight"]},
        {"ready_ms": 9.0, "megabytes": 0.1, "params": ["conv1.weight"]}]},
        25.0: {"end_ms": 11.0, "buckets": [{"ready_ms": 9.5, "megabytes": 4.6, "params": ["fc1.weight"]}]}}
    fig = viz.ddp_buckets(measured)
    assert len(fig.axes[0].lines) == 3
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["bucket_cap_mb=1", "bucket_cap_mb=25"]
