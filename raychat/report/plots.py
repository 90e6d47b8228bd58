"""A run's curves as matplotlib Figure objects, and the figure helpers tune/plots.py shares.

Figures are made without pyplot (no global figure registry to close, no display backend to pick)
and returned before they are saved, so tests read back what a plot shows: its lines, their points
and labels. Restarts and resizes are vertical lines labelled "restart", "resize" or "resume" on
every step axis, so a jump in a curve can be matched to the event that caused it. The time figure
stacks the run's wall time by cause, per attempt.
"""

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from raychat.report.summary import Marker
from raychat.telemetry.ledger import CAUSES, Ledger
from raychat.telemetry.metrics_log import Timeline

DPI = 120
MARKER_COLOURS = {"restart": "red", "resize": "orange", "resume": "grey"}


def major_labels_only(ax: Axes) -> None:
    """Log axes spanning less than a decade label every minor tick, and the labels collide."""
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def save_figure(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)


def _mark(ax: Axes, markers: list[Marker]) -> None:
    labelled = set()
    for m in markers:
        ax.axvline(m.step, color=MARKER_COLOURS.get(m.kind, "grey"), linestyle=":", linewidth=1.2,
                   label=None if m.kind in labelled else m.kind)
        labelled.add(m.kind)


def _finish(ax: Axes, xlabel: str, ylabel: str, title: str, log_x: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_x:
        ax.set_xscale("log")
        major_labels_only(ax)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def loss_figure(t: Timeline, eval_flops: list[float], markers: list[Marker]) -> Figure:
    """Training loss (nanochat's smoothed loss and each step's own) and val bpb, against step (top)
    and against FLOPs spent (bottom, log scale). `eval_flops`: the FLOPs at each eval of t.evals."""
    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2)
    steps = [r["step"] for r in t.steps]
    eval_steps, bpbs = [e["step"] for e in t.evals], [e["val_bpb"] for e in t.evals]
    flops = [r["flops_so_far"] for r in t.steps]
    for ax, x in ((axes[0, 0], steps), (axes[1, 0], flops)):
        ax.plot(x, [r["raw_loss"] for r in t.steps], "-", color="lightsteelblue", linewidth=0.8,
                label="step loss")
        ax.plot(x, [r["loss"] for r in t.steps], "-", color="navy", linewidth=1.5,
                label="smoothed (log line)")
    axes[0, 1].plot(eval_steps, bpbs, "o-", color="darkgreen", label="val bpb")
    after_start = [(x, y) for x, y in zip(eval_flops, bpbs, strict=True) if x > 0]  # a log axis has no 0
    if after_start:
        axes[1, 1].plot(*zip(*after_start, strict=True), "o-", color="darkgreen", label="val bpb")
    for ax in axes[0]:
        _mark(ax, markers)
    _finish(axes[0, 0], "step", "training loss", "training loss vs step")
    _finish(axes[0, 1], "step", "validation bits per byte", "val bpb vs step")
    _finish(axes[1, 0], "training FLOPs", "training loss", "training loss vs FLOPs", log_x=True)
    _finish(axes[1, 1], "training FLOPs", "validation bits per byte", "val bpb vs FLOPs", log_x=True)
    fig.tight_layout()
    return fig


def throughput_figure(t: Timeline, markers: list[Marker], mfu_note: str) -> Figure:
    """Tokens per second (all workers) and MFU per step; where there is no MFU, `mfu_note` says why."""
    fig = Figure(figsize=(12, 4.5))
    ax_tok, ax_mfu = fig.subplots(1, 2)
    steps = [r["step"] for r in t.steps]
    ax_tok.plot(steps, [r["tokens_per_sec"] for r in t.steps], "-", color="purple", label="tokens/s")
    _mark(ax_tok, markers)
    _finish(ax_tok, "step", "tokens per second", "throughput (all workers)")
    mfu = [(r["step"], r["mfu"]) for r in t.steps if r.get("mfu") is not None]
    if mfu:
        ax_mfu.plot(*zip(*mfu, strict=True), "-", color="teal", label="MFU")
        _mark(ax_mfu, markers)
    else:
        ax_mfu.text(0.5, 0.5, mfu_note, ha="center", va="center", wrap=True, transform=ax_mfu.transAxes)
    _finish(ax_mfu, "step", "MFU (% of bf16 peak)", "model FLOPs utilisation")
    fig.tight_layout()
    return fig


def lr_figure(t: Timeline, markers: list[Marker]) -> Figure:
    """The learning-rate multiplier per step: warmup, constant, warmdown."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot([r["step"] for r in t.steps], [r["lrm"] for r in t.steps], "-", color="darkorange", label="lrm")
    _mark(ax, markers)
    _finish(ax, "step", "learning-rate multiplier", "learning-rate schedule")
    fig.tight_layout()
    return fig


CAUSE_COLOURS = {"startup": "grey", "training": "seagreen", "data_wait": "gold", "redone": "red",
                 "checkpoint": "royalblue", "eval": "mediumpurple", "detect": "darkorange",
                 "reschedule": "sandybrown", "restore": "peru", "first_step": "khaki", "compile": "goldenrod",
                 "other": "lightgrey"}


def time_figure(ledger: Ledger) -> Figure:
    """The run's wall time by cause (raychat.telemetry.ledger): one stacked bar per attempt and one for the
    run, in minutes, goodput in each label; the green of each bar is what advanced training."""
    fig = Figure(figsize=(12, max(4.0, 1.5 + 0.5 * (len(ledger.attempts) + 1))))
    ax = fig.subplots()
    bars = [(f"run: goodput {100 * ledger.goodput:.1f}%", ledger.seconds)]
    bars += [(f"{i + 1}. {a.kind} at step {a.step}: {100 * a.goodput:.1f}%", a.seconds)
             for i, a in enumerate(ledger.attempts)]
    labels = [label for label, _ in bars]
    for cause in CAUSES:
        left = [sum(seconds[c] for c in CAUSES[:CAUSES.index(cause)]) / 60 for _, seconds in bars]
        widths = [seconds[cause] / 60 for _, seconds in bars]
        if any(widths):
            ax.barh(labels, widths, left=left, color=CAUSE_COLOURS[cause], label=cause)
    ax.invert_yaxis()  # the run on top, then its attempts in order
    _finish(ax, "wall time (minutes)", "", "where the run's time went")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    return fig
