"""bench.chaos's verdict on each run (from testkit.chaos_audit's counts) and its table, printed and
added to bench/RESULTS.md."""

import os
import platform
import time
from pathlib import Path

from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.checkpoint.format import read_meta
from raychat.storage import Storage
from raychat.telemetry.ledger import Ledger
from raychat.telemetry.metrics_log import read_timeline
from testkit.chaos_audit import attempt_spans, document_counts, read_records, redone_by_attempt, weights_equal

SECTION = "## Chaos: faults on a multi-node cluster (bench/chaos.py)"
INTRO = ("`python -m bench.chaos` (see its --help): an elastic run (`--num-workers 1:2`, tiny d2 model, "
         "2048-token steps, a checkpoint every 10 steps, 3 kept) on a `ray.cluster_utils.Cluster` under a "
         "seeded schedule of faults, then audited: documents from the trainer's trace, checkpoints "
         "watched while it ran, final weights against a run with no faults at 2 workers.")


def run_ledger(run_dir: Storage) -> Ledger:
    """The run's time ledger (raychat.telemetry.ledger) from its metrics log; empty when it has none."""
    timeline = read_timeline(run_dir)
    return timeline.ledger if timeline is not None else Ledger(0.0, [])


def attribute_restarts(run, records: list[dict]) -> int:
    """Add each restart's redone steps to the fault injected last before it started; returns the
    restarts no fault explains."""
    unprovoked = 0
    for start, redone in redone_by_attempt(records):
        before = [f for f in run.schedule if f.injected_at is not None and f.injected_at <= start]
        if before:
            before[-1].redone += redone
        else:
            unprovoked += 1
    return unprovoked


def audit_run(run, data_dir: Path, reference: Storage | None) -> dict:
    """Every check of one chaos run, as numbers and a verdict (`ok`); an audit that cannot read
    what the run left is a failed check, not a lost measurement."""
    try:
        return checked_run(run, data_dir, reference)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return {"name": run.spec.name, "steps": run.spec.steps, "faults": [vars(f) for f in run.schedule],
                "injected": 0, "survived": 0, "redone": 0, "unprovoked_restarts": 0, "world_sizes": [],
                "documents": None, "lost": None, "repeated": None, "weights": "n/a", "final": None,
                "exit_code": run.exit_code, "problems": [f"audit failed: {type(e).__name__}: {e}"],
                "goodput": None, "ledger": [], "ok": False}


def checked_run(run, data_dir: Path, reference: Storage | None) -> dict:
    records = read_records(run.trace)
    unprovoked = attribute_restarts(run, records)
    problems, final, docs = [], None, {}
    if run.exit_code == 0 and not run.stopped:
        spans = attempt_spans(records)
        problems, final = run.watch.final_problems(run.spec.steps, spans[-1][2] if len(spans) > 1 else None)
    else:
        problems.append(run.stopped or f"the driver exited {run.exit_code}: see {run.drivers[-1]}")
    if final is not None:
        docs = document_counts(records, data_dir, read_meta(final).cursor)
        if docs["steps"] != list(range(run.spec.steps)):
            problems.append("the final timeline does not train every step once")
        if not docs["epoch1_passed"] or docs["epoch1_lost"] or docs["repeated"] or docs["trained_and_owed"]:
            problems.append(f"documents: {docs['epoch1_lost']} lost, {docs['repeated']} repeated, "
                            f"{docs['trained_and_owed']} trained and still owed, epoch 1 passed: "
                            f"{docs['epoch1_passed']}")
    sizes = [size for _, size, _, _ in attempt_spans(records)]
    weights = "n/a (world size changed)" if len(set(sizes)) > 1 else "n/a (no reference)"
    if final is not None and reference is not None and len(set(sizes)) == 1:
        equal, diff = weights_equal(final, latest_valid_checkpoint(reference))
        weights = "bit-identical" if equal else f"DIFFER (max |diff| {diff:.3g})"
        if not equal:
            problems.append("final weights differ from the reference at the same world size")
    faults = [{k: v for k, v in vars(f).items()} for f in run.schedule]
    injected = [f for f in run.schedule if f.injected_at is not None]
    survived = [f for f in injected if f.survived]
    if len(survived) < len(injected):
        problems.append(f"{len(injected) - len(survived)} fault(s) not survived")
    if len(injected) < len(run.schedule) and not run.stopped:
        problems.append(f"{len(run.schedule) - len(injected)} fault(s) not injected: the run reached step "
                        f"{run.spec.steps} first")
    ledger = run_ledger(run.run_dir)
    return {"name": run.spec.name, "steps": run.spec.steps, "faults": faults, "injected": len(injected),
            "survived": len(survived), "redone": sum(f.redone for f in run.schedule),
            "unprovoked_restarts": unprovoked, "world_sizes": sizes, "documents": docs.get("documents"),
            "lost": docs.get("epoch1_lost"), "repeated": docs.get("repeated"), "weights": weights,
            "final": str(final) if final else None, "exit_code": run.exit_code, "problems": problems,
            "goodput": ledger.goodput, "ledger": ledger.lines(),
            "ok": not problems and len(injected) == len(run.schedule)}


def fault_rows(summary: dict) -> list[list[str]]:
    rows = [["run", "#", "fault", "at step", "outcome", "seconds", "steps redone", "note"]]
    for run in summary["runs"]:
        for i, f in enumerate(run["faults"], 1):
            outcome = ("not injected" if f["injected_at"] is None
                       else "survived" if f["survived"] else "NOT SURVIVED")
            at = f["injected_step"] if f["injected_step"] is not None else f["at_step"]
            seconds = f["recovery_s"] if f["recovery_s"] is not None else "-"
            rows.append([run["name"], str(i), f["kind"], str(at), outcome, str(seconds),
                         str(f["redone"]), f["note"]])
    return rows


def run_rows(summary: dict) -> list[list[str]]:
    rows = [["run", "faults injected", "survived", "steps redone", "goodput (undisturbed)", "world sizes",
             "documents trained", "epoch-1 lost", "repeated", "checkpoints", "final weights vs reference",
             "verdict"]]
    reference = summary.get("reference_goodput")
    undisturbed = f" ({100 * reference:.1f}%)" if reference is not None else ""
    for run in summary["runs"]:
        checkpoint_problems = [p for p in run["problems"] if "checkpoint" in p]
        goodput = "-" if run.get("goodput") is None else f"{100 * run['goodput']:.1f}%{undisturbed}"
        rows.append([run["name"], f"{run['injected']}/{len(run['faults'])}", str(run["survived"]),
                     str(run["redone"]), goodput, ",".join(map(str, run["world_sizes"])),
                     str(run["documents"]),
                     str(run["lost"]), str(run["repeated"]),
                     "; ".join(checkpoint_problems) or ("final whole and verified, kept the newest 3"
                                                        if run["final"] else "-"),
                     run["weights"], "ok" if run["ok"] else "FAILED: " + "; ".join(run["problems"])])
    return rows


def print_table(summary: dict) -> None:
    for rows in (fault_rows(summary), run_rows(summary)):
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), flush=True)
        print(flush=True)
    for run in summary["runs"]:  # where each run's time went, each restart's by cause (telemetry.ledger)
        print("\n".join([f"{run['name']}: time ledger", *run.get("ledger", [])]) + "\n", flush=True)


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def write_results(path: Path, summary: dict) -> None:
    """Add this invocation's tables to the Chaos section of `path` (the section is made if missing)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(summary["started"]))
    command = "python -m bench.chaos" + (" --short" if summary["mode"] == "short" else "")
    entry = (f"**{when}, `{command} --seed {summary['seed']}`**, {summary['seconds']:.0f} s on "
             f"{summary['machine']}."
             f"\n\n{markdown(fault_rows(summary))}\n\n{markdown(run_rows(summary))}\n")
    add_to_section(path, SECTION, INTRO, entry)


def add_to_section(path: Path, section: str, intro: str, entry: str) -> None:
    """Append `entry` to the end of `section` (a `## ` heading) of the markdown file `path`, making the
    section with its `intro` at the end of the file if it is missing."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if section not in text:
        text = text.rstrip("\n") + f"\n\n{section}\n\n{intro}\n"
    head, rest = text.split(section, 1)
    following = rest.find("\n## ")
    body, tail = (rest, "") if following < 0 else (rest[:following + 1], rest[following + 1:])
    path.write_text(head + section + body.rstrip("\n") + "\n\n" + entry + ("\n" + tail if tail else ""))


def machine() -> str:
    """Where the numbers were measured, and how busy the machine was (it is shared)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.node()}, {os.cpu_count()} cores ({model}), load average at the end {load}"
