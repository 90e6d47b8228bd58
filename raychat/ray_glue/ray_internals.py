"""Every private Ray API raychat uses, in one place, each with why no public API does the job.

Private names move between Ray releases without notice. When one does, tests/test_ray_internals.py
fails with the installed Ray version in its message, and this module is the one to fix. Used by
raychat.telemetry.console (the driver's log printer), raychat.elastic (controller callbacks, the
cluster view and its reservations, the preemption flag), raychat.run.driver (the job's recorded
command line, the trainer's default callbacks, a cluster's refusal of the driver), raychat.ray_glue.quiet
(the loggers of Ray's chatter and Ray Data's console handler), raychat.ray_glue.runtime_env (the state
API's cluster) and nothing else.
"""

import logging
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from subprocess import list2cmdline

import psutil
import ray
import ray._private.utils as ray_utils
import ray.exceptions
from ray._private import ray_constants
from ray._private.ray_logging import global_worker_stdstream_dispatcher
from ray._raylet import InnerGcsClient
from ray.experimental import internal_kv

# Ray Train's private names are imported where they are used, not here: every Ray worker process of
# a run imports this module as it starts (raychat.ray_glue.runtime_env's setup hook), and importing
# ray.train there would cost each replica holder, the coordinator and every Ray Data task process
# CPU time at start for names it never uses.

# The dispatcher that hands every batch of worker output forwarded to the driver to its printers
# (`handlers`, `add_handler`, `remove_handler`). Ray has no public per-line opt-out of its
# "(RayTrainWorker pid=...)" prefix; replacing its printer is how the run's own lines print bare.
STDSTREAM_DISPATCHER = global_worker_stdstream_dispatcher

# Ray Train V2's controller hooks: `after_controller_state_update` sees the controller enter
# ResizingState (a planned resize of a healthy group) or RestartingState / ReschedulingState (a
# restart after a failure), and SchedulingState -> RunningState when it has started a new group;
# `before_controller_execute_resize_decision` runs before the old group is shut down. ray.train
# offers no public callback at those points; raychat saves before a planned resize, tells the run's
# coordinator that a new group started, and refreshes the cluster view before a restart there.
#
# Ray Train's elastic scaling policy decides in the controller when to resize a running group
# (`make_decision_for_running_worker_group`: a ResizeDecision or a NoopDecision). Nothing public lets
# a run veto a grow, so raychat's policy subclasses it (raychat.elastic.controller.GrowWhenItPays),
# and the trainer hands it to the controller in place of the one Ray would build
# (`DataParallelTrainer._initialize_and_run_controller(scaling_policy=...)`, private too).
CONTROLLER_NAMES = {
    "ControllerCallback": "ray.train.v2._internal.execution.callback",
    "ElasticScalingPolicy": "ray.train.v2._internal.execution.scaling_policy",
    "NoopDecision": "ray.train.v2._internal.execution.scaling_policy",
    "ResizeDecision": "ray.train.v2._internal.execution.scaling_policy",
    "ReschedulingState": "ray.train.v2._internal.execution.controller.state",
    "ResizingState": "ray.train.v2._internal.execution.controller.state",
    "RestartingState": "ray.train.v2._internal.execution.controller.state",
    "RunningState": "ray.train.v2._internal.execution.controller.state",
    "SchedulingState": "ray.train.v2._internal.execution.controller.state",
}
__all__ = list(CONTROLLER_NAMES)


def __getattr__(name: str) -> object:
    """The controller hooks and states above, imported when first asked for (raychat.elastic)."""
    if name not in CONTROLLER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(CONTROLLER_NAMES[name]), name)

# The named actor (name, namespace) of Ray Data's autoscaling coordinator, which Ray Train's elastic
# policy asks how many workers fit. It re-reads the cluster only every 20 s unless asked to with
# `get_reserved_resources(requester, recompute=True)`; nothing public triggers that re-read.
AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")


def without_dataset_manager(callbacks: list, datasets: dict) -> list:
    """A trainer's default callbacks, less Ray Train's Ray Data set-up when it was given no datasets.

    raychat.run.driver.RaychatTrainer overrides `DataParallelTrainer._create_default_callbacks`
    (private) with this, and that is the one reason it subclasses Ray's TorchTrainer. The set-up
    callback starts a DatasetManager actor at every start and restart, a process of its own that
    imports Ray Data on the CPUs the worker group starts on. It also sends the driver's Ray Data
    context to every worker, whether or not a worker ever asks for a dataset shard. raychat's workers
    never do: each builds its own pipeline (raychat.data.loader). Nothing public leaves it out."""
    from ray.train.v2._internal.callbacks import DatasetsCallback

    if datasets:
        return callbacks
    return [c for c in callbacks if not isinstance(c, DatasetsCallback)]


def pin_state_api_to_this_cluster() -> None:
    """Point Ray's state API in this process at the cluster the process belongs to. Called without an
    address, as Ray Train's controller, placement-group cleaner and state actor call it to ask whether
    an actor lives, it takes RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else the cluster recorded in
    /tmp/ray/ray_current_cluster by the machine's last `ray start`, which need not be this one (a
    local instance the driver started, a cluster stopped or crashed since). The cluster's dashboard
    registers its address in the GCS's internal key-value store, where `ray_address_to_api_server_url`
    reads it; nothing public tells a worker process its own cluster's dashboard."""
    if not internal_kv._internal_kv_initialized():  # not connected: nothing to point at
        return
    address = internal_kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                                           namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    if address:  # none without a dashboard: then there is no state API to ask either
        os.environ[ray_constants.RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE] = f"http://{address.decode()}"


def gcs_refusal(address: str, timeout_s: float = 5.0) -> str | None:
    """Why the Ray cluster at `address` (host:port, where something answers) will not take this
    process as a client, or None when it will: "token" when it refuses the process's token (none,
    or another), "not a GCS" when what answers there is not a Ray cluster's GCS (a dashboard's port,
    another server). One cluster-id request, the first thing `ray.init` makes; ray.init itself
    retries a refusal for ~13 s and waits minutes on a server that is not a GCS, printing as it
    goes. Nothing public reaches a GCS before ray.init; InnerGcsClient is Ray's private client, and
    its `standalone` constructor the one that takes a deadline."""
    try:
        with stderr_silenced():  # the C++ client's own warnings, said better by the caller
            InnerGcsClient.standalone(address, None, int(timeout_s * 1000))
    except ray.exceptions.AuthenticationError:
        return "token"
    except ray.exceptions.RpcError:
        return "not a GCS"
    return None


@contextmanager
def stderr_silenced():
    """File descriptor 2 to /dev/null for the block: Ray's C++ side writes there, not to sys.stderr."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def train_requester_id(run_id: str) -> str:
    """The id under which a Train controller's scaling policy registers its resource request with
    that coordinator (`after_controller_start` in ray/train/v2/_internal/execution/scaling_policy/
    scaling_policy.py), and cancels it at shutdown: `cancel_request(id)` is how a later driver
    frees what a killed controller left reserved; nothing public lists or cancels requests."""
    return f"train-{run_id}"


def preemption_deadline() -> float | None:
    """When Ray will reclaim this worker's node, if it has marked it as draining (a spot notice): UNIX
    seconds, 0.0 for a notice without a deadline; None without a notice. Read from the worker's own
    train context: the public ray.train.get_preemption_info() is a barrier across all workers, too
    costly to call every step."""
    from ray.train.v2._internal.execution.context import get_train_context

    context = getattr(get_train_context(), "preemption_context", None)
    info = getattr(context, "preemption_info", None)
    return None if info is None else (info.deadline_ms or 0) / 1000


def record_command_line_redacted(redact: Callable[[str], str]) -> None:
    """Ray records a driver's command line (`get_entrypoint_name`: the process's argv) as its job's
    entrypoint, which `ray job list`, the dashboard and Ray Train's run state show; nothing public
    sets it. Record it with every argument (and every `--flag=value`'s value) through `redact`, so
    a location's credentials given as a flag show as `***` there. Call before `ray.init`."""

    def shown(arg: str) -> str:
        flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        return flag + equals + redact(value)

    ray_utils.get_entrypoint_name = lambda: list2cmdline([shown(a) for a in psutil.Process().cmdline()])


# Ray's loggers (`logging.getLogger(__name__)` in the module named) whose INFO lines raychat says in
# its own words; raychat.ray_glue.quiet raises them to WARNING. (Ray Train's narration of each attempt is
# silenced through its public LoggingConfig instead: raychat.run.driver.train_logging.) A module that
# moves brings its lines back unnoticed, so the test pins each one.
CHATTY_LOGGERS = {
    # The driver's ray.init: "Started a local Ray instance. View the dashboard at ...", "Connecting to
    # existing Ray cluster at address: ...", "Connected to Ray cluster. View the dashboard at ..."
    # (raychat.run.driver.ray_line says where the dashboard is).
    "ray._private.worker": "View the dashboard at",
}
# The driver's ray.init of a local cluster logs "Token authentication is enabled for this Ray cluster"
# (a WARNING about Ray's default, not about the run) and "Generated new authentication token and saved
# to ~/.ray/auth_token" (INFO), and nothing else here; raychat.run.driver.connect_ray raises this
# logger to ERROR around ray.init and says what it means for the user in one line of its own.
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
# Ray Train's logger of "Reporting training result N: TrainingReport(...)" at every report (INFO):
# `logging.getLogger(__file__)` in ray/train/v2/_internal/execution/context.py.
# (Its path, without importing it: the setup hook silences it in every process as it starts.)
TRAIN_REPORT_LOGGER = os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution",
                                   "context.py")


# Ray Data's logging (ray/data/_internal/logging.py, DEFAULT_CONFIG, applied when ray.data is
# imported): logger "ray.data" with a console handler (ray._private.log.PlainRayHandler, a
# StreamHandler) beside a file handler (SessionFileHandler, ray-data.log in the session's log
# directory, not a StreamHandler). Nothing public sets the console's level alone; raychat.ray_glue.quiet
# raises it to WARNING so the per-dataset lines stay in the file.
RAY_DATA_LOGGER = "ray.data"


def ray_data_console_handlers() -> list[logging.Handler]:
    """The console handlers of Ray Data's logger (configured by `import ray.data`)."""
    return [h for h in logging.getLogger(RAY_DATA_LOGGER).handlers if isinstance(h, logging.StreamHandler)]


# Ray Data's notice that its progress bars are off (a WARNING, once per process, logger
# "ray.data._internal.progress", `get_progress_manager`): raychat's loader turns them off on purpose.
PROGRESS_NOTICE = ("ray.data._internal.progress", "Progress bars disabled")

# An ERROR the Train controller's core worker logs at every worker-group start (core_worker.cc:
# "Actor with class name: 'PreemptionWatcher' ... has constructor arguments in the object store and
# max_restarts > 0"). Ray's own doing: PreemptionCallback.after_worker_group_start (ray/train/v2/
# _internal/callbacks/preemption_callback.py) creates that actor with max_restarts=-1 and the
# workers' actor handles as constructor arguments; raychat passes nothing to it (it needs the
# watcher: the preemption flag above). A C++ log line, so the driver's printer drops it.
PREEMPTION_WATCHER_ARGS = re.compile(
    r"Actor with class name: 'PreemptionWatcher' .* has constructor arguments in the object store")
