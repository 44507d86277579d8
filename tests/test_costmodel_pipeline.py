"""Chapter 04: the pipeline bubble formula, the ideal schedules and the Gantt chart."""

import matplotlib

matplotlib.use("Agg")

import pytest

from spike_course import costmodel, viz


@pytest.mark.parametrize("p, m, expected", [(1, 4, 0.0), (2, 1, 0.5), (2, 4, 0.2), (4, 4, 3 / 7), (8, 32, 7 / 39)])
def test_bubble_formula(p, m, expected):
    assert costmodel.pipeline_bubble(p, m) == pytest.approx(expected)


def test_bubble_shrinks_as_microbatches_grow():
    values = [costmodel.pipeline_bubble(4, m) for m in (1, 2, 4, 8, 16)]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]


def test_bubble_rejects_nonsense():
    with pytest.raises(ValueError):
        costmodel.pipeline_bubble(0, 4)
    with pytest.raises(ValueError):
        costmodel.pipeline_bubble(2, 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_ideal_schedule_idles_as_the_formula_says(schedule, p, m):
    events = costmodel.pipeline_schedule(schedule, p, m, t_forward=1.0, t_backward=2.0)
    assert len(events) == 2 * p * m
    assert costmodel.pipeline_idle_fraction(events) == pytest.approx(costmodel.pipeline_bubble(p, m))
    # The step takes m + p - 1 slots of forward + backward.
    assert max(e["end"] for e in events) == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ideal_schedule_respects_dependencies(schedule):
    p, m = 4, 6
    events = costmodel.pipeline_schedule(schedule, p, m)
    at = {(e["rank"], e["phase"], e["microbatch"]): e for e in events}
    for (r, phase, i), e in at.items():
        if phase == "F" and r > 0:
            assert e["start"] >= at[r - 1, "F", i]["end"]
        if phase == "B":
            before = at[r + 1, "B", i] if r < p - 1 else at[r, "F", i]
            assert e["start"] >= before["end"]
    for r in range(p):  # one thing at a time per rank
        mine = sorted((e for e in events if e["rank"] == r), key=lambda e: e["start"])
        assert all(a["end"] <= b["start"] + 1e-12 for a, b in zip(mine, mine[1:]))


def test_gpipe_holds_every_microbatch_1f1b_only_p_minus_rank():
    p, m = 4, 8
    gpipe = costmodel.pipeline_peak_activations(costmodel.pipeline_schedule("gpipe", p, m))
    one_f_one_b = costmodel.pipeline_peak_activations(costmodel.pipeline_schedule("1f1b", p, m))
    assert gpipe == {r: m for r in range(p)}
    assert one_f_one_b == {r: p - r for r in range(p)}


def test_1f1b_order_alternates_after_warmup():
    events = costmodel.pipeline_schedule("1f1b", 2, 4)
    rank0 = [(e["phase"], e["microbatch"]) for e in events if e["rank"] == 0]
    assert rank0 == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="gpipe"):
        costmodel.pipeline_schedule("zigzag", 2, 4)


def test_idle_fraction_of_measured_tuples():
    # rank 0 busy 0-1 and 3-4, rank 1 busy 1-3: span 4, idle 2/4 and 2/4.
    events = [(0, 0, "F", 0.0, 1.0), (1, 0, "F", 1.0, 2.0), (1, 0, "B", 2.0, 3.0), (0, 0, "B", 3.0, 4.0)]
    assert costmodel.pipeline_idle_fraction(events) == pytest.approx(0.5)
    assert costmodel.pipeline_idle_fraction(events, per_rank=True) == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}


def test_gantt_chart_draws_one_box_per_event():
    events = costmodel.pipeline_schedule("1f1b", 2, 4)
    fig = viz.pipeline_gantt(events, title="1F1B")
    ax = fig.axes[0]
    assert len(ax.patches) == len(events)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert ax.get_title() == "1F1B"


def test_gantt_chart_into_given_axes_with_scaled_time():
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2)
    events = [{"rank": 0, "microbatch": 0, "phase": "F", "start": 10.0, "end": 10.5, "stage": 2},
              {"rank": 1, "microbatch": 0, "phase": "B", "start": 10.5, "end": 11.0}]
    assert viz.pipeline_gantt(events, ax=right, unit="ms", scale=1e3) is fig
    bars = right.patches[:2]
    assert bars[0].get_x() == pytest.approx(0.0) and bars[0].get_width() == pytest.approx(500.0)
    assert bars[0].get_hatch() == "//" and bars[1].get_hatch() is None
    plt.close(fig)


def test_ideal_schedule_with_unequal_stages():
    # A slow last stage: the drain waits on it, so the step is longer than the formula's.
    events = costmodel.pipeline_schedule("gpipe", 2, 4, t_forward=[1.0, 1.0], t_backward=[2.0, 3.0])
    assert max(e["end"] for e in events) == pytest.approx(1 + 4 * 1 + 4 * 3 + 2)
    assert costmodel.pipeline_idle_fraction(events) > costmodel.pipeline_bubble(2, 4)
    with pytest.raises(ValueError, match="one F time per stage"):
        costmodel.pipeline_schedule("1f1b", 2, 4, t_forward=[1.0])
