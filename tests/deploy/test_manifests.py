"""The Kubernetes manifests under deploy/k8s validate offline: built-in kinds against the
Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields are errors, as with
kubectl's default server-side field validation), the PyTorchJob and PodMonitor against
their CRDs' OpenAPI schemas (vendored under schemas/), and the parts refer to each other
consistently (selectors, ports, secrets, volumes, the hybridtrain command lines)."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.30.0"
CRDS = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.v1.yaml",
}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _manifests() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_Loader):
            if doc is not None:
                docs.append((path, doc))
    return docs


MANIFESTS = _manifests()


def _ids() -> list[str]:
    return [f"{p.relative_to(K8S)}:{d['kind']}/{d['metadata']['name']}" for p, d in MANIFESTS]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in MANIFESTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it: fields not in the schema
    are unknown (rejected under strict field validation) unless the node preserves them."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(api_version: str, kind: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    vendored = yaml.load((SCHEMAS / CRDS[(api_version, kind)]).read_text(encoding="utf-8"), Loader=_Loader)
    assert vendored["kind"] == kind and f"{vendored['group']}/{vendored['version']}" == api_version
    return jsonschema.Draft7Validator(_strict(vendored["openAPIV3Schema"]))


def _k8s_validate(doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_there_are_manifests_of_every_part() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in MANIFESTS}
    assert {("PyTorchJob", "hybridtrain-gpt-125m"), ("PodMonitor", "hybridtrain-training"),
            ("Deployment", "hpo-controller"), ("StatefulSet", "hpo-postgres"), ("Service", "hpo-postgres"),
            ("Secret", "hybridtrain-hpo-token"), ("Deployment", "optuna-dashboard"),
            ("Service", "optuna-dashboard"), ("Service", "hpo"),
            ("PersistentVolumeClaim", "hybridtrain-checkpoints")} <= kinds


@pytest.mark.parametrize(("path", "doc"), MANIFESTS, ids=_ids())
def test_manifest_validates_against_its_schema(path: Path, doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key not in CRDS:
        _k8s_validate(doc)
        return
    errors = sorted(_crd_validator(*key).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    if doc["kind"] == "PyTorchJob":
        # The CRD leaves the pod template open (x-kubernetes-preserve-unknown-fields is not
        # set, but metadata is a bare object); validate each template as a core PodTemplate.
        for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
            _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                           "template": spec["template"]})


def test_the_validators_reject_what_the_cluster_would() -> None:
    """The checks above are not vacuous: a misspelt field fails them."""
    job = copy.deepcopy(_one("PyTorchJob"))
    job["spec"]["elasticPolicy"]["maxReplica"] = 4
    assert list(_crd_validator("kubeflow.org/v1", "PyTorchJob").iter_errors(job))
    monitor = copy.deepcopy(_one("PodMonitor", "hybridtrain-training"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    assert list(_crd_validator("monitoring.coreos.com/v1", "PodMonitor").iter_errors(monitor))
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = copy.deepcopy(_one("Deployment", "hpo-controller"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_kustomizations_list_existing_files() -> None:
    listed = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        data = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
        assert data["kind"] == "Kustomization"
        for resource in data["resources"]:
            target = (kustomization.parent / resource).resolve()
            assert target.exists(), f"{kustomization}: {resource}"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{kustomization}: {resource}"
            else:
                # kustomize loads files only from inside its root (directories are bases).
                assert target.is_relative_to(kustomization.parent.resolve()), f"{kustomization}: {resource}"
                listed.add(target)
    # Every manifest is applied by some kustomization, except the secrets' placeholders
    # (docs/deploy.md creates them with kubectl create secret).
    unlisted = {p for p, _ in MANIFESTS if p.resolve() not in listed}
    assert {p.name for p in unlisted} == {"secrets.yaml"}


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def _pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    return doc["spec"]["template"]["metadata"]["labels"]


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in MANIFESTS if d["kind"] in ("Deployment", "StatefulSet", "PyTorchJob")]


def test_workloads_run_as_non_root_and_reference_what_exists() -> None:
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
               for _, d in MANIFESTS if d["kind"] == "Secret"}
    claims = {d["metadata"]["name"] for _, d in MANIFESTS if d["kind"] == "PersistentVolumeClaim"}
    config_maps = {d["metadata"]["name"] for _, d in MANIFESTS if d["kind"] == "ConfigMap"}
    for doc in _workloads():
        assert doc["metadata"]["namespace"] == "hybridtrain"
        if doc["kind"] != "PyTorchJob":
            assert doc["spec"]["selector"]["matchLabels"].items() <= _pod_labels(doc).items()
        pod = _pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        templates = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])} | templates
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
            defined: set[str] = set()
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], ref
                # $(VAR) expands only variables defined earlier in the list.
                for used in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert used in defined, (env["name"], used)
                defined.add(env["name"])
            for arg in container.get("args", []) + container.get("command", []):
                for used in re.findall(r"\$\((\w+)\)", arg):
                    assert used in defined, (container["name"], used)


def test_services_select_pods_and_name_their_ports() -> None:
    for service in [d for _, d in MANIFESTS if d["kind"] == "Service"]:
        selector = service["spec"]["selector"]
        matches = [w for w in _workloads() if selector.items() <= _pod_labels(w).items()]
        assert len(matches) == 1, service["metadata"]["name"]
        ports = {p["name"] for c in _pod_spec(matches[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    postgres = _one("StatefulSet", "hpo-postgres")
    assert _one("Service", postgres["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def _train_parser_args(args: list[str]) -> Any:
    from hybridtrain.commands.cli import build_parser

    return build_parser().parse_args(args)


def test_pytorchjob_runs_hybridtrain_train_elastically_with_resume(tmp_path: Path) -> None:
    job = _one("PyTorchJob")
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    # The training operator's admission rules (pkg/webhooks/pytorch/pytorchjob_webhook.go, v1.9.0).
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: workers only
    assert "nProcPerNode" not in elastic and int(spec["nprocPerNode"]) >= 1  # the deprecated spelling is refused
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert 1 <= elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
    assert container["image"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["pytorchjob-port"] == 23456  # the rendezvous endpoint the operator advertises
    nproc = int(spec["nprocPerNode"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == nproc

    # torchrun -m hybridtrain train …: the workers' command line is a valid `train` one.
    command = container["command"] + container["args"]
    assert command[:3] == ["torchrun", "-m", "hybridtrain"]
    args = _train_parser_args(command[3:])
    assert args.command == "train" and args.resume is True and args.no_progress

    # The config is the ConfigMap's file; it validates, writes under the checkpoint volume,
    # and serves metrics on 0.0.0.0:9400 + local rank, the ports the pod declares.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_map = _one("ConfigMap", volumes["config"]["configMap"]["name"])
    assert args.config.startswith(mounts["config"] + "/")
    config_file = tmp_path / Path(args.config).name
    config_file.write_text(config_map["data"][Path(args.config).name], encoding="utf-8")
    from hybridtrain.config import load_config

    cfg = load_config(str(config_file), list(args.overrides))
    checkpoint_mount = next(mounts[name] for name, v in volumes.items() if "persistentVolumeClaim" in v)
    assert cfg.train.output_dir.startswith(checkpoint_mount + "/")
    claim = _one("PersistentVolumeClaim", volumes["checkpoints"]["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # every worker pod mounts it
    assert cfg.train.metrics_port == 9400 and cfg.train.metrics_host == "0.0.0.0"
    # The config plans at the smallest and the largest world size the elastic job reaches.
    from hybridtrain.training_inputs import plan_training

    for nodes in (spec["elasticPolicy"]["minReplicas"], spec["elasticPolicy"]["maxReplicas"]):
        plan_training(cfg, world_size=nodes * int(spec["nprocPerNode"]))
    assert {f"metrics-{r}" if r else "metrics": 9400 + r for r in range(nproc)}.items() <= ports.items()


def test_podmonitor_scrapes_every_ranks_metrics_port() -> None:
    monitor = _one("PodMonitor", "hybridtrain-training")
    job = _one("PyTorchJob")
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert monitor["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    nproc = int(job["spec"]["nprocPerNode"])
    endpoints = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert endpoints[0] == "metrics"
    assert endpoints == ["metrics", *(f"metrics-{r}" for r in range(1, nproc))]
    assert all(e.get("path", "/metrics") == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])


def test_hpo_controller_serves_on_the_postgres_service_with_the_token() -> None:
    controller = _one("Deployment", "hpo-controller")
    pod = _pod_spec(controller)
    (container,) = pod["containers"]
    args = _train_parser_args(container["command"][1:] + container["args"])
    assert (args.command, args.hpo_command, args.host, args.port) == ("hpo", "serve", "0.0.0.0", 8080)
    env = {e["name"]: e for e in container["env"]}
    assert env["HYBRIDTRAIN_HPO_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hybridtrain-hpo-token"
    storage = env["HYBRIDTRAIN_HPO_STORAGE"]["value"]
    match = re.fullmatch(r"postgresql://(\w+):\$\(POSTGRES_PASSWORD\)@([\w-]+):5432/(\w+)", storage)
    assert match, storage
    user, host, database = match.groups()
    postgres = _one("StatefulSet", "hpo-postgres")
    pg_env = {e["name"]: e.get("value") for e in postgres["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"]) == (user, database)
    assert _one("Service", host)["spec"]["selector"] == postgres["spec"]["selector"]["matchLabels"]
    assert controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == "Recreate"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"

    dashboard = _pod_spec(_one("Deployment", "optuna-dashboard"))["containers"][0]
    assert dashboard["command"] == ["optuna-dashboard"]
    assert dashboard["args"][0] == "$(HYBRIDTRAIN_HPO_STORAGE)"
    assert {e["name"]: e.get("value") for e in dashboard["env"]}["HYBRIDTRAIN_HPO_STORAGE"] == storage
    assert shlex.join(dashboard["args"][1:]) == "--host 0.0.0.0 --port 8081"


def test_training_service_serves_jobs_on_kubernetes_with_least_privilege() -> None:
    """deploy/k8s/service: `hybridtrain serve --kubernetes` on the HPO storage, allowed to
    manage PyTorchJobs (and their ConfigMaps, pod logs) in its namespace and nothing else."""
    deployment = _one("Deployment", "training-service")
    pod = _pod_spec(deployment)
    (container,) = pod["containers"]
    args = _train_parser_args(container["command"][1:] + container["args"])
    assert (args.command, args.host, args.port, args.kubernetes) == ("serve", "0.0.0.0", 8080,
                                                                   "hybridtrain")
    assert args.image == container["image"]
    hpo_env = {e["name"]: e for e in _pod_spec(_one("Deployment", "hpo-controller"))
               ["containers"][0]["env"]}
    env = {e["name"]: e for e in container["env"]}
    for name in ("HYBRIDTRAIN_HPO_TOKEN", "POSTGRES_PASSWORD", "HYBRIDTRAIN_HPO_STORAGE"):
        assert env[name] == hpo_env[name]  # one storage, one token: one service
    role = _one("Role", "hybridtrain-service")
    binding = _one("RoleBinding", "hybridtrain-service")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    _one("ServiceAccount", pod["serviceAccountName"])
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules[("kubeflow.org", "pytorchjobs")] >= {"create", "get", "delete"}
    assert all("*" not in verbs for verbs in rules.values())
    monitor = _one("PodMonitor", "hybridtrain-service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= _pod_labels(deployment).items()
    credentials = monitor["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]
    assert credentials == env["HYBRIDTRAIN_HPO_TOKEN"]["valueFrom"]["secretKeyRef"]
