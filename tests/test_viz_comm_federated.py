"""The figures and the decision-guide widget of chapters 08 and 09 draw what they are given."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from spike_course import costmodel, viz, widgets  # noqa: E402

ROWS = [{"op": op, "bytes": b, "seconds": 1e-5 + b / 1e9, "busbw": b / (1e-5 + b / 1e9)}
        for op in ("all_reduce", "broadcast") for b in (8, 800, 80_000, 8_000_000)]


def test_bandwidth_curves_draw_measurements_fits_and_limit():
    fig = viz.bandwidth_curves(ROWS, fits={"all_reduce": (1e-5, 1e-9)}, limit=5e9)
    time_ax, bw_ax = fig.axes
    assert len(time_ax.lines) == 3  # two ops and one fitted line
    assert any("5.0 GB/s" in t.get_text() for t in bw_ax.get_legend().get_texts())
    assert time_ax.get_xscale() == "log" and bw_ax.get_yscale() == "log"
    plt.close(fig)


def test_strategy_bars_mark_the_recommendation():
    rows = costmodel.plan_parallelism(1e9, 16384, 8)
    fig = viz.strategy_bars(rows, 180e9)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0] == "* DDP" and len(labels) == len(rows)
    plt.close(fig)


def test_federated_figures():
    curves = {"FedAvg": [(0, 0, 0.1), (1, 5e6, 0.5), (2, 1e7, 0.7)],
              "DDP": [(0, 0, 0.1), (10, 5e7, 0.6), (20, 1e8, 0.8)]}
    fig = viz.federated_curves(curves, alone=[0.3, 0.4])
    rounds_ax, bytes_ax = fig.axes
    assert list(rounds_ax.lines[0].get_xdata()) == [1, 2]  # the start (nothing sent) is left out
    assert list(bytes_ax.lines[1].get_xdata()) == [50.0, 100.0]  # megabytes
    plt.close(fig)
    fig = viz.site_classes({"IID": [[5] * 10, [3] * 10], "skewed": [[9, 0] * 5, [0, 9] * 5]})
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 20
    plt.close(fig)


def test_parallelism_guide_builds_and_says_which_strategy():
    box = widgets.parallelism_guide(billions=1)
    assert box.children  # sliders and the output area
    table = widgets.strategy_table(costmodel.plan_parallelism(1e9, 16384, 8))
    assert "&#9733;</td><td>DDP" in table
