"""The environment the driver hands to Ray workers, without credentials.

Workers are started by each node's raylet, not by the driver, so settings the driver was given
(RAYCHAT_*, WANDB_*, RAY_TRAIN_*, RAY_DATA_*) travel in Ray's runtime environment. Ray stores that
in the job's metadata and shows it to anyone who can read the job list or the dashboard (`ray job
list`, the Jobs page), so credentials stay out of it: a node's wandb reads its key from that node's
own environment (a Kubernetes Secret in cluster/kuberay/, the raylet's environment under `ray up`)
or ~/.netrc, and a local Ray started by the driver inherits the driver's environment anyway.
"""

import json
import re
from collections.abc import Mapping

SETUP_HOOK = "raychat.ray_glue.runtime_env.set_up_worker_process"
# RAY_TRAIN_*: read by the Train controller. RAY_DATA_*: read by each worker's Ray Data pipeline, which
# builds its own DataContext from its environment (raychat.run.driver.RaychatTrainer ships it none).
FORWARDED_PREFIXES = ("RAYCHAT_", "WANDB_", "RAY_TRAIN_", "RAY_DATA_")
# Matched anywhere in the name: WANDB_API_KEY, *_TOKEN, *_SECRET, *_PASSWORD and their variants.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return SECRET_NAME.search(name) is not None


def worker_runtime_env(environ: Mapping[str, str]) -> dict:
    """Ray runtime_env for the workers: the non-secret raychat and wandb settings of `environ`."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) and not is_secret_name(k)}
    # Under `ray job submit` the job's own runtime env already reaches every worker, and Ray refuses
    # a driver runtime env that names one of its variables again (ray._private.worker.init).
    job_config = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    for name in ((job_config.get("runtime_env") or {}).get("env_vars") or {}):
        env.pop(name, None)
    # Ray Train's print patch copies every worker print into its logger as well, and where stdout
    # has been wrapped (wandb, Ray Data progress) the step lines then reach the driver twice.
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # Every worker process of the run (Train controller, Train workers, Ray Data tasks, the actors
    # they start) runs set_up_worker_process as it starts.
    return {"env_vars": env, "worker_process_setup_hook": SETUP_HOOK}


def set_up_worker_process() -> None:
    """Ray's setup hook for every process of the run: point Ray's state API at this process's own
    cluster, then silence Ray's chatter unless RAYCHAT_VERBOSE is set (raychat.ray_glue.quiet).

    Ray Train's placement-group cleaner and state actor ask the state API whether an actor lives,
    without an address, and Ray answers from the cluster the machine's last `ray start` recorded
    when nothing else names one (raychat.ray_glue.ray_internals.pin_state_api_to_this_cluster). Asking a
    cluster that is gone stalled the end of every run until the cleaner's stop timed out, and failed
    the state actor's checks. RAY_ADDRESS stays as it is: raychat reads it as "the driver
    joined a cluster" (raychat.model.precision, raychat.model.compile_check, raychat.evaluate)."""
    from raychat.ray_glue.quiet import quiet_ray
    from raychat.ray_glue.ray_internals import pin_state_api_to_this_cluster

    pin_state_api_to_this_cluster()
    quiet_ray()
