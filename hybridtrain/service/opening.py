"""A training service opened on a storage: its backends, its scheduler, its REST face.

:func:`open_service` builds what ``hybridtrain serve`` hosts (:mod:`hybridtrain.commands.serve`)
and what tests drive without a server.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hybridtrain.service.backend import Backend
from hybridtrain.service.devices import Slots, detect_slots
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.store import JobStore

if TYPE_CHECKING:
    from hybridtrain.service.api import JobService


def make_backends(slots: Slots, ray_address: str | None = None,
                  kubernetes_namespace: str | None = None,
                  image: str = "hybridtrain:latest") -> dict[str, Backend]:
    """The backends a service enables: local always, Ray and Kubernetes when asked."""
    backends: dict[str, Backend] = {"local": LocalBackend(slots)}
    if ray_address:
        from hybridtrain.service.ray_backend import RayBackend

        backends["ray"] = RayBackend(ray_address)
    if kubernetes_namespace:
        from hybridtrain.service.kubernetes import KubernetesBackend

        backends["kubernetes"] = KubernetesBackend(kubernetes_namespace, image)
    return backends


def open_service(storage: str | None, jobs_dir: Path, url: str | None,
                 backends: dict[str, Backend] | None = None, slots: Slots | None = None,
                 lease: float = 10.0, preemption: bool = True) -> JobService:
    """A :class:`~.api.JobService` with its scheduler (not yet ticking); ``preemption``:
    see :class:`~.scheduler.Scheduler`."""
    from hybridtrain.service.api import JobService
    from hybridtrain.service.users import UserStore

    slots = slots or detect_slots()
    store = JobStore(storage)
    users = UserStore(store.url)
    scheduler = Scheduler(store, slots, backends or make_backends(slots), url=url,
                          lease=lease, preemption=preemption, on_event=lambda line: print(line, flush=True),
                          quotas=users.quotas)
    return JobService(store, scheduler, jobs_dir, users)
