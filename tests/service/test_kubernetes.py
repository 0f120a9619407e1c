"""The Kubernetes backend's objects, validated offline: no cluster is reachable here, so
the PyTorchJob and ConfigMap the backend would create are checked against the vendored
Kubeflow CRD schema and the Kubernetes schemas (kubernetes-validate, strict), and the
status conditions the training operator writes are read back as the service reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.service.kubernetes import config_map, object_name, outcome, pytorchjob
from hybridtrain.service.spec import load_job_spec
from hybridtrain.service.store import JobStore
from tests.deploy.test_manifests import _crd_validator, _k8s_validate
from tests.service.conftest import tiny_config


def _validate(doc: dict) -> None:
    errors = list(_crd_validator("kubeflow.org/v1", "PyTorchJob").iter_errors(doc))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
        _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                       "template": replica["template"]})


@pytest.mark.parametrize("nodes", [1, 3])
def test_pytorchjob_of_a_training_job_validates(tmp_path: Path, nodes: int) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 's.db'}")
    cfg = tiny_config(tmp_path / "My Config.yaml", steps=5, checkpoint_every=1)
    spec = load_job_spec({"name": "GPT_big.run", "config": str(cfg), "devices": 8,
                          "nodes": nodes, "backend": "kubernetes",
                          "overrides": ["train.steps=7"], "kill_grace": 300})
    job = store.submit(spec, str(tmp_path / "jobs" / spec.name))
    doc = pytorchjob(job, spec.program(tmp_path / "run"), {"HYBRIDTRAIN_JOB_NAME": job.name},
                     "hybridtrain", "registry.example.com/hybridtrain:0.1.0")
    _validate(doc)
    assert doc["metadata"]["name"] == object_name(job) == f"ht-gpt-big-run-{job.id}-0"
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == ({"Master"} if nodes == 1 else {"Master", "Worker"})
    assert sum(r["replicas"] for r in replicas.values()) == nodes
    assert doc["spec"]["nprocPerNode"] == "8" and doc["spec"]["runPolicy"]["backoffLimit"] == 0
    pod = replicas["Master"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["torchrun"]
    assert container["args"][:4] == ["-m", "hybridtrain", "train", "/config/My Config.yaml"]
    assert "--resume" in container["args"] and "train.steps=7" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["terminationGracePeriodSeconds"] == 300
    shipped = config_map(job, "hybridtrain")
    assert shipped is not None
    _k8s_validate(shipped)
    assert shipped["data"]["My Config.yaml"] == cfg.read_text()


def test_a_command_job_and_the_validator_is_not_vacuous(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 's.db'}")
    spec = load_job_spec({"name": "cmd", "command": ["python", "-c", "print(1)"],
                          "devices": 0, "backend": "kubernetes"})
    job = store.submit(spec, str(tmp_path / "jobs" / "cmd"))
    doc = pytorchjob(job, spec.program(tmp_path / "run"), {}, "ns", "img:1")
    _validate(doc)
    container = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python"] and container["args"] == ["-c", "print(1)"]
    assert config_map(job, "ns") is None
    doc["spec"]["runPolicy"]["backoffLimitt"] = 1
    assert list(_crd_validator("kubeflow.org/v1", "PyTorchJob").iter_errors(doc))


def test_status_conditions_read_as_the_operator_writes_them() -> None:
    def obj(*conds: tuple[str, str]) -> dict:
        return {"status": {"conditions": [
            {"type": t, "status": s, "reason": f"PyTorchJob{t}", "message": f"job is {t}"}
            for t, s in conds]}}

    assert outcome(obj(("Created", "True")), cancelled=False) is None
    assert outcome(obj(("Created", "True"), ("Running", "True")), False) is None
    done = outcome(obj(("Created", "True"), ("Running", "False"), ("Succeeded", "True")), False)
    assert done is not None and done.code == 0
    failed = outcome(obj(("Created", "True"), ("Running", "False"), ("Failed", "True")), False)
    assert failed is not None and failed.code is None and "job is Failed" in failed.reason
    # A resumed (restarting) job is not reported as created or finished.
    assert outcome(obj(("Created", "True"), ("Restarting", "True")), False) is None
    gone = outcome(None, cancelled=True)
    assert gone is not None and gone.code == 130
    outside = outcome(None, cancelled=False)
    assert outside is not None and "outside the service" in outside.reason
