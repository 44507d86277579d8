"""Chapter 06 figures: ZeRO memory bars, measured-vs-model bars, and the ZeRO explorer."""

import matplotlib

matplotlib.use("Agg")

from spike_course import costmodel, viz, widgets  # noqa: E402


def _stage_bars(psi=7.5e9, n=64):
    return {f"stage {s}": costmodel.zero_memory_breakdown(psi, n, s) for s in range(4)}


def test_zero_memory_bars_stack_to_the_totals():
    fig = viz.zero_memory_bars(_stage_bars(), highlight="stage 2", capacity=80e9)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"stage {s}" for s in range(4)]
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches if p.get_height() > 0})
    expected = sorted(round(costmodel.zero_memory(7.5e9, 64, s) / 1e9, 6) for s in range(4))
    assert all(any(abs(t - e) < 1e-6 for t in tops) for e in expected)


def test_measured_vs_model_draws_two_bars_per_label():
    parts = {f"F = {f}": costmodel.zero_memory_breakdown(1000, f, 3, k=8, param_bytes=4, grad_bytes=4)
             for f in (1, 2, 4)}
    fig = viz.memory_measured_vs_model(parts, parts, unit="KB")
    assert len([p for p in fig.axes[0].patches if p.get_height() > 0]) == 3 * 2 * 3


def test_explorer_draws_at_once_and_redraws(monkeypatch):
    drawn = []
    real = viz.zero_memory_bars

    def spy(bars, highlight=None, **kwargs):
        drawn.append((highlight, round(sum(bars[highlight].values()) / 1e9, 3)))
        return real(bars, highlight=highlight, **kwargs)

    monkeypatch.setattr(viz, "zero_memory_bars", spy)
    box = widgets.zero_explorer(billions=1.0, dp_size=8, stage=1)
    assert drawn == [("stage 1", round(costmodel.zero_memory(1e9, 8, 1) / 1e9, 3))]  # at once
    box.children[1].value = 3  # the stage buttons
    assert drawn[-1] == ("stage 3", 2.0)  # 16 bytes x 1e9 / 8
    box.children[0].children[1].value = 16  # N_d
    assert drawn[-1] == ("stage 3", 1.0)
