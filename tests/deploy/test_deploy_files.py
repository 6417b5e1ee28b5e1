"""The files in deploy/ hold to the server they deploy: the container file installs with the
README's install command and starts with the README's container serve command; the systemd
unit's stop timeout covers the default drain (`server.graceful_shutdown_s`); the Kubernetes
manifests parse, and every command line, port and path they name is a `stallfree serve` flag
that parses, the port it serves on, a route of the app."""

from __future__ import annotations

import configparser
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from stallfree import Engine, load_config
from stallfree.cli import build_parser
from stallfree.config.server import ServerConfig
from stallfree.entrypoints.cli import config_from_args, parse
from stallfree.entrypoints.server import create_app
from tests.project.test_readme_surface import routes_of

yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra)")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
README = (ROOT / "README.md").read_text()
DRAIN_S = ServerConfig.model_fields["graceful_shutdown_s"].default
# what the unit and the pods allow beyond the drain: aborting what is left, stopping the engine
STOP_MARGIN_S = 10


@pytest.fixture(scope="module")
def app_paths() -> set[str]:
    engine = Engine(load_config(model={"path": "tiny"}, runtime={"device": "cpu"}))
    return {path for _, path in routes_of(create_app(engine).routes)}


def serve_config(argv: list[str]) -> Any:
    """The configuration `stallfree ARGV` (a serve command line) runs with; exit 2 on a flag
    the parser does not know."""
    assert argv[0] == "serve", argv
    return config_from_args(parse(build_parser(), argv))


def readme_section(title: str) -> str:
    at = README.index(f"\n## {title}\n")
    end = README.find("\n## ", at + 1)
    return README[at : len(README) if end < 0 else end]


def readme_install() -> str:
    """The README's install command: the first command of "Two commands", up to its run."""
    [line] = [
        ln for ln in readme_section("Two commands").splitlines() if ln.startswith("pip install")
    ]
    return line.split(" && stallfree ")[0].strip()


def readme_container_serve() -> list[str]:
    [line] = [
        ln for ln in readme_section("Deploying").splitlines() if ln.startswith("stallfree serve")
    ]
    return shlex.split(line.split("#")[0])


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            steps.append((word.upper(), rest.strip()))
    return steps


def test_the_container_installs_and_starts_with_the_readmes_commands() -> None:
    steps = dockerfile()
    runs = [args for word, args in steps if word == "RUN"]
    assert readme_install() in runs, (readme_install(), runs)
    assert readme_install() == 'pip install torch==2.13.0 && pip install -e ".[bench]"'
    [cmd] = [json.loads(args) for word, args in steps if word == "CMD"]
    assert cmd == readme_container_serve()
    assert cmd[:2] == ["stallfree", "serve"]


def test_the_containers_port_and_health_check_are_the_servers(app_paths: set[str]) -> None:
    steps = dockerfile()
    [cmd] = [json.loads(args) for word, args in steps if word == "CMD"]
    config = serve_config(cmd[1:])
    assert config.server.host == "0.0.0.0"
    assert [args for word, args in steps if word == "EXPOSE"] == [str(config.server.port)]
    [check] = [args for word, args in steps if word == "HEALTHCHECK"]
    [url] = re.findall(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", check)
    assert url == (str(config.server.port), "/health") and "/health" in app_paths
    assert ("STOPSIGNAL", "SIGTERM") in steps


# ----------------------------------------------------------------------------- systemd


def test_the_systemd_unit_serves_and_waits_out_the_default_drain() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    text = (DEPLOY / "stallfree.service").read_text()
    # systemd repeats Environment=; configparser keeps the last, so read those by hand
    env = dict(
        re.match(r"Environment=(\w+)=(.*)", ln).groups()  # type: ignore[union-attr]
        for ln in text.splitlines()
        if ln.startswith("Environment=")
    )
    unit.read_string(re.sub(r"^Environment=.*\n", "", text, flags=re.M))
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "stallfree"
    config = serve_config(argv[1:])
    assert config.server.host == "0.0.0.0"
    assert float(env["STALLFREE_SERVER__GRACEFUL_SHUTDOWN_S"]) == DRAIN_S
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) == DRAIN_S + STOP_MARGIN_S
    assert unit["Install"]["WantedBy"] == "multi-user.target"


# ----------------------------------------------------------------------------- Kubernetes


def manifests(name: str) -> dict[str, dict[str, Any]]:
    """The documents of deploy/k8s/NAME by `Kind/name`."""
    docs = yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's command line, `$(VAR)` replaced as Kubernetes replaces it."""
    argv = [*container["command"], *container["args"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(a)) for a in argv]


def named_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def test_the_deployment_probes_health_drains_and_is_scraped(app_paths: set[str]) -> None:
    docs = manifests("deployment.yaml")
    deployment = docs["Deployment/stallfree"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    config = serve_config(container_argv(container, {})[1:])
    port = config.server.port
    assert config.server.host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and named_port(container, get["port"]) == port
    # scraped on the server's port and path
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == port
    assert notes["prometheus.io/path"] == "/metrics" and "/metrics" in app_paths
    # the drain: preStop waits, then SIGTERM drains; the grace period covers both
    wait = container["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[0] == "sleep"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert float(env["STALLFREE_SERVER__GRACEFUL_SHUTDOWN_S"]) == DRAIN_S
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace == int(wait[1]) + DRAIN_S + STOP_MARGIN_S
    service = docs["Service/stallfree"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    [sport] = service["spec"]["ports"]
    assert named_port(container, sport["targetPort"]) == port


def test_the_statefulset_runs_one_two_node_tensor_parallel_group() -> None:
    docs = manifests("tp-statefulset.yaml")
    sts = docs["StatefulSet/stallfree-tp"]
    headless = docs["Service/stallfree-tp"]
    http = docs["Service/stallfree-tp-http"]
    replicas = sts["spec"]["replicas"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    [rank_env] = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert "pod-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    configs = [
        serve_config(container_argv(container, {"NODE_RANK": str(i)})[1:]) for i in range(replicas)
    ]
    assert [c.parallel.node_rank for c in configs] == list(range(replicas))
    for c in configs:
        assert c.parallel.nnodes == replicas and c.parallel.tp_size % replicas == 0
        assert c.parallel.trusted_network
    # ranks meet at pod 0's stable name, through the headless Service, on a port it names
    host, port = configs[0].parallel.dist_init_addr.rsplit(":", 1)
    name = sts["metadata"]["name"]
    assert host == f"{name}-0.{sts['spec']['serviceName']}"
    assert headless["metadata"]["name"] == sts["spec"]["serviceName"]
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [int(port)]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    # clients reach pod 0 alone, on the port it serves
    assert http["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{name}-0"
    [hport] = http["spec"]["ports"]
    assert named_port(container, hport["targetPort"]) == configs[0].server.port
