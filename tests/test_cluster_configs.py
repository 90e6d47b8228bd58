"""cluster/h100.yaml's GPU nodes as AWS documents them for EFA on p5.48xlarge (32 EFA devices, a
cluster placement group, the devices, locked memory and settings the container needs), running the
one image cluster/Dockerfile builds, with nothing installed when a node starts. (Ray's own validation
of every launcher YAML is tests/test_cluster.py's.)"""

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from helpers import pyproject_ray_pin
from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces
from test_cluster import all_commands, ray_up_validate

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
H100 = ROOT / "cluster" / "h100.yaml"
KUBERAY = ROOT / "cluster" / "kuberay"
EFA_CARDS = 32  # p5.48xlarge: 32 network cards, each with an EFA device
# The EFA settings every GPU node gets, the launcher's containers and the KubeRay pods alike.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
           "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288",
           "NCCL_SOCKET_IFNAME": "^docker,lo,veth"}
HEAVY = re.compile(r"\b(pip|uv|conda|apt-get|apt|yum)\b.*\binstall\b.*\b(torch|ray|raychat|-e)\b|"
                   r"\binstall\b.*(~/raychat|\.\s*$)")


def load() -> dict:
    return yaml.safe_load(H100.read_text())


def gpu_node(config: dict) -> dict:
    return config["available_node_types"]["gpu_h100x8"]["node_config"]


def efa_interfaces(node_config: dict) -> list[dict]:
    return [i for i in node_config["NetworkInterfaces"] if i["InterfaceType"] in ("efa", "efa-only")]


def check_efa_interfaces(node_config: dict) -> None:
    """AWS's layout for P5 (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html):
    one EFA device on each of the 32 network cards, the primary interface (card 0, device 0) one that
    carries IP (ENA or EFA with ENA, never EFA-only), no (card, device) slot used twice."""
    interfaces = node_config["NetworkInterfaces"]
    efa = efa_interfaces(node_config)
    assert sorted(i["NetworkCardIndex"] for i in efa) == list(range(EFA_CARDS))
    slots = [(i["NetworkCardIndex"], i["DeviceIndex"]) for i in interfaces]
    assert len(slots) == len(set(slots))
    (primary,) = [i for i in interfaces if (i["NetworkCardIndex"], i["DeviceIndex"]) == (0, 0)]
    assert primary["InterfaceType"] in ("interface", "efa")
    assert all(i["InterfaceType"] in ("interface", "efa", "efa-only") for i in interfaces)
    assert all(i["DeviceIndex"] in (0, 1) for i in interfaces)
    # Ray requires both on every interface and refuses them beside NetworkInterfaces
    assert all(i["SubnetId"] and i["Groups"] for i in interfaces)
    assert len({i["SubnetId"] for i in interfaces}) == 1
    _configure_subnets_and_groups_from_network_interfaces(node_config)


def docker_run(config: dict, kind: str) -> list[str]:
    docker = config["docker"]
    return shlex.split(" ".join(docker.get("run_options", []) + docker.get(f"{kind}_run_options", [])))


def container_env(words: list[str]) -> dict[str, str]:
    pairs = [words[i + 1] for i, w in enumerate(words) if w in ("--env", "-e")]
    pairs += [w.split("=", 1)[1] for w in words if w.startswith("--env=")]
    return dict(p.split("=", 1) for p in pairs)


def check_efa_container(config: dict) -> None:
    words = docker_run(config, "worker")
    assert "--device=/dev/infiniband" in words or any(w.startswith("--device=/dev/infiniband/uverbs")
                                                       for w in words)
    assert "memlock=-1:-1" in [words[i + 1] for i, w in enumerate(words) if w == "--ulimit"]
    assert any(w.startswith("--shm-size=") for w in words)
    assert container_env(words) == EFA_ENV


def test_gpu_nodes_have_every_efa_device_in_a_cluster_placement_group():
    config = load()
    node = gpu_node(config)
    assert node["InstanceType"] == "p5.48xlarge"
    check_efa_interfaces(node)
    assert node["Placement"]["GroupName"]
    # the head shares the workers' subnet and security group (EFA needs the group to admit itself)
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert head["SubnetIds"] == [node["NetworkInterfaces"][0]["SubnetId"]]
    assert head["SecurityGroupIds"] == node["NetworkInterfaces"][0]["Groups"]
    # a node with several interfaces gets no public IP: the launcher must use private addresses
    assert config["provider"]["use_internal_ips"] is True
    assert "," not in config["provider"]["availability_zone"]  # one zone, the placement group's


def test_gpu_containers_get_the_efa_devices_memory_and_settings():
    config = load()
    check_efa_container(config)
    assert "--gpus all" in config["docker"]["worker_run_options"]


def test_checks_fail_on_broken_copies():
    """The checks above can fail: broken copies of the config are rejected."""
    broken = []
    for mutate in (
        lambda c: gpu_node(c)["NetworkInterfaces"].pop(),  # 31 EFA devices
        lambda c: gpu_node(c)["NetworkInterfaces"][5].update(NetworkCardIndex=3),  # card 3 twice
        lambda c: gpu_node(c)["NetworkInterfaces"][0].update(InterfaceType="efa-only"),  # primary without IP
        lambda c: gpu_node(c)["NetworkInterfaces"][7].pop("Groups"),  # Ray refuses it
    ):
        config = copy.deepcopy(load())
        mutate(config)
        broken.append(config)
    for config in broken:
        with pytest.raises((AssertionError, ValueError, KeyError)):
            check_efa_interfaces(gpu_node(config))
    for option in ("--device=/dev/infiniband", "--ulimit memlock=-1:-1", "--env FI_PROVIDER=efa"):
        config = copy.deepcopy(load())
        config["docker"]["worker_run_options"].remove(option)
        with pytest.raises((AssertionError, ValueError)):
            check_efa_container(config)


def test_passes_ray_up_validation_with_the_interfaces():
    prepared = ray_up_validate(load())
    check_efa_interfaces(gpu_node(prepared))


def image_tag() -> str:
    return pyproject_ray_pin().split("==")[1] + "-py311-gpu"


def test_every_node_runs_the_raychat_image():
    config = load()
    docker = config["docker"]
    assert not any(k in docker for k in ("head_image", "worker_image"))  # one image for every node
    assert docker["image"].endswith(f"/raychat:{image_tag()}")
    cluster = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text())
    spec = cluster["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    assert {c["image"] for t in templates for c in t["spec"]["containers"]} == {docker["image"]}
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    assert f"docker build -f cluster/Dockerfile -t {docker['image']} ." in dockerfile
    for piece in ("efa_installer.sh", "--skip-kmod", "libnccl-net.so", "/opt/amazon/ofi-nccl",
                  pyproject_ray_pin().replace("ray", '"ray', 1),
                  'pip install --no-cache-dir -e "/home/ray/raychat[hub,report,gcs]"',
                  "torch.version.cuda"):
        assert piece in dockerfile, piece


def test_nothing_heavy_is_installed_when_a_node_starts():
    config = load()
    commands = all_commands(config)
    assert not [c for c in commands if HEAVY.search(c)], commands
    assert config["setup_commands"] == [] and config["worker_setup_commands"] == []
    assert "~/raychat" not in config["file_mounts"]  # the code is in the image; jobs bring theirs
    # the check can fail: the old way, installing at boot, is caught
    for old in ('pip install -q "ray[default,train,data,tune]==2.60.0"', "pip install -q -e ~/raychat",
                "pip install torch==2.13.0"):
        assert HEAVY.search(old), old


def test_kuberay_gpu_pods_get_the_same_efa_settings():
    cluster = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text())
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    for side in ("requests", "limits"):
        resources = container["resources"][side]
        assert resources["vpc.amazonaws.com/efa"] == str(EFA_CARDS)
        assert resources["hugepages-2Mi"] == "5120Mi"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: env.get(k) for k in EFA_ENV} == EFA_ENV
    assert container_env(docker_run(load(), "worker")) == EFA_ENV
