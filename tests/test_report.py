"""`python -m raychat.report` on a real tiny run: the plots hold the run's own points, the summary its
own numbers; a rerun that extends the run is marked; a snapshot of a run still going is reported."""

import json
import re

import pytest
from helpers import STEP_LINE, VAL_LINE, log_lines

from raychat.report.__main__ import main as report_main
from raychat.report.document import build_report
from raychat.storage import Storage
from raychat.telemetry.metrics_log import METRICS_FILE, read_log, read_timeline

pytestmark = pytest.mark.ray


def lines_by_label(ax) -> dict[str, list]:
    return {line.get_label(): line for line in ax.get_lines()}


def test_report_of_a_tiny_run_and_its_rerun(two_worker_run, tmp_path, capsys):
    """conftest's `two_worker_run`: 16 steps on 2 workers in the bucket (evaluated every 8 steps), then
    a rerun to 20 that resumed from the first run's final checkpoint."""
    first, second, storage = two_worker_run.first, two_worker_run.rerun, two_worker_run.storage
    run = Storage(storage).child(two_worker_run.name)
    logged_vals = {int(m.group(1)): float(m.group(2))
                   for out in (first.stdout, second.stdout) for m in log_lines(out, VAL_LINE)}
    assert sorted(logged_vals) == [0, 8, 16, 20]  # eval 16 ran in both runs: the rerun's is kept

    report = build_report(run)
    # Loss and val bpb against step: one point per step 0..19 (the rerun resumed from the first run's
    # final checkpoint, 16), one per eval; the rerun is marked at step 16.
    loss_fig = report.figures["loss.png"]
    (by_step, bpb_step), (by_flops, bpb_flops) = loss_fig.axes[0:2], loss_fig.axes[2:4]
    step_loss = lines_by_label(by_step)["smoothed (log line)"]
    assert list(step_loss.get_xdata()) == list(range(20))
    logged_losses = [float(m.group(4)) for m in log_lines(second.stdout, STEP_LINE)]
    assert [round(y, 6) for y in step_loss.get_ydata()[16:]] == logged_losses  # the rerun's 16..19
    bpb = lines_by_label(bpb_step)["val bpb"]
    assert list(bpb.get_xdata()) == [0, 8, 16, 20]
    assert [round(y, 6) for y in bpb.get_ydata()] == [logged_vals[s] for s in (0, 8, 16, 20)]
    plan = report.facts.plan
    per_step = plan["total_batch_size"] * plan["flops_per_token"]
    # the eval before the first step (0 FLOPs) has no place on a log axis
    assert list(lines_by_label(bpb_flops)["val bpb"].get_xdata()) == [s * per_step for s in (8, 16, 20)]
    assert list(lines_by_label(by_flops)["step loss"].get_xdata()) == [(s + 1) * per_step for s in range(20)]
    assert by_flops.get_xscale() == "log"
    resume = lines_by_label(by_step)["resume"]
    assert list(resume.get_xdata()) == [16, 16]
    lrm = lines_by_label(report.figures["lrm.png"].axes[0])["lrm"]
    assert len(lrm.get_xdata()) == 20 and lrm.get_ydata()[0] < lrm.get_ydata()[3]  # warmup of 2 steps
    tok_ax, mfu_ax = report.figures["throughput.png"].axes
    assert len(lines_by_label(tok_ax)["tokens/s"].get_xdata()) == 20
    assert "MFU not available" in mfu_ax.texts[0].get_text()  # CPU: no MFU, and the plot says why

    # The printed summary, with the run's own numbers; the files written beside the run.
    assert report_main(["--run-name", two_worker_run.name, "--storage-path", storage]) == 0
    out = capsys.readouterr().out
    scaling = plan["scaling_params"]
    assert "trained: 20 of 20 steps, 20,480 tokens (finished)" in out
    assert f"tokens:params {20480 / scaling:.2f} so far, {plan['tokens_per_param']:.2f} planned" in out
    assert "depth 2, width 64, 2 heads" in out and f"scaling (matrices + lm_head) {scaling:,}" in out
    for step, value in logged_vals.items():  # the table rounds the logged value to 4 decimals
        row = re.search(rf"^\| {step} \| {step * 1024:,} \| [^|]+ \| (\d\.\d{{4}}) \|$", out, re.M)
        assert row and abs(float(row.group(1)) - value) <= 0.5e-4 + 1e-9, (step, value, out[:2000])
    assert "under-trained for its size" in out and "MFU not available" in out
    assert "1 resume at step(s) 16: 0 step(s) redone" in out
    assert "peak memory (rank 0):" in out and "MiB" in out
    assert "At step 20:" in out and "The capital of France is" in out
    written = run.child("report")
    assert all(written.exists(name) for name in ("report.md", "loss.png", "throughput.png", "lrm.png",
                                                 "time.png"))
    assert "![loss.png](loss.png)" in written.read_text("report.md")
    # The time ledger counts each driver's own time, not the time between the two (raychat.telemetry.ledger).
    ledger = report.timeline.ledger
    assert [(a.kind, a.step) for a in ledger.attempts] == [("first", 0), ("first", 16)]
    assert 0 < ledger.goodput < 1 and f"goodput {100 * ledger.goodput:.1f}%" in out

    # A snapshot: the log as it stood after the first run's step 5 (a run still going).
    records = read_log(run).splitlines()  # (in a bucket: its parts, in order)
    cut = next(i for i, r in enumerate(map(json.loads, records)) if r["kind"] == "step" and r["step"] == 5)
    partial = Storage(str(tmp_path / "partial")).child("basic")
    partial.write_bytes(METRICS_FILE, "\n".join(records[:cut + 1]).encode() + b"\n")
    snapshot = build_report(partial)
    assert [r["step"] for r in read_timeline(partial).steps] == list(range(6))
    text = snapshot.summary()
    assert "trained: 6 of 16 steps" in text and "snapshot" in text
    assert "peak memory: known at the end of the run" in text and "no samples yet" in text
