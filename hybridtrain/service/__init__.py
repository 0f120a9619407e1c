"""The training service: jobs queued, given devices, run here, on Ray or on Kubernetes.

``hybridtrain serve`` runs it (with the HPO service, in one process and one storage);
``hybridtrain jobs …`` talks to it. The pieces, one module per idea:

* :mod:`.spec` — what a job is (:class:`JobSpec`) and the command it runs;
* :mod:`.store` — jobs and the leader lease in the HPO service's storage;
* :mod:`.devices` — slots, gang allocation, priority with aging and reservation;
* :mod:`.scheduler` — one tick: watch, settle, restart, start;
* :mod:`.backend` with :mod:`.local`, :mod:`.ray_backend`, :mod:`.kubernetes`;
* :mod:`.api`, :mod:`.page`, :mod:`.exporter`, :mod:`.server` — REST, web page, metrics;
* :mod:`.client` — :class:`Client`, the typed Python client (:mod:`.transport`: its REST);
* :mod:`.cli` — ``serve`` and the ``jobs`` commands (through :class:`Client`);
* :mod:`.trial_jobs` — HPO trials as jobs.
"""

from hybridtrain.service.client import Attempt, Client, Job

__all__ = ["Attempt", "Client", "Job"]
