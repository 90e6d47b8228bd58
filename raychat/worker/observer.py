"""A hook on every step, for what audits a run from outside: tests and benches install one (the chaos
bench's exactly-once audit reads which documents each rank trained on at each step); a run has none.

Workers are processes Ray starts, so the hook is named, not passed: `RAYCHAT_STEP_OBSERVER` holds
`module:factory`, and each worker calls the factory once per attempt. Recording each step's
documents costs the loader memory for the whole run, so the loader keeps them only when an observer
asks (`records_documents`).
"""

import importlib
import os
from dataclasses import dataclass
from typing import Protocol

from raychat.common import RaychatError

OBSERVER_ENV = "RAYCHAT_STEP_OBSERVER"


@dataclass(frozen=True)
class StepSeen:
    """One rank's step, as an observer sees it once the step is trained."""

    attempt: str  # one id per start of the worker group (rank 0's): redone steps told apart
    step: int
    rank: int
    world_size: int
    documents: list[list[int]]  # the documents this rank trained on at this step (records_documents)
    replica: int | None  # the newest step of this rank's state a peer node's holder took (None: none)
    sent: int | None  # the newest step any of its holders took, its own node's included


class StepObserver(Protocol):
    records_documents: bool  # the loader keeps each step's document ids for `step_done`

    def step_done(self, seen: StepSeen) -> None: ...


def load_observer() -> StepObserver | None:
    """The observer $RAYCHAT_STEP_OBSERVER names, made for this worker; None when it is not set. A
    value that names no working observer is one RaychatError line: no retry of the attempt mends it."""
    spec = os.environ.get(OBSERVER_ENV, "")
    if not spec:
        return None
    module_name, _, factory_name = spec.partition(":")
    try:
        observer = getattr(importlib.import_module(module_name), factory_name)()
        if not isinstance(observer.records_documents, bool) or not callable(observer.step_done):
            raise TypeError("not a StepObserver")
        return observer
    except Exception as e:  # noqa: BLE001 -- whatever the named code raises, the fix is the variable's
        raise RaychatError(f"{OBSERVER_ENV}={spec!r} names no working step observer ({type(e).__name__}): "
                           "set it to module:factory of an object with records_documents and "
                           "step_done(seen), or unset it") from None
