"""The typed Python client of the training service (the ``jobs`` commands use it too).

.. code-block:: python

    from hybridtrain.service import Client

    client = Client()                       # the service of $HYBRIDTRAIN_SERVER, the storage's
    job = client.submit("train.yaml", name="gpt", devices=2, set=["train.steps=400"])
    job = client.wait(job.name)             # a Job: state, reason, devices, attempts…
    for text in client.logs(job.name):
        print(text, end="")

Every method raises :class:`~hybridtrain.service.errors.JobError` (one line, as the
service answered it) on a refused request or an unreachable service.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtrain.service.errors import JobError, JobSpecError
from hybridtrain.service.states import TERMINAL, WAITING
from hybridtrain.service.transport import Transport, connect

#: A file with one of these suffixes is a training config; anything else is a program.
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
#: States in which a job has ended.
FINISHED = TERMINAL


@dataclass(frozen=True)
class Attempt:
    """One run of a job: where, how it ended and why."""

    attempt: int
    outcome: str
    exit_code: int | None
    reason: str
    devices: tuple[int, ...]
    started_at: float | None
    ended_at: float | None


@dataclass(frozen=True)
class Job:
    """A job as the service reports it (``GET /v1/jobs/NAME``).

    ``state`` is ``queued``, ``running``, ``preempted``, ``succeeded``, ``failed``,
    ``cancelled`` or ``pruned`` (an HPO trial its pruner stopped);
    ``queue_position`` is its place in the start order while queued (1 = next);
    ``attempts`` is empty in listings (``Client.list``), complete from ``Client.get``.
    """

    name: str
    state: str
    reason: str
    priority: int
    kind: str
    backend: str
    program: str
    devices_requested: int
    nodes: int
    devices: tuple[int, ...]
    attempt: int
    restarts: int
    max_restarts: int
    exit_code: int | None
    job_dir: str
    queue_position: int | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: tuple[Attempt, ...]
    data: Mapping[str, Any]

    @property
    def finished(self) -> bool:
        """Whether the job has ended (succeeded, failed, cancelled or pruned)."""
        return self.state in FINISHED

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """A job from the service's JSON (``data`` keeps all of it, e.g. for ``--json``)."""
        attempts = tuple(Attempt(h["attempt"], h["outcome"], h["exit_code"], h["reason"],
                                 tuple(h["devices"]), h["started_at"], h["ended_at"])
                         for h in data.get("history", ()))
        return cls(
            name=data["name"], state=data["state"], reason=data["reason"],
            priority=data["priority"], kind=data["kind"], backend=data["backend"],
            program=data["program"], devices_requested=data["devices_requested"],
            nodes=data["nodes"], devices=tuple(data["devices"]), attempt=data["attempt"],
            restarts=data["restarts"], max_restarts=data["max_restarts"],
            exit_code=data["exit_code"], job_dir=data["job_dir"],
            queue_position=data.get("queue_position"), created_at=data["created_at"],
            started_at=data["started_at"], finished_at=data["finished_at"],
            attempts=attempts, data=dict(data))


def spec_dict(config_or_program: str | Path | Sequence[str], *, name: str | None = None,
              devices: int = 1, nodes: int = 1, priority: int = 0,
              set: Sequence[str] = (),  # noqa: A002 - the CLI's --set
              max_restarts: int = 0, backend: str = "local", env: Mapping[str, str] | None = None,
              workdir: str | Path | None = None, shell: bool = False,
              kill_grace: float | None = None, preemptible: bool = True) -> dict[str, Any]:
    """The job spec a submit sends (pure; the service validates the rest).

    ``config_or_program``: a training config file (``.yaml``/``.yml``/``.json``), a program
    as an argument vector (a list), or with ``shell=True`` one shell line.

    Raises:
        JobSpecError: a missing config, ``set`` for a program, or a string that is neither
            a config nor a shell line.
    """
    base = Path(workdir) if workdir is not None else Path.cwd()
    spec: dict[str, Any] = {"devices": devices, "nodes": nodes, "priority": priority,
                            "max_restarts": max_restarts, "backend": backend,
                            "workdir": str(base.resolve()), "env": dict(env or {})}
    if name:
        spec["name"] = name
    if kill_grace is not None:
        spec["kill_grace"] = kill_grace
    if not preemptible:
        spec["preemptible"] = False
    if shell:
        if not isinstance(config_or_program, str):
            raise JobSpecError("shell=True takes the whole command as one string")
        return spec | {"command": [config_or_program], "shell": True}
    if isinstance(config_or_program, str | Path):
        path = base / config_or_program
        if not str(config_or_program).endswith(CONFIG_SUFFIXES):
            raise JobSpecError(f"{str(config_or_program)!r} is no training config (.yaml, .yml, "
                               ".json); give a program as a list of arguments, or shell=True")
        if not path.is_file():
            raise JobSpecError(f"config {str(config_or_program)!r} not found")
        return spec | {"config": str(path.resolve()), "overrides": list(set)}
    if set:
        raise JobSpecError("set (--set) applies to a training config; for your own program "
                           "pass its options in its argument list")
    if not config_or_program:
        raise JobSpecError("give a training config or a program (a list of arguments)")
    return spec | {"command": [str(part) for part in config_or_program]}


class Client:
    """The training service from Python.

    Args:
        server: the service's address (``http://127.0.0.1:8080``); default
            ``$HYBRIDTRAIN_SERVER``, else the service that leads the storage, else one
            started in the background (as the ``jobs`` commands do).
        token: its bearer token; default ``$HYBRIDTRAIN_HPO_TOKEN``, else the token file.
        storage, token_file, jobs_dir: where to find (or start) the service.
        say: called with one line when a service is started in the background.

    Raises:
        JobError: the service cannot be reached or started; ServerError: no usable token.
    """

    def __init__(self, server: str | None = None, token: str | None = None, *,
                 storage: str | None = None, token_file: Path | None = None,
                 jobs_dir: Path | None = None, say: Callable[[str], None] | None = None) -> None:
        self.transport: Transport = connect(server, storage, token_file, jobs_dir, token, say)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """A raw REST request (``GET /v1/service``…): the decoded JSON answer."""
        return self.transport.call(method, path, body)

    def submit(self, config_or_program: str | Path | Sequence[str], *, name: str | None = None,
               devices: int = 1, nodes: int = 1, priority: int = 0,
               set: Sequence[str] = (),  # noqa: A002 - the CLI's --set
               **options: Any) -> Job:
        """Queue a training config (``"train.yaml"``, with ``set=["train.steps=400"]``) or a
        program (``["python", "run.py"]``); the service refuses a bad config key here.

        ``options``: ``max_restarts``, ``backend``, ``env``, ``workdir``, ``shell``,
        ``kill_grace``, ``preemptible`` (see :func:`spec_dict`)."""
        spec = spec_dict(config_or_program, name=name, devices=devices, nodes=nodes,
                         priority=priority, set=set, **options)
        return Job.from_dict(self.call("POST", "/v1/jobs", spec))

    def get(self, name: str) -> Job:
        """One job, with its attempts."""
        return Job.from_dict(self.call("GET", f"/v1/jobs/{name}"))

    def list(self, state: str | Sequence[str] | None = None) -> list[Job]:
        """Jobs, oldest first (``state``: only these states)."""
        states = [state] if isinstance(state, str) else list(state or ())
        query = f"?state={','.join(states)}" if states else ""
        return [Job.from_dict(j) for j in self.call("GET", f"/v1/jobs{query}")]

    def wait(self, name: str, timeout: float | None = None, poll: float = 0.5,
             on_poll: Callable[[Job], None] | None = None) -> Job:
        """Wait until the job has ended; the finished job.

        Raises:
            JobError: still not finished after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(name)
            if on_poll is not None:
                on_poll(job)
            if job.finished:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise JobWaitTimeout(f"job {name} is still {job.state} after {timeout:g} s")
            time.sleep(poll)

    def logs(self, name: str, follow: bool = False, poll: float = 1.0,
             on_queued: Callable[[Job], None] | None = None) -> Iterator[str]:
        """The job's output in chunks; ``follow``: until the job has ended."""
        offset = 0
        while True:
            chunk = self.call("GET", f"/v1/jobs/{name}/logs?offset={offset}")
            if follow and chunk["state"] in WAITING and on_queued is not None:
                on_queued(self.get(name))
            offset = chunk["offset"]
            if chunk["text"]:
                yield chunk["text"]
                continue
            if not follow or chunk["state"] not in (*WAITING, "running"):
                return
            time.sleep(poll)

    def cancel(self, name: str) -> Job:
        """Cancel: a queued job at once, a running one by SIGTERM (a trainer saves a
        checkpoint and stops); :meth:`wait` for it to end."""
        return Job.from_dict(self.call("POST", f"/v1/jobs/{name}/cancel"))

    def resubmit(self, name: str, set: Sequence[str] = ()) -> Job:  # noqa: A002
        """Queue a finished job again (a training job resumes from its newest checkpoint);
        ``set`` adds config overrides, e.g. ``["train.steps=400"]`` to train on."""
        body = {"set": list(set)} if set else None
        return Job.from_dict(self.call("POST", f"/v1/jobs/{name}/resubmit", body))


class JobWaitTimeout(JobError):
    """:meth:`Client.wait` gave up: the job had not ended within its timeout."""
