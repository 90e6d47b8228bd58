"""Diagnostics of a run, each a sentence with its numbers: is it still improving, is it trained
long enough for its size, did the loss spike, is MFU known, did the data feed hold steps back,
what restarts cost. Thresholds are in raychat.report.summary, beside the rest of the summary."""

import statistics
from typing import Any

from raychat.report.summary import (
    CHINCHILLA_RATIO,
    DATA_BOUND,
    IMPROVING,
    SPIKE,
    Facts,
    mfu_note,
    timed_steps,
)
from raychat.telemetry.metrics_log import Timeline


def trend(t: Timeline) -> str:
    bpbs = [e["val_bpb"] for e in t.evals[-3:]]
    if len(bpbs) < 2:
        return f"{len(t.evals)} eval(s) so far: no val bpb trend yet"
    per_eval = (bpbs[0] - bpbs[-1]) / (len(bpbs) - 1)
    what = (f"val bpb went from {bpbs[0]:.4f} to {bpbs[-1]:.4f} over the last {len(bpbs)} evals "
            f"({-per_eval:+.4f} per eval, {-100 * per_eval / bpbs[0]:+.2f}%)")
    if per_eval > IMPROVING * bpbs[0]:
        return f"still improving: {what}; a longer horizon would lower it further"
    return f"flat: {what}; more steps at this size would gain little"


def sizing(f: Facts) -> str:
    if f.ratio < CHINCHILLA_RATIO:
        planned = f.plan["tokens_per_param"]
        return (f"under-trained for its size: {f.ratio:.2f} tokens per scaling parameter against "
                f"Chinchilla's ~{CHINCHILLA_RATIO:g} (planned {planned:.2f}); for this compute a smaller "
                f"model trained longer would likely reach a lower bpb")
    return f"trained past Chinchilla's ~{CHINCHILLA_RATIO:g} tokens per parameter ({f.ratio:.2f})"


def spikes(t: Timeline) -> str:
    found = []
    for i in range(10, len(t.steps)):
        before = statistics.median(r["raw_loss"] for r in t.steps[i - 10:i])
        loss = t.steps[i]["raw_loss"]
        if loss > SPIKE * before:
            found.append((loss / before, t.steps[i]["step"], loss, before))
    if not found:
        return f"no loss spikes (no step's loss above {SPIKE}x the median of the 10 steps before it)"
    ratio, step, loss, before = max(found)
    return (f"{len(found)} loss spike(s) above {SPIKE}x the median of the 10 steps before; the worst at "
            f"step {step}: {loss:.4f} against {before:.4f} ({ratio:.2f}x)")


def data_wait(t: Timeline) -> str | None:
    timed = timed_steps(t)
    if not timed:
        return None
    share = sum(r["data_wait_s"] for r in timed) / sum(r["dt"] for r in timed)
    if share <= DATA_BOUND:
        return None
    return (f"the data feed held training back: steps waited {100 * share:.0f}% of their time for "
            "batches (raise --cpus-per-worker or give the data tasks more CPUs)")


def restarts(f: Facts, t: Timeline) -> str:
    if not f.markers:
        return "no restarts or resizes"
    counts = {kind: sum(m.kind == kind for m in f.markers) for kind in ("restart", "resize", "resume")}
    redone = t.starts[-1].get("redone_steps", 0)
    gaps = [s["time"] - s["previous_time"] for s in t.starts[1:] if s.get("previous_time") is not None]
    dt = statistics.median(r["dt"] for r in t.steps) if t.steps else 0.0
    kinds = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in counts.items() if n)
    resumes = " (reruns of the run name: their gaps include time between runs)" if counts["resume"] else ""
    return (f"{kinds} at step(s) {', '.join(str(m.step) for m in f.markers)}: {redone} step(s) redone "
            f"(~{redone * dt:.1f} s), {sum(gaps):.1f} s between the last record of an attempt and the "
            f"start of the next{resumes}")


def findings(f: Facts, t: Timeline) -> list[str]:
    """Every diagnostic that applies, in reading order."""
    out: list[Any] = [trend(t), sizing(f), spikes(t)]
    if not any(r.get("mfu") is not None for r in t.steps):
        out.append(mfu_note(f.start))
    out += [data_wait(t), restarts(f, t)]
    return [line for line in out if line]
