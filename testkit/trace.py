"""The consumption trace that the exactly-once audits read (tests/trace_audit.py, testkit.chaos_audit):
a step observer (raychat.worker.observer) that appends one JSON line per step to
`$RAYCHAT_TRACE_DIR/<attempt>_rank<r>_<pid>.jsonl`: the documents the rank trained on and the newest
step of its state its memory-tier holders took (a peer node's: "replica"; any: "sent").

A run gets it by its environment (`trace_env`), which the driver forwards to every worker.
"""

import json
import os
from pathlib import Path

from raychat.worker.observer import OBSERVER_ENV, StepSeen

TRACE_DIR_ENV = "RAYCHAT_TRACE_DIR"


class ConsumptionTrace:
    records_documents = True

    def __init__(self) -> None:
        self.directory = Path(os.environ[TRACE_DIR_ENV])

    def step_done(self, seen: StepSeen) -> None:
        pid = os.getpid()
        with (self.directory / f"{seen.attempt}_rank{seen.rank}_{pid}.jsonl").open("a") as f:
            f.write(json.dumps({"attempt": seen.attempt, "step": seen.step, "rank": seen.rank,
                                "world_size": seen.world_size, "pid": pid, "ids": seen.documents,
                                "replica": seen.replica, "sent": seen.sent}) + "\n")


def trace_env(directory: str | Path) -> dict[str, str]:
    """The environment that makes a run's workers write the trace to `directory`."""
    return {OBSERVER_ENV: f"{__name__}:ConsumptionTrace", TRACE_DIR_ENV: str(directory)}
