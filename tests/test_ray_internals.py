"""The private Ray APIs raychat.ray_glue.ray_internals names are still where, and what, raychat expects.

These fail with the installed Ray version in the message, so an upgrade that moves one says which.
"""

import importlib
import inspect
import logging
import os
import subprocess
import sys

import pytest
import ray

NEEDED = f"raychat.ray_glue.ray_internals needs it; installed Ray {ray.__version__}"


def _module(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"a private Ray import moved: {e} ({NEEDED})")


def _require(obj: object, attribute: str, where: str) -> object:
    if not hasattr(obj, attribute):
        pytest.fail(f"{where} has no `{attribute}` ({NEEDED})")
    return getattr(obj, attribute)


@pytest.mark.unit
def test_stdstream_dispatcher_has_the_handler_api():
    dispatcher = _require(_module("raychat.ray_glue.ray_internals"), "STDSTREAM_DISPATCHER", "ray_internals")
    for name in ("add_handler", "remove_handler", "handlers"):
        _require(dispatcher, name, "ray._private.ray_logging.global_worker_stdstream_dispatcher")
    assert isinstance(dispatcher.handlers, list), NEEDED


@pytest.mark.unit
def test_controller_callback_hooks_and_states_exist():
    internals = _module("raychat.ray_glue.ray_internals")
    ControllerCallback = internals.ControllerCallback
    for hook in ("after_controller_state_update", "before_controller_execute_resize_decision"):
        _require(ControllerCallback, hook, "ray.train.v2 ControllerCallback")
    params = list(inspect.signature(ControllerCallback.after_controller_state_update).parameters)
    assert params[1:] == ["previous_state", "current_state"], f"hook arguments are {params} ({NEEDED})"
    for state in ("ReschedulingState", "ResizingState", "RestartingState", "RunningState", "SchedulingState"):
        assert inspect.isclass(getattr(internals, state)), f"{state} is not a class ({NEEDED})"
    # A new group's start is SchedulingState -> RunningState, the decision carrying its size.
    assert "scaling_decision" in inspect.signature(internals.SchedulingState).parameters, NEEDED


@pytest.mark.unit
def test_train_context_carries_the_preemption_info():
    context = _module("ray.train.v2._internal.execution.context")
    preemption = _module("ray.train.v2._internal.execution.preemption")
    assert callable(_require(context, "get_train_context", context.__name__)), NEEDED
    fields = getattr(_require(context, "TrainContext", context.__name__), "__dataclass_fields__", {})
    assert "preemption_context" in fields, f"TrainContext has no `preemption_context` ({NEEDED})"
    PreemptionContext = _require(preemption, "PreemptionContext", preemption.__name__)
    assert PreemptionContext().preemption_info is None, NEEDED
    info = _require(preemption, "PreemptionInfo", preemption.__name__)
    fields = getattr(info, "__dataclass_fields__", {})
    assert "deadline_ms" in fields, f"PreemptionInfo has no deadline ({NEEDED})"


@pytest.mark.unit
def test_autoscaling_coordinator_can_be_asked_to_recompute():
    module = _module("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator")
    actor = _require(module, "_AutoscalingCoordinatorActor", module.__name__)
    method = _require(actor, "get_reserved_resources", "_AutoscalingCoordinatorActor")
    params = inspect.signature(method).parameters
    assert "recompute" in params, f"get_reserved_resources takes no `recompute` ({NEEDED})"
    source = inspect.getsource(module.get_or_create_autoscaling_coordinator)
    name, namespace = _module("raychat.ray_glue.ray_internals").AUTOSCALING_COORDINATOR
    assert f'name="{name}"' in source and f'namespace="{namespace}"' in source, (
        f"the autoscaling coordinator actor is no longer named {name!r} in {namespace!r} ({NEEDED})")


@pytest.mark.unit
def test_a_train_controllers_resource_request_can_be_found_and_cancelled():
    """raychat.elastic releases a killed controller's request by the id Ray Train registers it under."""
    module = _module("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator")
    actor = _require(module, "_AutoscalingCoordinatorActor", module.__name__)
    cancel = _require(actor, "cancel_request", "_AutoscalingCoordinatorActor")
    params = list(inspect.signature(cancel).parameters)
    # Once the class has been made an actor, Ray's tracing hook appends `_ray_trace_ctx` to each method.
    assert params[1:2] == ["requester_id"], f"cancel_request takes {params} ({NEEDED})"
    policy = _module("ray.train.v2._internal.execution.scaling_policy.scaling_policy")
    source = inspect.getsource(_require(policy, "ScalingPolicy", policy.__name__).after_controller_start)
    assert 'f"train-{train_run_context.run_id}"' in source, f"Train's requester id changed ({NEEDED})"
    assert _module("raychat.ray_glue.ray_internals").train_requester_id("abc") == "train-abc", NEEDED


def _logger_of(module_name: str) -> tuple[object, str]:
    """A Ray module's own logger (`logger = logging.getLogger(__name__)`) and the module's source."""
    module = _module(module_name)
    logger = _require(module, "logger", module_name)
    assert logger.name == module_name, f"{module_name} logs as {logger.name!r} ({NEEDED})"
    return logger, inspect.getsource(module)


@pytest.mark.unit
def test_the_loggers_of_rays_chatter_still_say_it():
    """raychat.ray_glue.quiet silences these loggers by name: each still exists and still says its line."""
    internals = _module("raychat.ray_glue.ray_internals")
    for name, phrase in internals.CHATTY_LOGGERS.items():
        _, source = _logger_of(name)
        assert phrase in source, f"{name} no longer says {phrase!r} ({NEEDED})"
    _, source = _logger_of(internals.TOKEN_AUTH_LOGGER)
    assert "Token authentication is enabled for this Ray cluster" in source, NEEDED
    context = _module("ray.train.v2._internal.execution.context")
    assert context.__file__ == internals.TRAIN_REPORT_LOGGER, NEEDED
    source = inspect.getsource(context)
    assert "logging.getLogger(__file__)" in source and "Reporting training result" in source, NEEDED
    name, prefix = internals.PROGRESS_NOTICE
    _, source = _logger_of(name)
    assert prefix in source, f"{name} no longer says {prefix!r} ({NEEDED})"


@pytest.mark.unit
def test_ray_datas_console_is_a_stream_handler_beside_its_file_handler():
    """raychat.ray_glue.quiet raises Ray Data's console handler to WARNING and leaves its file handler at
    INFO: the console is the one StreamHandler, the file handler is not one."""
    import ray.data  # noqa: F401  (configures the logger)

    internals = _module("raychat.ray_glue.ray_internals")
    handlers = logging.getLogger(internals.RAY_DATA_LOGGER).handlers
    console = internals.ray_data_console_handlers()
    assert len(console) == 1 and len(handlers) == 2, f"Ray Data's handlers changed: {handlers} ({NEEDED})"
    assert any(type(h).__name__ == "SessionFileHandler" for h in handlers if h not in console), NEEDED


@pytest.mark.unit
def test_rays_preemption_watcher_is_still_created_so():
    """The ERROR line the driver drops comes from Ray's own PreemptionCallback: a restartable actor
    created with the workers' actor handles as constructor arguments. When Ray changes that, the
    line (and raychat's filter) can go."""
    callback = _module("ray.train.v2._internal.callbacks.preemption_callback")
    start = _require(callback, "PreemptionCallback", callback.__name__).after_worker_group_start
    source = inspect.getsource(start)
    assert "max_restarts=-1)(PreemptionWatcher)" in source and "worker_actors_by_rank=" in source, NEEDED
    line = ("[2026-12-02 23:21:54,518 E 29379 29379] core_worker.cc:2465: Actor with class name: "
            "'PreemptionWatcher' and ID: '62f1b2022e5f3a32440d702501000000' has constructor arguments in the "
            "object store and max_restarts > 0. If the arguments in the object store go out of scope or are "
            "lost, the actor restart will fail.")
    assert _module("raychat.ray_glue.ray_internals").PREEMPTION_WATCHER_ARGS.search(line)


@pytest.mark.unit
def test_a_trainer_without_datasets_starts_no_ray_data_manager():
    """raychat's trainer drops Ray Train's DatasetsCallback (a DatasetManager actor per attempt) when it
    was given no datasets, and keeps it when it was: the hook it overrides still lists that callback."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from raychat.run.driver import RaychatTrainer

    _require(TorchTrainer, "_create_default_callbacks", "ray.train.v2 DataParallelTrainer")
    datasets_callback = _require(_module("ray.train.v2._internal.callbacks"), "DatasetsCallback",
                                 "ray.train.v2._internal.callbacks")

    def kinds(trainer_class: type, **kw) -> list[type]:
        trainer = trainer_class(lambda: None, scaling_config=ScalingConfig(num_workers=1), **kw)
        return [type(c) for c in trainer._create_default_callbacks()]

    assert datasets_callback in kinds(TorchTrainer), f"Ray's trainer no longer sets up datasets so ({NEEDED})"
    assert datasets_callback not in kinds(RaychatTrainer)
    assert kinds(RaychatTrainer) == [k for k in kinds(TorchTrainer) if k is not datasets_callback]
    # (a dataset factory, called only when an attempt starts: building a Dataset would start Ray here)
    assert datasets_callback in kinds(RaychatTrainer, datasets={"train": lambda: None})


@pytest.mark.unit
def test_the_trainer_is_rays_torch_trainer_with_the_flags_timeout():
    """raychat's process group is Ray's own TorchConfig (its backend, init_method, shutdown guard per
    device), given --process-group-timeout-s, Ray's default when not given; the trainer subclass
    overrides nothing of Ray's TorchTrainer but the default callbacks (the test above)."""
    import argparse

    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raychat.config import add_config_flags, config_from_args
    from raychat.run.driver import RaychatTrainer, process_group

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(["--process-group-timeout-s", "60"]))
    trainer = RaychatTrainer(lambda: None, torch_config=process_group(cfg),
                             scaling_config=ScalingConfig(num_workers=2))
    assert isinstance(trainer, TorchTrainer) and type(trainer.backend_config) is TorchConfig
    assert (trainer.backend_config.timeout_s, trainer.backend_config.backend) == (60, "gloo")
    assert process_group(config_from_args(parser.parse_args([]))).timeout_s == TorchConfig().timeout_s
    overridden = {name for name, value in vars(RaychatTrainer).items() if callable(value)}
    assert overridden == {"_create_default_callbacks", "_initialize_and_run_controller"}, overridden


@pytest.mark.unit
def test_an_elastic_runs_controller_gets_the_policy_that_grows_when_it_pays():
    """Ray's trainer hands its controller the scaling policy Ray's factory builds, through the private
    hook raychat's trainer overrides; an elastic one is replaced by raychat's subclass (same config),
    a fixed one is left alone, and the decision method raychat overrides still takes its arguments."""
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from raychat.elastic.controller import GrowWhenItPays, grow_when_it_pays

    internals = _module("raychat.ray_glue.ray_internals")
    _require(DataParallelTrainer, "_initialize_and_run_controller", "ray.train.v2 DataParallelTrainer")
    assert "scaling_policy=create_scaling_policy(" in inspect.getsource(DataParallelTrainer.fit), (
        f"Ray's trainer no longer hands the controller its scaling policy so ({NEEDED})")
    params = list(inspect.signature(internals.ElasticScalingPolicy.make_decision_for_running_worker_group)
                  .parameters)
    assert params[1:] == ["worker_group_state", "worker_group_status"], f"{params} ({NEEDED})"
    factory = _require(_module("ray.train.v2._internal.execution.scaling_policy"), "create_scaling_policy",
                       "ray.train.v2 scaling_policy")
    elastic = factory(ScalingConfig(num_workers=(1, 3)))
    swapped = grow_when_it_pays({"scaling_policy": elastic, "other": 1}, "session")
    assert type(swapped["scaling_policy"]) is GrowWhenItPays and swapped["other"] == 1
    assert swapped["scaling_policy"].scaling_config is elastic.scaling_config
    fixed = factory(ScalingConfig(num_workers=2))
    assert grow_when_it_pays({"scaling_policy": fixed}, "session")["scaling_policy"] is fixed
    # After a veto the autoscaler is asked for the group's size, not Ray's max: no idle nodes held.
    policy = swapped["scaling_policy"]
    _require(internals.ElasticScalingPolicy, "_get_num_workers_for_resource_request", "ElasticScalingPolicy")
    assert policy._get_num_workers_for_resource_request() == 3
    policy.held_at = 2
    assert policy._get_num_workers_for_resource_request() == 2


@pytest.mark.integration  # a subprocess
def test_the_state_api_pin_reads_what_rays_own_lookup_reads():
    """raychat.ray_glue.ray_internals.pin_state_api_to_this_cluster reads the dashboard's address where
    Ray's own address lookup does (ray.dashboard.utils.ray_address_to_api_server_url) and names it in
    the variable Ray's state API reads first; in a process not connected to Ray it does nothing (the
    setup hook that calls it must never fail a worker's start)."""
    from ray.dashboard import utils as dashboard_utils

    lookup = inspect.getsource(dashboard_utils.ray_address_to_api_server_url)
    assert "ray_constants.DASHBOARD_ADDRESS" in lookup and "KV_NAMESPACE_DASHBOARD" in lookup, NEEDED
    first = inspect.getsource(dashboard_utils.get_address_for_submission_client)
    order = first.index("RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE"), first.index("RAY_ADDRESS_ENVIRONMENT")
    assert order[0] < order[1], f"Ray's state API no longer reads RAY_API_SERVER_ADDRESS first ({NEEDED})"
    # A fresh interpreter: this one may be connected to the suite's Ray instance.
    code = ("import os\nfrom raychat.ray_glue.ray_internals import pin_state_api_to_this_cluster as pin\n"
            "pin()\nprint(os.environ.get('RAY_API_SERVER_ADDRESS', 'unset'))")
    env = {k: v for k, v in os.environ.items() if k != "RAY_API_SERVER_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["unset"], done.stderr[-2000:]


@pytest.mark.unit
def test_the_gcs_client_takes_a_deadline_and_refusals_have_their_types():
    """gcs_refusal's one request: InnerGcsClient.standalone(address, cluster_id, timeout_ms), raising
    AuthenticationError for a refused token and RpcError for a server that is not a GCS."""
    client = _require(_module("ray._raylet"), "InnerGcsClient", "ray._raylet")
    standalone = _require(client, "standalone", "ray._raylet.InnerGcsClient")
    assert "timeout_ms" in (standalone.__doc__ or ""), f"{standalone.__doc__} ({NEEDED})"
    for name in ("AuthenticationError", "RpcError"):
        _require(ray.exceptions, name, "ray.exceptions")
