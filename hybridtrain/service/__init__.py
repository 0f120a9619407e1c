"""The training service: jobs queued, given devices, run here, on Ray or on Kubernetes.

``hybridtrain serve`` runs it (with the HPO service, in one process and one storage);
``hybridtrain jobs …`` talks to it. The pieces, one module per idea:

* :mod:`.spec` — what a job is (:class:`JobSpec`) and the command it runs;
* :mod:`.store` — jobs and the leader lease in the services' shared storage
  (:mod:`hybridtrain.server.storage`);
* :mod:`.devices` — slots, gang allocation, priority with aging and reservation;
* :mod:`.scheduler` — one tick: watch, settle, restart, start;
* :mod:`.backend` with :mod:`.local`, :mod:`.ray_backend`, :mod:`.kubernetes`;
* :mod:`.api`, :mod:`.page`, :mod:`.exporter` — REST, web page, metrics;
* :mod:`.opening` — a service opened on a storage (what ``serve`` hosts);
* :mod:`.client` — :class:`Client`, the typed Python client (:mod:`.transport`: its REST);

The commands (``serve``, ``jobs …``) are :mod:`hybridtrain.commands.jobs`, the process
that hosts both services :mod:`hybridtrain.commands.serve`; HPO trials run as jobs through
:mod:`hybridtrain.hpo.trial_jobs`.
"""

from hybridtrain.service.client import Attempt, Client, Job

__all__ = ["Attempt", "Client", "Job"]
