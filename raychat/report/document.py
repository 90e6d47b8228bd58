"""report.md and its PNG plots for one run, from its metrics log, written to a directory or a URI.

The files are made in a temporary directory and then copied to their destination through
raychat.storage, so `--out s3://bucket/reports/r` works as a local directory does.
"""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raychat.common import RaychatError, require_extra
from raychat.locations import join_uri
from raychat.report.findings import findings
from raychat.report.summary import (
    Facts,
    eval_table,
    facts,
    horizon_lines,
    mfu_note,
    model_lines,
    sample_lines,
    throughput_lines,
)
from raychat.storage import Location, Storage
from raychat.telemetry.metrics_log import METRICS_FILE, Timeline, read_timeline

if TYPE_CHECKING:  # matplotlib is the `report` extra: imported where a report is drawn
    from matplotlib.figure import Figure

REPORT_FILE = "report.md"
REPORT_DIR = "report"  # the default --out: <storage>/<run>/report


@dataclass
class RunReport:
    """A run's report before it is written: the markdown and the figures by file name."""

    name: str
    facts: Facts
    timeline: Timeline
    findings: list[str]
    figures: "dict[str, Figure]"

    def sections(self) -> list[tuple[str, list[str]]]:
        f, t = self.facts, self.timeline
        return [("Model", model_lines(f)), ("Batch and horizon", horizon_lines(f, t)),
                ("Throughput and memory", throughput_lines(f, t)), ("Time and goodput", t.ledger.lines()),
                ("Validation bpb", eval_table(f, t)),
                ("Findings", [f"- {line}" for line in self.findings]), ("Samples", sample_lines(t))]

    def summary(self) -> str:
        """The printed summary: the report's sections without the plots."""
        return "\n".join(f"\n## {title}\n" + "\n".join(lines) for title, lines in self.sections()).strip()

    def markdown(self) -> str:
        plots = [f"![{name}]({name})" for name in self.figures]
        return f"# Run {self.name}\n\n" + self.summary() + "\n\n## Plots\n\n" + "\n\n".join(plots) + "\n"


def build_report(run: Storage) -> RunReport:
    """The report of the run at `run`, or a RaychatError saying why there is none (yet)."""
    require_extra("matplotlib", "report", "a run's report")
    from raychat.report.plots import loss_figure, lr_figure, throughput_figure, time_figure

    try:
        with run.read_faults_as_errors():
            timeline = read_timeline(run)
            if timeline is None or not timeline.starts:
                where = "no run there" if not run.exists() else f"no {METRICS_FILE} in it yet"
                raise RaychatError(f"cannot report on {run.location}: {where}; check --run-name and "
                                   "--storage-path (a run writes its metrics log once its first worker "
                                   "group has started)")
        f = facts(timeline)
        figures = {"loss.png": loss_figure(timeline, f.eval_flops, f.markers),
                   "throughput.png": throughput_figure(timeline, f.markers, mfu_note(f.start)),
                   "lrm.png": lr_figure(timeline, f.markers), "time.png": time_figure(timeline.ledger)}
        report = RunReport(run.name, f, timeline, findings(f, timeline), figures)
        report.markdown()  # every section read from the log here, where a malformed record is named
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
        # A record missing a field or holding the wrong type: a log edited by hand or damaged.
        raise RaychatError(f"{join_uri(run.location, METRICS_FILE)} is not a metrics log raychat.train wrote "
                           f"({type(e).__name__}: {e}): restore it, or delete its malformed lines") from None
    return report


def write_run_report(run: Storage, out: Location, log: Callable[[str], None] = print) -> RunReport:
    """Write report.md and the PNGs of the run at `run` into `out` (a directory or a URI)."""
    report = build_report(run)
    from raychat.report.plots import save_figure

    target = Storage.of(out)
    with tempfile.TemporaryDirectory(prefix="raychat-report-") as tmp:
        files = {REPORT_FILE: report.markdown().encode()}
        for name, fig in report.figures.items():
            save_figure(fig, Path(tmp) / name)
            files[name] = (Path(tmp) / name).read_bytes()
        for name, data in files.items():
            target.write_bytes(name, data)
    log(f"Wrote {join_uri(target.location, REPORT_FILE)} and {', '.join(report.figures)}")
    return report
