"""deploy/ read as its users' tools would: every YAML and JSON file parses, every gateway
config in it loads with the gateway's own loader, and the Dockerfile, the compose files
and the Kubernetes manifests name the ports, probe paths and stop times the gateway
really has. Ports come from the config defaults (gateway.config.loader), and the probe
paths from the admin listener's routes and how they answer, so nothing here is a second
copy of them. (Building the image needs a Docker daemon and Docker Hub: not here.)"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import Gateway
from gateway.config import parse_config
from gateway.config.loader import DEFAULT_ADMIN_LISTEN, DEFAULT_LISTEN
from gateway.config.model import GatewayConfig
from gateway.config.units import parse_address, parse_duration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
LISTEN_PORT = parse_address(DEFAULT_LISTEN).port
ADMIN_PORT = parse_address(DEFAULT_ADMIN_LISTEN).port
CONFIG_PATH_IN_IMAGE = "/etc/gateway/gateway.yaml"


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def gateway_config(text: str, source: str, environ: dict[str, str] | None = None) -> GatewayConfig:
    """A config as the gateway loads it, in the environment its deployment gives it."""
    return parse_config(text, source=source, environ=environ or {})


def kubernetes_objects() -> dict[str, dict[str, Any]]:
    """Every object under deploy/kubernetes/ by kind (one of each kind there)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") != "Kustomization":
                assert document["kind"] not in objects, f"two {document['kind']}s"
                objects[document["kind"]] = document
    return objects


def gateway_container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def container_config(objects: dict[str, dict[str, Any]]) -> GatewayConfig:
    """The gateway config the Deployment mounts, from its ConfigMap, as the pod loads it."""
    container = gateway_container(objects)
    config_path = container["args"][container["args"].index("-c") + 1]
    (mount,) = [m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    text = objects["ConfigMap"]["data"][config_path.removeprefix(mount["mountPath"] + "/")]
    # A value from a secret is not in the manifests: a stand-in of a secret's length.
    environ = {e["name"]: e.get("value", "s" * 32) for e in container["env"]}
    return gateway_config(text, "configmap.yaml", environ)


async def admin_status(config: GatewayConfig, path: str, host: str) -> int:
    """The status `config`'s admin listener answers a GET of `path` with, sent with `host` as Host."""
    async with TestClient(TestServer(Gateway(config).admin_app)) as client:
        async with client.get(path, headers={"Host": host}) as response:
            return response.status


@pytest.fixture
async def probe_paths() -> dict[str, Any]:
    """The admin listener's paths, and which of them are the liveness and the readiness
    probe. While the gateway drains, readiness turns 503; liveness stays 200, and is the
    one JSON path a probe may ask without the admin token (the admin page's files are
    open too, but hold no state)."""
    token = "t" * 32
    config = gateway_config(
        "admin_token_env: PROBE_TOKEN\nroutes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n",
        "probe.yaml",
        {"PROBE_TOKEN": token},
    )
    gateway = Gateway(config)
    routes = {resource.canonical for resource in gateway.admin_app.router.resources()}
    draining, open_json = {}, set()
    async with TestClient(TestServer(gateway.admin_app)) as client:
        gateway.draining = True
        for path in sorted(p for p in routes if "{" not in p):
            async with client.get(path, headers={"Authorization": f"Bearer {token}"}) as response:
                draining[path] = response.status
            async with client.get(path) as response:
                if response.status == 200 and response.content_type == "application/json":
                    open_json.add(path)
    (liveness,) = [p for p in open_json if draining[p] == 200]
    (readiness,) = [p for p, status in draining.items() if status == 503]
    return {"routes": routes, "liveness": liveness, "readiness": readiness}


def test_every_yaml_and_json_file_in_deploy_parses():
    for path in yaml_files():
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, f"{path} is empty"
    for path in DEPLOY.rglob("*.json"):
        json.loads(path.read_text())
    for path in KUBERNETES.glob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind"} <= set(document), path


def test_every_gateway_config_in_deploy_loads_and_binds_its_listeners_where_a_container_is_reached():
    configs = {
        "compose/gateway.yaml": mounted_config(DEPLOY / "docker-compose.yml"),
        "redis-cluster/gateway.yaml": mounted_config(DEPLOY / "redis-cluster" / "docker-compose.yml"),
        "kubernetes/configmap.yaml": container_config(kubernetes_objects()),
    }
    for name, config in configs.items():
        assert config.listen.port == LISTEN_PORT, name
        assert config.admin_listen.port == ADMIN_PORT, name
        # The default admin address, 127.0.0.1, is unreachable from outside a container.
        assert config.admin_listen.host == "0.0.0.0", name
        assert config.listen.host == "0.0.0.0", name
        assert config.store is not None, name
    assert configs["redis-cluster/gateway.yaml"].store.url.startswith("redis+cluster://")


def test_the_kubernetes_manifests_agree_with_each_other():
    objects = kubernetes_objects()
    assert set(objects) >= {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    deployment = objects["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Deployment", "PodDisruptionBudget"):
        assert objects[kind]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), kind
    assert objects["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert objects["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2  # so the PDB can let one go
    container = gateway_container(objects)
    assert container["resources"]["requests"]["cpu"]  # the HPA's utilization is of this
    assert container["args"][:1] == ["run"] and "-c" in container["args"]


async def test_the_kubernetes_deployment_probes_the_admin_listener_on_the_gateways_ports_and_paths(probe_paths):
    objects = kubernetes_objects()
    container = gateway_container(objects)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": LISTEN_PORT, "admin": ADMIN_PORT}
    readiness, liveness = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert readiness == {"path": probe_paths["readiness"], "port": "admin"}
    assert liveness == {"path": probe_paths["liveness"], "port": "admin"}
    assert container["startupProbe"]["httpGet"]["path"] in probe_paths["routes"]
    annotations = objects["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ADMIN_PORT
    assert annotations["prometheus.io/path"] in probe_paths["routes"]
    # Kubelet and an annotation-driven Prometheus both name the pod by its IP in Host.
    for path in (annotations["prometheus.io/path"], probe_paths["liveness"]):
        assert await admin_status(container_config(objects), path, f"10.244.1.7:{ADMIN_PORT}") == 200
    (service_port,) = objects["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == "http"
    policy_ports = {p["port"] for rule in objects["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert policy_ports == set(ports)
    # The probes need /readyz without a token: httpGet cannot read one from a secret.
    assert container_config(objects).admin_token is None


def test_the_kubernetes_grace_period_covers_the_pre_stop_pause_and_the_gateways_shutdown_grace():
    objects = kubernetes_objects()
    container = gateway_container(objects)
    config = container_config(objects)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # Kubernetes counts the preStop hook inside the grace period; then SIGTERM, then shutdown_grace.
    assert grace >= pause + config.shutdown_grace + 1, (grace, pause, config.shutdown_grace)
    assert grace <= pause + config.shutdown_grace + 15, "a much longer grace only delays rollouts"


def test_the_kubernetes_pod_runs_the_image_as_its_non_root_user_with_a_read_only_root():
    objects = kubernetes_objects()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = gateway_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == dockerfile_user()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])  # workers > 1 write metrics there


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def dockerfile_user() -> str:
    (user,) = re.findall(r"^USER\s+(\S+)", dockerfile(), re.M)
    return user.split(":")[0]


def healthcheck_url() -> str:
    (check,) = re.findall(r"^HEALTHCHECK .*?CMD (\[.*?\])$", dockerfile(), re.M | re.S)
    (url,) = re.findall(r"http://[^'\"]+", " ".join(json.loads(check.replace("\\\n", ""))))
    return url


async def test_the_dockerfile_builds_in_two_stages_runs_as_non_root_and_checks_the_liveness_path(probe_paths):
    text = dockerfile()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2
    assert "pip wheel" in text and "--no-index" in text
    assert dockerfile_user() not in ("root", "0")
    (exposed,) = re.findall(r"^EXPOSE (.+)$", text, re.M)
    assert sorted(int(port) for port in exposed.split()) == sorted([LISTEN_PORT, ADMIN_PORT])
    url = healthcheck_url()
    assert url == f"http://127.0.0.1:{ADMIN_PORT}{probe_paths['liveness']}"
    assert "curl" not in text.split("HEALTHCHECK", 1)[1].split("\n\n")[0]  # the slim image has none
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    assert json.loads(cmd) == ["run", "-c", CONFIG_PATH_IN_IMAGE]


def compose(path: Path) -> dict[str, Any]:
    return load_yaml(path)["services"]


def published(service: dict[str, Any]) -> set[int]:
    """The container ports a compose service publishes ("HOST:PORT:CONTAINER_PORT")."""
    return {int(str(entry).rsplit(":", 1)[1]) for entry in service.get("ports", [])}


def mounted_config(compose_file: Path) -> GatewayConfig:
    """The config a compose file mounts into its gateway, in the environment it gives it."""
    service = compose(compose_file)["gateway"]
    (source,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == CONFIG_PATH_IN_IMAGE]
    path = (compose_file.parent / source).resolve()
    return gateway_config(path.read_text(), str(path), service.get("environment"))


@pytest.mark.parametrize("name", ["docker-compose.yml", "redis-cluster/docker-compose.yml"])
def test_compose_publishes_the_gateways_ports_mounts_a_config_that_binds_them_and_waits_out_its_grace(name):
    path = DEPLOY / name
    gateway = compose(path)["gateway"]
    assert published(gateway) == {LISTEN_PORT, ADMIN_PORT}
    config = mounted_config(path)
    assert (config.listen.port, config.admin_listen.port) == (LISTEN_PORT, ADMIN_PORT)
    # Compose's default stop timeout is 10 s: the drain needs shutdown_grace.
    assert parse_duration(gateway["stop_grace_period"]) > config.shutdown_grace
    assert gateway["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (path.parent / gateway["build"]["context"] / gateway["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert "/tmp" in gateway["tmpfs"]
    # The demo upstream the routes name is a service of the file, on the port they name.
    services = compose(path)
    for route in config.routes:
        host, port = route.upstream.removeprefix("http://").split(":")
        assert host in services
        assert f"port={port}" in " ".join(services[host]["entrypoint"])


async def test_compose_prometheus_scrapes_the_admin_listeners_metrics_and_grafana_gets_the_dashboard(probe_paths):
    services = compose(DEPLOY / "docker-compose.yml")
    assert {"redis", "upstream", "gateway", "prometheus", "grafana"} <= set(services)
    scrape = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] in probe_paths["routes"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in services and int(port) == ADMIN_PORT
    # Prometheus sends Host: gateway:9090, a name the admin listener must be told it has.
    assert await admin_status(mounted_config(DEPLOY / "docker-compose.yml"), job["metrics_path"], target) == 200
    for rule_file in scrape["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).exists()
    # Prometheus and Grafana mount what they are told to read.
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in services["prometheus"]["volumes"])
    assert mounts["./prometheus"] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    grafana = dict(v.rsplit(":", 1)[0].split(":") for v in services["grafana"]["volumes"])
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "gateway.yml")["providers"][0]
    assert Path(grafana["./grafana/gateway-dashboard.json"]).parent == Path(provider["options"]["path"])
    assert grafana["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == f"http://prometheus:{int(services['prometheus']['ports'][0].rsplit(':', 1)[1])}"


def test_the_redis_cluster_example_has_six_nodes_joined_with_one_replica_each_and_the_gateway_seeds_from_them():
    path = DEPLOY / "redis-cluster" / "docker-compose.yml"
    services = compose(path)
    nodes = [name for name, service in services.items() if "--cluster-enabled" in service.get("command", [])]
    assert len(nodes) == 6
    init = " ".join(services["cluster-init"]["entrypoint"])
    assert "--cluster create" in init and "--cluster-replicas 1" in init
    assert all(f"redis-{n}" in init or "redis-$$n" in init for n in range(1, 7))
    config = mounted_config(path)
    seeds = config.store.url.removeprefix("redis+cluster://").split(",")
    assert len(seeds) >= 2
    for seed in seeds:
        assert seed.split(":")[0] in nodes
    # Without the environment compose gives, the file's own default is the same cluster.
    assert gateway_config((DEPLOY / "redis-cluster" / "gateway.yaml").read_text(), "cluster").store.url == config.store.url


def test_the_dashboard_reads_from_a_prometheus_datasource_variable():
    board = json.loads((DEPLOY / "grafana" / "gateway-dashboard.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
    titles = " ".join(p["title"].lower() for p in panels)
    for needed in (
        "request rate", "allowed and limited", "failure-policy", "limiter latency", "upstream latency", "breaker", "reload",
        "hang-ups", "delayed", "shaping delay", "in flight per concurrency limit", "concurrency limited",
        "lease release failures", "requests per target", "errors per target", "target latency", "target health",
        "ejections", "retries", "unavailable upstream",
    ):
        assert needed in titles


def test_the_systemd_unit_waits_out_the_default_shutdown_grace():
    unit = (DEPLOY / "gateway.service").read_text()
    (stop,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    config = gateway_config("routes: [{match: {path: /}, upstream: 'http://127.0.0.1:9'}]\n", "default.yaml")
    assert int(stop) > config.shutdown_grace
    assert shlex.split(re.findall(r"^ExecStart=(.+)$", unit, re.M)[0])[1:3] == ["run", "-c"]
