"""What the HPO service and the training service share, and nothing else of hybridtrain.

One module per idea, each used by both services (:mod:`hybridtrain.hpo` sits above
:mod:`hybridtrain.service`, and this part below both, so neither imports the other to
reach it):

* :mod:`.errors` — the neutral error kinds (invalid, conflict, not found, storage, full)
  and the HTTP status of each; each service derives its own classes;
* :mod:`.storage` — the database: its URL and the variables it comes from, the engine,
  the set-up lock;
* :mod:`.auth` — the bearer token (generated once, compared in constant time) and the
  login cookie; :mod:`.guard` — token first and a bounded body, before FastAPI reads it;
  :mod:`.rest` — the token dependency and one-line error answers of both REST apps;
* :mod:`.listen` — ``--host``/``--port`` checked and bound; :mod:`.slow_clients` —
  slowloris bounds for uvicorn;
* :mod:`.process_groups` — a trial's or a job's process group: alive, stopped, an
  orphan's; :mod:`.owners` — the id a lease holder records;
* :mod:`.metric_lines` — one metrics JSONL line as numbers and a step.
"""
