"""cluster/kuberay/: the RayCluster and RayJob validate against KubeRay's published CRD schemas (a
vendored copy, tests/data/kuberay/), run the Ray that pyproject.toml pins, keep token auth on and the
dashboard inside the Kubernetes cluster, and the RayJob's entrypoint is a command raychat accepts.
Metrics: a PodMonitor scrapes every pod's metrics port, the head points the dashboard at Prometheus and
Grafana, and the Grafana ConfigMap holds exactly cluster/grafana/raychat_dashboard.json."""

import argparse
import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from helpers import pyproject_ray_pin

from raychat.config import add_config_flags, config_from_args

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "cluster" / "kuberay"
SCHEMAS = Path(__file__).resolve().parent / "data" / "kuberay"
SCHEMA_FILES = {"RayCluster": "ray.io_rayclusters.v1.schema.json", "RayJob": "ray.io_rayjobs.v1.schema.json"}


def strict(schema: dict) -> dict:
    """The CRD schema as the API server applies it with strict field validation (kubectl's default):
    an unknown field is an error, except where the schema preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validator(kind: str) -> jsonschema.Draft7Validator:
    schema = strict(json.loads((SCHEMAS / SCHEMA_FILES[kind]).read_text()))
    return jsonschema.Draft7Validator(schema)


def manifest(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def ray_version() -> str:
    return pyproject_ray_pin().split("==")[1]


def containers(pod_templates: list[dict]) -> list[dict]:
    return [c for t in pod_templates for c in t["spec"]["containers"]]


def cluster_pods(cluster: dict) -> list[dict]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


@pytest.mark.unit
@pytest.mark.parametrize("name, kind", [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_manifests_validate_against_kuberay_crds(name, kind):
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    errors = [e.message for e in validator(kind).iter_errors(doc)]
    assert errors == []


@pytest.mark.unit
def test_validation_rejects_broken_manifests():
    """The check above can fail: the same schemas reject broken copies of our manifests."""
    cluster = manifest("raycluster.yaml")
    check = validator("RayCluster")
    misspelt = copy.deepcopy(cluster)
    misspelt["spec"]["workerGroupSpecs"][0]["maxReplica"] = 2  # unknown field
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "2"  # int32 in KubeRay
    bad_mode = copy.deepcopy(cluster)
    bad_mode["spec"]["authOptions"]["mode"] = "tokens"  # enum: disabled, token
    no_group_name = copy.deepcopy(cluster)
    del no_group_name["spec"]["workerGroupSpecs"][0]["groupName"]  # required
    bad_quantity = copy.deepcopy(cluster)
    head_container = bad_quantity["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_container["resources"]["limits"]["memory"] = "32 gigs"  # not a Kubernetes quantity
    for broken in (misspelt, wrong_type, bad_mode, no_group_name, bad_quantity):
        with pytest.raises(jsonschema.ValidationError):
            check.validate(broken)
    job = manifest("rayjob.yaml")
    job["spec"]["entrypoint"] = ["python", "-m", "raychat.train"]  # a string in KubeRay
    with pytest.raises(jsonschema.ValidationError):
        validator("RayJob").validate(job)


@pytest.mark.unit
def test_rayjob_entrypoint_is_a_raychat_command():
    job = manifest("rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "raychat.train"]
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(argv[3:]))
    assert cfg.depth == 24
    assert cfg.worker_range() == (8, 16)
    assert cfg.storage_path.startswith("s3://")
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == manifest("raycluster.yaml")["metadata"]["name"]


@pytest.mark.unit
def test_elastic_range_fits_the_worker_group():
    cluster = manifest("raycluster.yaml")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus_per_pod == 8 and container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    argv = shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])[3:]
    low, high = config_from_args(parser.parse_args(argv)).worker_range()
    # the minimum is always up, the maximum can be reached: 8:16 GPU workers = 1 to 2 pods
    assert group["minReplicas"] * gpus_per_pod == low
    assert group["maxReplicas"] * gpus_per_pod == high
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]


@pytest.mark.unit
def test_runs_the_pinned_ray():
    version = ray_version()
    cluster = manifest("raycluster.yaml")
    assert cluster["spec"]["rayVersion"] == version
    for container in containers(cluster_pods(cluster)):
        assert container["image"].rsplit(":", 1)[1].startswith(f"{version}-py311"), container["image"]
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text().splitlines()  # shared with cluster/h100.yaml
    froms = [line for line in dockerfile if line.startswith("FROM ")]
    assert froms == [f"FROM rayproject/ray:{version}-py311-gpu"]


@pytest.mark.unit
def test_token_auth_on_and_dashboard_not_exposed():
    cluster = manifest("raycluster.yaml")
    assert cluster["spec"]["authOptions"]["mode"] == "token"
    assert cluster["spec"]["authOptions"]["secretName"]
    head = cluster["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False
    texts = [p.read_text() for p in KUBERAY.glob("*.yaml")]
    assert not any(word in t for t in texts for word in ("LoadBalancer", "NodePort", "kind: Ingress"))


@pytest.mark.unit
def test_secrets_come_from_kubernetes_secrets():
    """The wandb key reaches the pods from a Secret, never as a literal and never through Ray."""
    cluster = manifest("raycluster.yaml")
    job = manifest("rayjob.yaml")
    assert "runtimeEnvYAML" not in job["spec"]
    workers = containers([g["template"] for g in cluster["spec"]["workerGroupSpecs"]])
    for container in workers:
        env = {e["name"]: e for e in container["env"]}
        assert "value" not in env["WANDB_API_KEY"]
        assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "api_key"


@pytest.mark.unit
def test_prometheus_scrapes_every_pod_of_the_cluster():
    """The PodMonitor (KubeRay's prometheus-grafana guide) selects this RayCluster's pods by the labels
    KubeRay gives them, on a port every container of the cluster names `metrics`."""
    monitor = manifest("monitoring.yaml")
    cluster = manifest("raycluster.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"  # kube-prometheus-stack's selector
    assert monitor["spec"]["selector"]["matchLabels"]["ray.io/cluster"] == cluster["metadata"]["name"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for container in containers(cluster_pods(cluster)):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert ports.get(endpoint["port"]) == 8080, container["name"]  # Ray's metrics agent (ray start)
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel["ray_io_cluster"] == ["__meta_kubernetes_pod_label_ray_io_cluster"]


@pytest.mark.unit
def test_head_points_the_dashboard_at_prometheus_and_grafana():
    head = manifest("raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in head["env"]}
    assert env["RAY_PROMETHEUS_HOST"].startswith("http://prometheus-kube-prometheus-prometheus.")
    assert env["RAY_GRAFANA_HOST"].startswith("http://prometheus-grafana.")
    assert env["RAY_GRAFANA_IFRAME_HOST"] == "http://127.0.0.1:3000"  # through kubectl port-forward


@pytest.mark.integration  # a subprocess
def test_grafana_configmap_holds_the_dashboard():
    configmap = manifest("grafana-dashboard.yaml")
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (embedded,) = configmap["data"].values()
    dashboard = json.loads((ROOT / "cluster" / "grafana" / "raychat_dashboard.json").read_text())
    assert json.loads(embedded) == dashboard, (
        "regenerate: python cluster/grafana/configmap.py > cluster/kuberay/grafana-dashboard.yaml")
    generated = subprocess.run([sys.executable, str(ROOT / "cluster" / "grafana" / "configmap.py")],
                               capture_output=True, text=True, check=True).stdout
    assert generated == (KUBERAY / "grafana-dashboard.yaml").read_text()
