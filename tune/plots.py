"""The sweep report's two plots, built as matplotlib Figure objects from plain numbers.

Figures are made without pyplot (no global figure registry to close, no display backend to pick)
and returned before they are saved, so tests read back what a plot shows: its series, labels and
fitted points (tests/test_tune_report.py). tune.report gathers the numbers and saves the PNGs.
"""

import math

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from raychat.report.plots import DPI, major_labels_only, save_figure
from tune.fit import ComputeOptimal

__all__ = ["DPI", "EvalCurve", "bpb_vs_flops_figure", "iso_flop_figure", "save_figure"]

# (depth, [(FLOPs spent so far, val bpb or CORE) of each eval, in order]) of one trial
EvalCurve = tuple[int, list[tuple[float, float]]]


def bpb_vs_flops_figure(curves: list[EvalCurve], ylabel: str = "validation bits per byte",
                        title: str = "val bpb vs compute") -> Figure:
    """Every eval of every trial: val bpb (or another metric: `ylabel`) against FLOPs spent so far,
    one colour (and one legend entry) per depth; a line through a trial's evals and a dot at its
    last one."""
    depths = sorted({depth for depth, evals in curves if evals})
    viridis = matplotlib.colormaps["viridis"]
    colors = {d: viridis(i / max(1, len(depths) - 1) * 0.9) for i, d in enumerate(depths)}
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    labelled = set()
    for depth, evals in curves:
        if not evals:
            continue
        xs, ys = zip(*evals, strict=True)
        label = None if depth in labelled else f"d{depth}"
        labelled.add(depth)
        ax.plot(xs, ys, "-", color=colors[depth], alpha=0.5, linewidth=1)
        ax.plot(xs[-1:], ys[-1:], "o", color=colors[depth], markersize=7, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} (lines: evals during training; dots: last eval)")
    ax.grid(True, which="both", alpha=0.3)
    major_labels_only(ax)
    if labelled:
        ax.legend(title="depth")
    fig.tight_layout()
    return fig


def iso_flop_figure(points: list[tuple[float, float, float, float]], result: ComputeOptimal) -> Figure:
    """Left: the iso-FLOP valleys (the trials' (N, val bpb) per budget, the fitted parabola dashed,
    a star at the optimum). Middle and right: N_opt and D_opt per budget with their power laws."""
    fig = Figure(figsize=(17, 5))
    axes = fig.subplots(1, 3)
    budgets = [o.flops for o in result.optima]
    plasma = matplotlib.colormaps["plasma"]
    ax = axes[0]
    for i, o in enumerate(result.optima):
        color = plasma(i / max(1, len(budgets) - 1) * 0.85)
        ns, bpbs = zip(*sorted((n, bpb) for c, n, _, bpb in points if c == o.flops), strict=True)
        ax.plot(ns, bpbs, "o", color=color, label=f"{o.flops:.2g}")
        if o.coeffs is not None:
            lo, hi = math.log(min(*ns, o.params)) - 0.2, math.log(max(*ns, o.params)) + 0.2
            x = np.linspace(lo, hi, 100)
            ax.plot(np.exp(x), np.polyval(o.coeffs, x), "--", color=color)
        ax.plot([o.params], [o.val_bpb], "*", color=color, markersize=16, markeredgecolor="black")
    ax.set_xscale("log")
    ax.set_xlabel("scaling parameters N")
    ax.set_ylabel("final val bpb")
    ax.set_title("iso-FLOP valleys (stars: optimum per budget)")
    ax.legend(title="FLOPs")
    for ax, attr, law, name in ((axes[1], "params", result.params_law, "N_opt"),
                                (axes[2], "tokens", result.tokens_law, "D_opt")):
        ax.loglog(budgets, [getattr(o, attr) for o in result.optima], "o", markersize=9)
        if law is not None:
            c = np.logspace(math.log10(min(budgets)) - 0.3, math.log10(max(budgets)) + 0.3, 50)
            r2 = "" if law.r2 is None else f", R^2 {law.r2:.3f}"
            ax.loglog(c, law(c), "r--", label=f"{name} ~ C^{law.exponent:.3f}{r2}")
            ax.legend()
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel(f"{name} ({'parameters' if attr == 'params' else 'tokens'})")
        ax.set_title(f"compute-optimal {'model size' if attr == 'params' else 'training tokens'}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        major_labels_only(ax)
    if result.ratio_at_reference is not None:
        fig.suptitle(f"compute-optimal tokens:params ratio {result.ratio_at_reference:.1f} "
                     f"at C = {result.reference_flops:.2g}")
    fig.tight_layout()
    return fig
