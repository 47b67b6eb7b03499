"""Structural validation of the Kubernetes manifests, compose file and Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import Metrics
from service.scheduling.batching import CLOSE_GRACE_S
from service.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def k8s_documents() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def exported_metric_names() -> set[str]:
    """Every sample name the service's registry can expose (labels touched once)."""
    metrics = Metrics()
    for attribute in vars(metrics).values():
        labelnames = getattr(attribute, "_labelnames", ())
        if labelnames:
            attribute.labels(*["x"] * len(labelnames))
    text = generate_latest(metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    present = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == present


def test_deployment_probes_resources_and_ports():
    docs = k8s_documents()
    pod = docs["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod["metadata"][
        "labels"].items()
    port_names = {p["name"] for p in container["ports"]}
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] in port_names
    assert docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == docs[
        "Deployment"]["metadata"]["name"]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


def test_configmap_keys_are_real_settings():
    data = k8s_documents()["ConfigMap"]["data"]
    fields = {f"R4T_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= fields, set(data) - fields
    Settings(**{k.removeprefix("R4T_").lower(): v for k, v in data.items()})  # values validate


def test_compose_services_and_mounts_exist():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"r4t", "prometheus", "grafana"} <= set(compose["services"])
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "r4t.json").read_text())
    exported = exported_metric_names()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\br4t_[a-z_]+", target["expr"]):
                assert name in exported, f"{panel['title']}: {name} is not exported"


def test_alert_rules_query_only_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exported = exported_metric_names()
    for rule in rules["groups"][0]["rules"]:
        for name in re.findall(r"\br4t_[a-z_]+", rule["expr"]):
            assert name in exported, f"{rule['alert']}: {name} is not exported"


def test_termination_grace_outlasts_the_drain_and_the_readiness_probe():
    docs = k8s_documents()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    settings = docs["ConfigMap"]["data"]
    probe = pod["containers"][0]["readinessProbe"]
    drain, grace = float(settings["R4T_DRAIN_S"]), float(settings["R4T_SHUTDOWN_GRACE_S"])
    assert drain > probe["periodSeconds"] * probe["failureThreshold"]  # unready before closing
    # never killed mid-answer: the drain, the grace, then each route's queue closing
    assert pod["terminationGracePeriodSeconds"] > drain + grace + CLOSE_GRACE_S


def test_the_milvus_overlay_serves_from_the_engine_with_real_settings():
    overlay = yaml.safe_load((DEPLOY / "k8s" / "milvus" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."]
    ops = yaml.safe_load(overlay["patches"][0]["patch"])
    data = {op["path"].rsplit("/", 1)[1]: op["value"] for op in ops}
    assert data["R4T_INDEX"].startswith("milvus://")
    settings = Settings(**{k.removeprefix("R4T_").lower(): v for k, v in data.items()})
    assert settings.index_timeout_s < 5  # the readiness probe's period notices an outage


def test_the_compose_milvus_profile_uses_the_engines_own_images():
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    engine = {name: s for name, s in services.items() if "milvus" in s.get("profiles", [])}
    assert {"r4t-milvus", "milvus", "etcd", "minio"} <= set(engine)
    assert all("image" in s and "build" not in s for n, s in engine.items() if n != "r4t-milvus")
    assert services["r4t-milvus"]["environment"]["R4T_INDEX"] == "milvus"
    # the image's ENTRYPOINT is `r4t serve`: loading first needs its own entrypoint
    assert "r4t --bundle /tmp/default index milvus://" in \
        services["r4t-milvus"]["entrypoint"][-1]


def test_the_pod_is_locked_down_and_admin_stays_off_the_service():
    docs = k8s_documents()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    locked = container["securityContext"]
    assert locked["allowPrivilegeEscalation"] is False and locked["readOnlyRootFilesystem"]
    assert locked["capabilities"]["drop"] == ["ALL"]
    settings = docs["ConfigMap"]["data"]
    admin = next(p for p in container["ports"] if p["name"] == "admin")
    assert admin["containerPort"] == int(settings["R4T_ADMIN_PORT"])
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} == {"http"}
    assert "R4T_ROUTES" not in settings  # the bundle's measured arms are served
