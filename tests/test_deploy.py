"""The Kubernetes manifests under deploy/: each rendering validates strictly against the
Kubernetes 1.31 schemas, and what the server and the trainer are told is what they accept.

Each kustomization is rendered by `kubectl kustomize` (Debian's kubectl; skipped with the
reason where it is absent), validated by kubernetes-validate --strict, and the server's
arguments are parsed by `croupier serve`'s own parser.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from croupier.cli import make_parser
from croupier.client.connection import Servers, dns_name

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = "1.31.0"
PORT = 50051
SERVER_RENDERINGS = ["base", "overlays/pvc", "overlays/s3", "overlays/pvc-tls"]
RENDERINGS = SERVER_RENDERINGS + ["trainer"]

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is not installed (it renders the kustomizations)")


def render(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize deploy/{path}: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def server_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = one(docs, "Deployment", "croupier")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "croupier")


def serve_args(docs: list[dict[str, Any]]):
    container = server_container(docs)
    assert container["command"] == ["croupier", "serve"]
    return make_parser().parse_args(["serve", *container["args"]])  # exits (fails) on a flag serve lacks


@needs_kubectl
@pytest.mark.parametrize("path", RENDERINGS)
def test_every_manifest_validates_strictly_against_kubernetes_1_31(path: str) -> None:
    docs = render(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_strict_validation_refuses_a_field_kubernetes_does_not_know() -> None:
    """The check above would pass anything if validation were lax."""
    doc = yaml.safe_load((DEPLOY / "base" / "pdb.yaml").read_text())
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    doc["spec"]["maxUnavailabel"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@needs_kubectl
@pytest.mark.parametrize("path", SERVER_RENDERINGS)
def test_the_server_args_are_flags_croupier_serve_accepts(path: str) -> None:
    args = serve_args(render(path))
    assert args.datasets, "no dataset served"
    assert (args.port, args.metrics_port) in ((PORT, 9100), (None, 9100)) and args.host == "0.0.0.0"
    assert args.grace_s is not None and args.drain_notice_s is not None and args.drain_notice_s <= args.grace_s


@needs_kubectl
@pytest.mark.parametrize("path", SERVER_RENDERINGS)
def test_termination_grace_outlasts_the_drain(path: str) -> None:
    docs = render(path)
    args = serve_args(docs)
    pod = one(docs, "Deployment", "croupier")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > args.grace_s
    # A draining pod answers NOT_SERVING; its liveness probe must not restart it meanwhile.
    live = server_container(docs)["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > pod["terminationGracePeriodSeconds"]


@needs_kubectl
@pytest.mark.parametrize("path", ["base", "overlays/pvc", "overlays/s3"])
def test_plaintext_servers_are_probed_by_native_grpc_health_on_the_server_port(path: str) -> None:
    docs = render(path)
    container = server_container(docs)
    assert serve_args(docs).insecure and not serve_args(docs).tls_cert
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"] == {"port": PORT}, probe  # service "": the server's overall health
    assert {"name": "grpc", "containerPort": PORT} in container["ports"]


@needs_kubectl
def test_tls_servers_are_probed_over_tls_by_croupier_health() -> None:
    """The kubelet's gRPC probe cannot speak TLS, so the TLS component checks the same
    grpc.health.v1 with `croupier health`, and serves TLS with tokens, not --insecure."""
    docs = render("overlays/pvc-tls")
    container = server_container(docs)
    args = serve_args(docs)
    assert not args.insecure
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CROUPIER_TLS_CERT"] and env["CROUPIER_TLS_KEY"] and env["CROUPIER_TOKENS_FILE"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for var in ("CROUPIER_TLS_CERT", "CROUPIER_TLS_KEY", "CROUPIER_TOKENS_FILE"):
        folder = str(Path(env[var]).parent)
        assert mounts[folder]["readOnly"], var
    pod = one(docs, "Deployment", "croupier")["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert set(secrets.values()) == {"croupier-tls", "croupier-tokens"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "grpc" not in container[probe]
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["croupier", "health"] and command[2].endswith(f":{PORT}")
        assert make_parser().parse_args(command[1:]).command == "health"


@needs_kubectl
@pytest.mark.parametrize("path", RENDERINGS)
def test_every_pod_runs_as_non_root_on_a_read_only_root_file_system(path: str) -> None:
    for doc in render(path):
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # docker/Dockerfile's croupier user
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable, c["name"]


@needs_kubectl
def test_the_server_writes_only_to_its_empty_dirs() -> None:
    docs = render("overlays/pvc")
    container = server_container(docs)
    pod = one(docs, "Deployment", "croupier")["spec"]["template"]["spec"]
    kinds = {v["name"]: next(k for k in v if k != "name") for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert kinds[mounts[serve_args(docs).cache_dir]["name"]] == "emptyDir"
    data = mounts["/data"]
    assert data["readOnly"] and kinds[data["name"]] == "persistentVolumeClaim"


@needs_kubectl
def test_the_s3_overlay_takes_its_credentials_from_a_secret() -> None:
    docs = render("overlays/s3")
    assert all(d.split("=", 1)[-1].startswith("s3://") for d in serve_args(docs).datasets)
    container = server_container(docs)
    assert {"secretRef": {"name": "croupier-s3"}} in container["envFrom"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(one(docs, "Secret", "croupier-s3")["stringData"])


@needs_kubectl
def test_replicas_spread_over_nodes_behind_a_headless_service_and_a_disruption_budget() -> None:
    docs = render("base")
    deployment = one(docs, "Deployment", "croupier")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pod = deployment["spec"]["template"]["spec"]
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["kubernetes.io/hostname"]["labelSelector"]["matchLabels"].items() <= labels.items()
    service = one(docs, "Service", "croupier")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"].items() <= labels.items()
    assert not service["spec"].get("publishNotReadyAddresses")  # a draining pod leaves the DNS answer
    assert {"name": "grpc", "port": PORT, "targetPort": "grpc", "appProtocol": "grpc"} in service["spec"]["ports"]
    pdb = one(docs, "PodDisruptionBudget", "croupier")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0  # an upgrade never takes a replica down before its successor is ready
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == serve_args(docs).metrics_port


@needs_kubectl
def test_the_server_memory_limit_covers_its_measured_bound() -> None:
    docs = render("base")
    resources = server_container(docs)["resources"]
    mib = {"Mi": 1, "Gi": 1024}
    request, limit = ((int(v[:-2]) * mib[v[-2:]]) for v in (resources["requests"]["memory"],
                                                              resources["limits"]["memory"]))
    # README "Limits": 751 MB of RSS at the 512 MiB buffer budget (16 never-read streams).
    assert serve_args(docs).max_total_buffered_bytes == 512
    assert request >= 751 * 10**6 / 2**20 and limit >= request


@needs_kubectl
def test_the_trainer_finds_the_servers_by_the_headless_service_name() -> None:
    from torch.distributed.run import get_args_parser

    server, trainer = render("base"), render("trainer")
    job = one(trainer, "Job", "croupier-trainer")
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["torchrun"]
    args = get_args_parser().parse_args([a.replace("$(JOB_COMPLETION_INDEX)", "0") for a in container["args"]])
    assert args.nnodes == str(job["spec"]["completions"])
    assert args.master_addr == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert one(trainer, "Service", pod["subdomain"])["spec"]["clusterIP"] == "None"
    target = next(a.split("=", 1)[1] for a in args.training_script_args if a.startswith("--servers="))
    Servers(target)  # the Loader takes it
    service = one(server, "Service", "croupier")
    assert dns_name(target) == (f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local",
                                PORT)
    # Its pods carry the label the server's NetworkPolicy lets through.
    policy = one(server, "NetworkPolicy", "croupier")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= job["spec"]["template"]["metadata"]["labels"].items()
