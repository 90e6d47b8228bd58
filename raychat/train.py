"""`python -m raychat.train`: the command line over the run's driver (raychat.run.driver).

Alone on a machine it starts a local Ray instance (dashboard on 127.0.0.1) and, when the data dir
is empty, prepares a corpus and trains a tokenizer, so one command works offline on a fresh box.
Under `ray job submit` (or with RAY_ADDRESS) it joins that cluster. Everything is checked before any
worker starts: a bad corpus, tokenizer or storage path fails in seconds with one line, not hours in.
"""

import argparse
import time

from raychat.common import run_cli
from raychat.config import add_config_flags, config_from_args, preset_note
from raychat.data.budget import corpus_budget_lines
from raychat.elastic.cadence import plan_line, replica_line
from raychat.run.driver import connect_ray, disconnect_ray, fit_run, summary_lines
from raychat.run.prepare import prepare_run
from raychat.scaling import format_plan

EPILOG = """\
Examples:
  python -m raychat.train --preset cpu     # small model, minutes on a laptop CPU
  python -m raychat.train --depth 12 --num-workers 8
  ray job submit --working-dir . -- python -m raychat.train --depth 24 \\
      --num-workers 8:16 --storage-path s3://bucket/runs
Re-running with the same --run-name resumes that run from its latest checkpoint."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.train",
        description="Pretrain a nanochat-style GPT on a Ray cluster (or a local Ray instance). "
                    "--depth sets the model; the scaling rules derive horizon, batch size, learning rates "
                    "and weight decay from it. Prints the plan, then one line per step.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(argv))
    run = prepare_run(cfg)
    print(format_plan(run.plan), flush=True)
    if (note := preset_note(run.cfg.preset)) is not None:
        print(note, flush=True)
    print(plan_line(run.cfg.save_every, run.cfg.max_lost_minutes), flush=True)
    print(replica_line(run.cfg.replicate_every), flush=True)
    for line in corpus_budget_lines(run.plan, run.index, run.tokenizer):
        print(line, flush=True)
    connected_here = connect_ray(run.cfg)
    t0 = time.time()
    result = fit_run(run)
    print("\n".join(summary_lines(run, result, time.time() - t0)), flush=True)
    if connected_here:
        disconnect_ray()
    return 0


if __name__ == "__main__":
    run_cli(main)
