"""The Kubernetes backend: a job is a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``).

Created through the official ``kubernetes`` client (``CustomObjectsApi``); its status is
read back from the object's conditions and its logs from the master pod. Why
``PyTorchJob`` rather than TorchX's Kubernetes scheduler: TorchX's needs Volcano on the
cluster and creates Volcano jobs, while a ``PyTorchJob`` needs only the Kubeflow training
operator, which ``deploy/k8s/training`` already targets, and whose ``PET_*`` variables
are what ``torchrun`` (inside ``hybridtrain train``/``launch``) reads for its rendezvous.

What the pods run: a training config is shipped in a ``ConfigMap`` (mounted at
``/config``) and trained with ``torchrun -m hybridtrain train /config/… --resume``
into ``/checkpoints/NAME`` on the ``hybridtrain-checkpoints`` volume, so a restart (a new
attempt) resumes from its newest checkpoint; a Python script runs under ``torchrun``; any
other command as it is, in the image. The service restarts failed attempts itself
(``backoffLimit: 0``, one object per attempt), so restarts follow ``max_restarts`` and
their reasons are recorded as for any job. A cancel deletes the object: the pods get
SIGTERM and ``kill_grace`` seconds (``terminationGracePeriodSeconds``) to checkpoint.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from hybridtrain.service.backend import Backend, Ended, Started
from hybridtrain.service.errors import BackendError
from hybridtrain.service.store import JobRecord

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
CHECKPOINTS_CLAIM = "hybridtrain-checkpoints"
_LOG_EVERY = 5.0


def object_name(job: JobRecord) -> str:
    """The attempt's object name: a DNS label, the same every time it is computed."""
    base = re.sub(r"[^a-z0-9-]", "-", job.name.lower()).strip("-")[:40] or "job"
    return f"ht-{base}-{job.id}-{job.attempt}"


def _container_program(job: JobRecord, argv: list[str]) -> tuple[list[str], list[str]]:
    """``(command, args)`` of the pods (see the module docstring)."""
    spec = job.spec
    if spec.config is not None:
        args = ["-m", "hybridtrain", "train", f"/config/{Path(spec.config).name}",
                "--resume", "--no-progress", "--output-dir", f"/checkpoints/{job.name}"]
        for item in spec.overrides:
            args += ["--set", item]
        return ["torchrun"], args
    if spec.command[0].endswith(".py") and not spec.shell:
        return ["torchrun"], list(spec.command)
    return list(argv[:1]), list(argv[1:])


def pytorchjob(job: JobRecord, argv: list[str], env: dict[str, str], namespace: str,
               image: str) -> dict[str, Any]:
    """The ``PyTorchJob`` of the job's current attempt (a plain dict, as sent)."""
    spec = job.spec
    name = object_name(job)
    command, args = _container_program(job, argv)
    gpus = spec.devices if spec.devices > 0 else 0
    resources: dict[str, Any] = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    mounts: list[dict[str, Any]] = [{"name": "checkpoints", "mountPath": "/checkpoints"}]
    volumes: list[dict[str, Any]] = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": CHECKPOINTS_CLAIM}}]
    if spec.config is not None:
        mounts.append({"name": "config", "mountPath": "/config", "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": f"{name}-config"}})
    container = {
        "name": "pytorch",  # the operator requires this name
        "image": image,
        "command": command,
        "args": args,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    } | ({"resources": resources} if resources else {})
    template = {
        "metadata": {"labels": {"app.kubernetes.io/part-of": "hybridtrain",
                                "hybridtrain.io/job": name}},
        "spec": {"containers": [container], "volumes": volumes,
                 "terminationGracePeriodSeconds": int(spec.kill_grace),
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                     "runAsGroup": 1000, "fsGroup": 1000,
                                     "seccompProfile": {"type": "RuntimeDefault"}}},
    }
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "Never",
                              "template": template}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "hybridtrain",
                                "hybridtrain.io/job": re.sub(r"[^A-Za-z0-9_.-]", "-",
                                                             job.name)[:63]}},
        "spec": {"nprocPerNode": str(max(spec.devices, 1)),
                 # One object per attempt: the service counts restarts, not the operator.
                 "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": replicas},
    }


def config_map(job: JobRecord, namespace: str) -> dict[str, Any] | None:
    """The ``ConfigMap`` that ships a training job's config file, or ``None``."""
    if job.spec.config is None:
        return None
    path = Path(job.spec.config)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{object_name(job)}-config", "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "hybridtrain"}},
            "data": {path.name: path.read_text()}}


def outcome(obj: dict[str, Any] | None, cancelled: bool) -> Ended | None:
    """How a ``PyTorchJob`` ended from its status, or ``None`` while it runs.

    The condition that is ``True`` last decides: ``Succeeded``, ``Failed``; ``Created``,
    ``Running``, ``Restarting`` and ``Suspended`` are not ends. An object that is gone was
    deleted: by a cancel (then 130, as a trainer that saved and stopped), else by someone
    outside the service.
    """
    if obj is None:
        return Ended(130, "deleted on cancel") if cancelled else Ended(
            None, "its PyTorchJob was deleted outside the service")
    conditions = [c for c in (obj.get("status") or {}).get("conditions") or []
                  if str(c.get("status")) == "True"]
    if not conditions:
        return None
    last = conditions[-1]
    message = str(last.get("message") or last.get("reason") or "")[:300]
    if last.get("type") == "Succeeded":
        return Ended(0)
    if last.get("type") == "Failed":
        return Ended(None, f"PyTorchJob failed: {message}")
    return None


class KubernetesBackend(Backend):
    """Creates one ``PyTorchJob`` per attempt in ``namespace`` (kubeconfig or in-cluster).

    Args:
        namespace: where the jobs go.
        image: the container image (hybridtrain installed; deploy/Dockerfile).
    """

    name = "kubernetes"

    def __init__(self, namespace: str, image: str) -> None:
        self.namespace, self.image = namespace, image
        self._apis: tuple[Any, Any] | None = None
        self._logged: dict[str, float] = {}

    def apis(self) -> tuple[Any, Any]:
        """``(CustomObjectsApi, CoreV1Api)`` from the kubeconfig or the pod's account."""
        if self._apis is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise BackendError("the Kubernetes backend needs the kubernetes client: pip "
                                   "install 'hybridtrain[kubernetes]'") from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as exc:
                    raise BackendError(f"no Kubernetes cluster configured: {exc}") from None
            self._apis = (client.CustomObjectsApi(), client.CoreV1Api())
        return self._apis

    def check(self) -> None:
        """A kubeconfig or the pod's service account must be there."""
        self.apis()

    def start(self, job: JobRecord, argv: list[str], env: dict[str, str],
              devices: tuple[int, ...]) -> Started:
        from kubernetes.client.rest import ApiException

        custom, core = self.apis()
        body = pytorchjob(job, argv, env, self.namespace, self.image)
        try:
            shipped = config_map(job, self.namespace)
            if shipped is not None:
                core.create_namespaced_config_map(self.namespace, shipped)
            custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        except ApiException as exc:
            raise BackendError(f"Kubernetes refused job {job.name!r}: {exc.status} "
                               f"{exc.reason}") from None
        return Started(ref=body["metadata"]["name"])

    def poll(self, job: JobRecord) -> Ended | None:
        from kubernetes.client.rest import ApiException

        custom, _ = self.apis()
        name = job.backend_ref or object_name(job)
        try:
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                      name)
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"PyTorchJob {name}: {exc.status} {exc.reason}") from None
            if job.backend_ref is None:
                return Ended(None, never_started=True)
            obj = None
        ended = outcome(obj, job.cancel_requested is not None)
        self._copy_logs(job, name, force=ended is not None)
        return ended

    def _copy_logs(self, job: JobRecord, name: str, force: bool) -> None:
        from kubernetes.client.rest import ApiException

        now = time.monotonic()
        if not force and now - self._logged.get(name, 0.0) < _LOG_EVERY:
            return
        self._logged[name] = now
        _, core = self.apis()
        try:
            pods = core.list_namespaced_pod(
                self.namespace, label_selector=f"training.kubeflow.org/job-name={name},"
                                               "training.kubeflow.org/replica-type=master")
            if not pods.items:
                return
            text = core.read_namespaced_pod_log(pods.items[0].metadata.name, self.namespace)
        except ApiException:
            return
        directory = Path(job.job_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"k8s-attempt-{job.attempt}.log").write_text(
            f"--- attempt {job.attempt} on Kubernetes ({name}) ---\n{text}")
        parts = sorted(directory.glob("k8s-attempt-*.log"),
                       key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        (directory / job.spec.stdout_file).write_text("".join(p.read_text() for p in parts))

    def stop(self, job: JobRecord, force: bool) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        custom, _ = self.apis()
        grace = 0 if force else int(job.spec.kill_grace)
        try:
            custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, job.backend_ref or object_name(job),
                body=client.V1DeleteOptions(grace_period_seconds=grace,
                                            propagation_policy="Foreground"))
        except ApiException as exc:
            if exc.status != 404:
                raise BackendError(f"cannot delete PyTorchJob: {exc.status} {exc.reason}") from None
