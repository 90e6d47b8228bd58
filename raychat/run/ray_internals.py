"""Every private Ray API raychat uses, in one place, each with why no public API does the job.

Private names move between Ray releases without notice. When one does, tests/test_ray_internals.py
fails with the installed Ray version in its message, and this module is the one to fix. Used by
raychat.run.console (the driver's log printer), raychat.run.elastic (controller callbacks, the
cluster view and its reservations, the preemption flag) and nothing else.
"""

from ray._private.ray_logging import global_worker_stdstream_dispatcher
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.context import get_train_context
from ray.train.v2._internal.execution.controller.state import (
    ReschedulingState,
    ResizingState,
    RestartingState,
)

# The dispatcher that hands every batch of worker output forwarded to the driver to its printers
# (`handlers`, `add_handler`, `remove_handler`). Ray has no public per-line opt-out of its
# "(RayTrainWorker pid=...)" prefix; replacing its printer is how the run's own lines print bare.
STDSTREAM_DISPATCHER = global_worker_stdstream_dispatcher

# Ray Train V2's controller hooks: `after_controller_state_update` sees the controller enter
# ResizingState (a planned resize of a healthy group) or RestartingState / ReschedulingState (a
# restart after a failure); `before_controller_execute_resize_decision` runs before the old group is
# shut down. ray.train offers no public callback at those points; raychat saves before a planned
# resize and refreshes the cluster view before a restart there.
__all__ = ["ControllerCallback", "ReschedulingState", "ResizingState", "RestartingState"]

# The named actor (name, namespace) of Ray Data's autoscaling coordinator, which Ray Train's elastic
# policy asks how many workers fit. It re-reads the cluster only every 20 s unless asked to with
# `get_reserved_resources(requester, recompute=True)`; nothing public triggers that re-read.
AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")


def train_requester_id(run_id: str) -> str:
    """The id under which a Train controller's scaling policy registers its resource request with
    that coordinator (`after_controller_start` in ray/train/v2/_internal/execution/scaling_policy/
    scaling_policy.py), and cancels it at shutdown: `cancel_request(id)` is how a later driver
    frees what a killed controller left reserved; nothing public lists or cancels requests."""
    return f"train-{run_id}"


def preemption_noticed() -> bool:
    """Has Ray marked this worker's node as draining (a spot reclaim)? Read from the worker's own
    train context: the public ray.train.get_preemption_info() is a barrier across all workers, too
    costly to call every step."""
    context = getattr(get_train_context(), "preemption_context", None)
    return getattr(context, "preemption_info", None) is not None
