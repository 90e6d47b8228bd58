"""cluster/: every launcher YAML passes the validation `ray up` runs (Ray's schema, no cloud contacted),
installs exactly the Ray that pyproject.toml pins, keeps the dashboard local and token auth on; the
Grafana dashboard parses and charts every raychat_ gauge."""

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers import HEALTH_CHECKS, pyproject_ray_pin
from ray.autoscaler._private.util import prepare_config, validate_config

from raychat.telemetry.sinks import GAUGES

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAMLS = sorted((ROOT / "cluster").glob("*.yaml"))
RAY_PIN = re.compile(r"ray\[[a-z,]+\]==[0-9][0-9.]*")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def ray_up_validate(config: dict) -> dict:
    """What `ray up` does before it touches a cloud: merge the provider's defaults, then check the
    result against ray-schema.json and Ray's own rules (commands._bootstrap_config)."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def all_commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for k in keys for c in config.get(k, [])]
    for node in config.get("available_node_types", {}).values():
        commands += [c for k in keys for c in node.get(k, [])]
    return commands


@pytest.mark.unit
def test_there_are_cluster_configs():
    assert {p.name for p in CLUSTER_YAMLS} >= {"h100.yaml", "local.yaml"}


@pytest.mark.unit
@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_passes_ray_up_validation(path):
    prepared = ray_up_validate(load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.unit
def test_validation_catches_mistakes():
    """The check above can fail: the same validator rejects broken copies of our config."""
    config = load(ROOT / "cluster" / "h100.yaml")
    misspelt = {**config, "max_worker": 4}  # unknown top-level key
    with pytest.raises(jsonschema.ValidationError):
        ray_up_validate(misspelt)
    no_resources = copy.deepcopy(config)
    del no_resources["available_node_types"]["gpu_h100x8"]["resources"]
    with pytest.raises(jsonschema.ValidationError):
        ray_up_validate(no_resources)
    too_many = copy.deepcopy(config)
    too_many["available_node_types"]["gpu_h100x8"]["min_workers"] = config["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        ray_up_validate(too_many)


@pytest.mark.unit
@pytest.mark.parametrize("path", [p for p in CLUSTER_YAMLS if "docker" not in load(p)], ids=lambda p: p.name)
def test_installs_the_pinned_ray_and_this_project(path):
    """Configs that install at boot (an image of their own: tests/test_cluster_configs.py)."""
    config = load(path)
    setup = [c for c in all_commands(config) if "pip install" in c]
    pins = [m for c in setup for m in RAY_PIN.findall(c)]
    assert pins, f"{path.name}: no setup command installs ray[...]==<version>"
    assert set(pins) == {pyproject_ray_pin()}
    version = pyproject_ray_pin().split("==")[1]
    images = [v for k, v in config.get("docker", {}).items() if k.endswith("image")]
    for image in images:
        assert image.startswith(f"rayproject/ray:{version}-"), image
    assert any("pip install" in c and "~/raychat" in c for c in setup)
    assert config["file_mounts"]["~/raychat"] == "."


@pytest.mark.unit
@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_dashboard_local_and_token_auth_on(path):
    config = load(path)
    starts = [c for c in all_commands(config) if "ray start" in c]
    head = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert len(head) == 1 and "--head" in head[0]
    assert "--dashboard-host=127.0.0.1" in head[0]
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts), starts
    # every node gets the token the laptop generated (`ray get-auth-token --generate`)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.unit
def test_h100_nodes():
    config = load(ROOT / "cluster" / "h100.yaml")
    assert config["provider"]["type"] == "aws"
    gpu = config["available_node_types"]["gpu_h100x8"]
    assert gpu["node_config"]["InstanceType"] == "p5.48xlarge"
    assert gpu["resources"]["GPU"] == 8
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]


@pytest.mark.unit
def test_grafana_dashboard_charts_every_raychat_gauge():
    dashboard = json.loads((ROOT / "cluster" / "grafana" / "raychat_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    charted = {m for e in exprs for m in re.findall(r"ray_raychat_(\w+)", e)}
    # Prometheus sees raychat_<name> with Ray's ray_ prefix
    assert charted == set(GAUGES), (charted, set(GAUGES))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert all(p["datasource"] == "${datasource}" for p in dashboard["panels"])
    for e in exprs:  # every query honours the dashboard's filters
        assert '$SessionName' in e and '$run' in e, e


def head_system_config(path: Path) -> tuple[list[str], dict]:
    """(the `ray start --head` command's words, its --system-config) in a cluster config: the
    launcher YAMLs' head_start_ray_commands, the KubeRay head's rayStartParams (flags to ray start)."""
    config = load(path)
    if "head_start_ray_commands" in config:
        command = next(c for c in config["head_start_ray_commands"] if "ray start --head" in c)
        words = shlex.split(command.split(";")[-1])  # after `ulimit ...;`, as the shell splits it
    else:
        params = config["spec"]["headGroupSpec"]["rayStartParams"]
        words = ["ray", "start", "--head", *shlex.split(" ".join(f"--{k}={v}" for k, v in params.items()))]
    flags = dict(w.removeprefix("--").split("=", 1) for w in words if w.startswith("--") and "=" in w)
    return words, json.loads(flags.get("system-config", "{}"))


@pytest.mark.unit
@pytest.mark.parametrize("path", [*CLUSTER_YAMLS, ROOT / "cluster" / "kuberay" / "raycluster.yaml"],
                         ids=lambda p: p.name)
def test_heads_start_with_failure_detection_tuned_for_training(path):
    _, system_config = head_system_config(path)
    assert system_config == HEALTH_CHECKS, system_config


@pytest.mark.ray  # it starts a Ray head of its own: not for the unit tier
def test_the_h100_heads_command_reaches_a_real_head(tmp_path):
    """`ray start` as cluster/h100.yaml runs it on the head (its environment, flags and system config;
    a free port instead of 6379 and no fixed ports or autoscaler file, which this machine lacks),
    and the GCS of that head reports the health-check settings as its own."""
    import socket

    from testkit.processes import stop_processes_under

    words, _ = head_system_config(ROOT / "cluster" / "h100.yaml")
    env = dict(os.environ, **dict(w.split("=", 1) for w in words[:words.index("ray")]))
    clash = ("--port=", "--object-manager-port=", "--autoscaling-config=", "--metrics-export-port=")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = f"/tmp/rc-{os.getpid()}"  # short: Ray's socket paths live under it
    start = [*words[words.index("ray"):], f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"]
    start = [w for w in start if not w.startswith(clash) or w == f"--port={port}"]
    try:
        started = subprocess.run(start, capture_output=True, text=True, timeout=120, env=env)
        assert started.returncode == 0, started.stderr[-2000:]
        read = ("import json, ray; from ray._private.state import state; "
                f"ray.init(address='127.0.0.1:{port}', log_to_driver=False); "
                "print(json.dumps(state.get_system_config()))")
        done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=120,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        effective = json.loads(done.stdout.strip().splitlines()[-1])
        assert {k: int(effective[k]) for k in HEALTH_CHECKS} == HEALTH_CHECKS, effective
    finally:
        stop_processes_under(temp)  # this head only: other Ray instances on the machine stay up
        shutil.rmtree(temp, ignore_errors=True)
