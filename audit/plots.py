"""The audit's plots (``error_ratio_hist.png``, ``error_vs_bound.png``): matplotlib only here, so
that a machine without it still writes the report (:meth:`audit.report.Audit.write`).

Series that are equal, or alike at the plot's scale, are drawn once under all their names (one
over the other they would hide each other); the histogram's axis spans the occupied bins and the
bound; log axes carry a handful of labels that never run into each other.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch


def write_plots(bound_reports, out: Path) -> list[str]:
    """error_ratio_hist.png and error_vs_bound.png for the first preset, one panel per probe."""
    if not bound_reports:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first_preset = bound_reports[0][0]
    chosen = [(probe, impl, r) for p, probe, impl, r in bound_reports
              if p == first_preset and r.model != "float64"]
    probes = list(dict.fromkeys(probe for probe, _, _ in chosen))
    if not probes:
        return []
    cols = min(2, len(probes))
    rows_n = (len(probes) + cols - 1) // cols
    files = []

    def save(fig, axes, name: str) -> None:
        for ax in list(axes.flat)[len(probes):]:  # grid cells without a probe
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 3.6 * rows_n), squeeze=False)
    for ax, probe in zip(axes.flat, probes):
        series = _distinct_series([(impl, r) for p, impl, r in chosen if p == probe],
                                  same=lambda a, b: a.prob_hist == b.prob_hist, close=_close_counts)
        for label, r in series:
            ax.stairs(r.prob_hist, r.hist_edges, label=label)
        ax.axvline(1.0, color="k", lw=1, ls="--")
        ax.set_xscale("log")
        ax.set_xlim(*_occupied_range([r for _, r in series], include=1.0))
        _readable_log_ticks(ax.xaxis, ax.get_xlim())
        ax.set_title(f"{first_preset} / {probe}")
        ax.set_xlabel("|error| / probabilistic bound")
        ax.set_ylabel("elements")
        ax.legend(fontsize=7)
    save(fig, axes, "error_ratio_hist.png")

    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 4.2 * rows_n), squeeze=False)
    for ax, probe in zip(axes.flat, probes):
        lo, hi = float("inf"), 0.0
        series = _distinct_series([(impl, r) for p, impl, r in chosen if p == probe],
                                  same=lambda a, b: a.sample == b.sample, close=_close_points)
        for label, r in series:
            err = torch.tensor(r.sample["error"], dtype=torch.float64).clamp_min(1e-12)
            bound = torch.tensor(r.sample["worst"], dtype=torch.float64)
            ax.scatter(bound.numpy(), err.numpy(), s=2, alpha=0.4, label=label)
            lo, hi = min(lo, float(bound.min())), max(hi, float(bound.max()))
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="error = worst-case bound")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _readable_log_ticks(ax.xaxis, ax.get_xlim())
        _readable_log_ticks(ax.yaxis, ax.get_ylim())
        ax.set_title(f"{first_preset} / {probe}")
        ax.set_xlabel("worst-case bound")
        ax.set_ylabel("|out - reference|")
        ax.legend(fontsize=7, markerscale=4)
    save(fig, axes, "error_vs_bound.png")
    return files


def _distinct_series(named, same, close) -> list[tuple[str, object]]:
    """One series per distinct-looking result, labelled with every implementation that produced
    it: series drawn one over the other would hide each other (one visible line or cloud,
    several legend entries). ``same(a, b)``: equal, joined with "="; ``close(a, b)``: no eye
    could tell them apart at this size, joined with "~" (the report's tables keep the numbers)."""
    groups: list[tuple[object, str]] = []
    for name, report in named:
        for i, (first, label) in enumerate(groups):
            if same(first, report) or close(first, report):
                groups[i] = (first, f"{label} {'=' if same(first, report) else '~'} {name}")
                break
        else:
            groups.append((report, name))
    return [(label, report) for report, label in groups]


def _close_counts(a, b, *, share: float = 0.01) -> bool:
    """Histograms whose every bin differs by at most ``share`` of the tallest bin."""
    if len(a.prob_hist) != len(b.prob_hist):
        return False
    tallest = max(max(a.prob_hist, default=0), 1)
    return all(abs(x - y) <= share * tallest for x, y in zip(a.prob_hist, b.prob_hist))


def _close_points(a, b, *, decades: float = 0.01, share: float = 0.99) -> bool:
    """Error-vs-bound samples with ``share`` of the points within ``decades`` (2.3 % at 0.01)
    of the other's on both log axes (e.g. atomic and deterministic sums of the same products;
    a few tiny errors differ by far more in ratio and still vanish in the cloud)."""
    pa = torch.tensor([a.sample["error"], a.sample["worst"]], dtype=torch.float64)
    pb = torch.tensor([b.sample["error"], b.sample["worst"]], dtype=torch.float64)
    if pa.shape != pb.shape or pa.numel() == 0:
        return False
    la, lb = pa.clamp_min(1e-12).log10(), pb.clamp_min(1e-12).log10()  # as drawn
    near = ((la - lb).abs() <= decades).all(dim=0)
    return float(near.double().mean()) >= share


def _occupied_range(reports, include: float) -> tuple[float, float]:
    """The histogram's x range: from the first to the last non-empty bin of any series (one bin
    of margin each side), widened to show ``include`` (the bound) clear of the frame."""
    lo, hi = include / 10 ** 0.25, include * 10 ** 0.5
    for r in reports:
        filled = [i for i, n in enumerate(r.prob_hist) if n]
        if filled:
            edges = r.hist_edges
            lo = min(lo, edges[max(filled[0] - 1, 0)])
            hi = max(hi, edges[min(filled[-1] + 2, len(edges) - 1)])
    return lo, hi


def _readable_log_ticks(axis, limits: tuple[float, float], most: int = 6) -> None:
    """Label a log axis at no more than ``most`` places, 1-2-5 steps inside a narrow range and
    whole decades (every n-th) over a wide one: matplotlib's own choice labels minor ticks over
    about a decade, and their labels run into each other."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo, hi = sorted(max(v, 1e-300) for v in limits)
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for subs in ((1, 2, 5), (1, 3), (1,)):
        ticks = [m * 10.0 ** k for k in range(first, last + 1) for m in subs if lo <= m * 10.0 ** k <= hi]
        if len(ticks) <= most:
            break
    else:
        step = math.ceil(len(ticks) / most)
        ticks = ticks[::step]
    if len(ticks) < 2:  # a range inside one 1-2-5 step: label its ends, two digits inward
        q = 10.0 ** (math.floor(math.log10(hi)) - 1)
        ticks = sorted({math.ceil(lo / q) * q, math.floor(hi / q) * q})
    def label(value: float, _position) -> str:
        exponent = math.floor(math.log10(value) + 1e-9)
        mantissa = f"{value / 10.0 ** exponent:.2g}"
        return f"$10^{{{exponent}}}$" if mantissa == "1" else f"${mantissa}\\times10^{{{exponent}}}$"

    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(NullFormatter())
