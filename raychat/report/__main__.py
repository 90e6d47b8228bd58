"""`python -m raychat.report --run-name R`: a run's report.md, plots and printed summary."""

import argparse

from raychat.common import run_cli
from raychat.report.document import REPORT_DIR, write_run_report
from raychat.storage import run_directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.report",
        description="Report on one training run from its metrics log (<storage>/<run>/metrics.jsonl): "
                    "writes report.md and PNG plots (training loss and val bpb against step and FLOPs, "
                    "tokens/s and MFU, the learning-rate multiplier; restarts and resizes marked) and "
                    "prints the summary: model, batch and horizon, tokens:params against Chinchilla's ~20, "
                    "throughput and memory, val bpb by eval, the last samples and findings.",
        epilog="examples:\n  python -m raychat.report --run-name d4\n"
               "  python -m raychat.report --run-name d20 --storage-path s3://bucket/runs \\\n"
               "      --out ./d20-report\n"
               "Works while the run is going (a snapshot of it so far) and after it ended.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-name", required=True, help="the run's --run-name")
    parser.add_argument("--storage-path", default="",
                        help="the run's --storage-path, a directory or a URI (default: $RAYCHAT_HOME/runs)")
    parser.add_argument("--out", default="", help="where to write report.md and the PNGs, a directory or a "
                        f"URI (default: <storage>/<run>/{REPORT_DIR})")
    args = parser.parse_args(argv)
    run = run_directory(args.storage_path, args.run_name)
    report = write_run_report(run, args.out or run.child(REPORT_DIR))
    print(report.summary())
    return 0


if __name__ == "__main__":
    run_cli(main)
