"""The audit's plots: identical series drawn once under every name, the histogram's axis on the
occupied bins, log-axis labels that never run into each other."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from magi_moe.judge.bounds import HIST_EDGES
from magi_moe.audit.plots import _close_counts, _close_points, _distinct_series, _occupied_range


def hist(counts):
    return SimpleNamespace(prob_hist=counts, hist_edges=list(HIST_EDGES))


def test_equal_and_alike_series_are_drawn_once_under_every_name():
    a, b = [0] * 20 + [100, 900, 50] + [0] * 13, [0] * 20 + [100, 900, 50] + [0] * 13
    c = [0] * 20 + [100, 905, 45] + [0] * 13   # within 1 % of the tallest bin
    d = [0] * 20 + [400, 600, 50] + [0] * 13
    named = [("x", hist(a)), ("y", hist(b)), ("z", hist(c)), ("w", hist(d))]
    got = _distinct_series(named, same=lambda p, q: p.prob_hist == q.prob_hist, close=_close_counts)
    assert [label for label, _ in got] == ["x = y ~ z", "w"]


def test_alike_point_clouds_merge_and_distinct_ones_do_not():
    base = SimpleNamespace(sample={"error": [1e-4, 2e-4, 3e-4], "worst": [1e-3, 1e-3, 2e-3]})
    near = SimpleNamespace(sample={"error": [1.01e-4, 2e-4, 3e-4], "worst": [1e-3, 1e-3, 2e-3]})
    far = SimpleNamespace(sample={"error": [1e-5, 2e-4, 3e-4], "worst": [1e-3, 1e-3, 2e-3]})
    assert _close_points(base, near) and not _close_points(base, far)


def test_the_histogram_axis_spans_the_occupied_bins_and_the_bound():
    counts = [0] * (len(HIST_EDGES) - 1)
    counts[20:24] = [5, 50, 500, 5]  # ratios 1e-3 .. 1e-2
    lo, hi = _occupied_range([hist(counts)], include=1.0)
    assert lo == HIST_EDGES[19] and hi > 1.0 and hi < HIST_EDGES[-1]


@pytest.mark.parametrize("limits", [(1.6e-3, 1.05e-2), (0.035, 0.6), (1e-12, 1e-1), (2.1e-3, 2.4e-3), (2.13e-3, 2.46e-3)])
def test_log_axes_carry_few_labels(limits):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from magi_moe.audit.plots import _readable_log_ticks

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    ax.set_xlim(*limits)
    _readable_log_ticks(ax.xaxis, ax.get_xlim())
    ticks = [t for t in ax.xaxis.get_majorticklocs() if limits[0] <= t <= limits[1]]
    labels = [ax.xaxis.get_major_formatter()(t, i) for i, t in enumerate(ticks)]
    plt.close(fig)
    assert 2 <= len(ticks) <= 6 and all(labels)
