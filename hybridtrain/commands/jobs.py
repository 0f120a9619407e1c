"""``hybridtrain serve`` and ``hybridtrain jobs …``.

Nothing heavy is imported at module level, so ``hybridtrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.server.errors import ServerError
from hybridtrain.service.client import CONFIG_SUFFIXES
from hybridtrain.service.states import WAITING

if TYPE_CHECKING:
    from hybridtrain.service.client import Client

_STORAGE_HELP = ("storage URL (default: $HYBRIDTRAIN_SERVICE_STORAGE, else $HYBRIDTRAIN_HPO_STORAGE, "
                 "else sqlite:///hpo.db)")
#: Exit codes of the commands that wait for a job to end (``wait``, ``submit --wait``,
#: ``cancel --wait``), by the job's final state. Every other command exits 0 when the
#: service did what was asked; every command exits 2 for a refused request (one line).
WAIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 130, "pruned": 130}
#: ``wait --timeout`` ran out before the job ended.
WAIT_TIMEOUT = 124


#: Exit code of a command whose reader went away (``jobs list | head -1``), as a Unix tool
#: killed by SIGPIPE reports it.
BROKEN_PIPE = 141


def _errors_to_exit(func: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ServerError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            # Python would print a traceback when it flushes stdout at exit: point stdout at
            # /dev/null so the exit is quiet, as `head` expects of the command before it.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return BROKEN_PIPE

    wrapper.__doc__ = func.__doc__
    return wrapper


def _client(args: argparse.Namespace) -> Client:
    from hybridtrain.service.client import Client

    return Client(args.server, storage=args.storage,
                  token_file=Path(args.token_file) if args.token_file else None,
                  jobs_dir=Path(args.jobs_dir) if args.jobs_dir else None,
                  say=lambda line: print(f"info: {line}", file=sys.stderr))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: write KEY=VALUE")
        out[key] = value
    return out


def submit_args(args: argparse.Namespace) -> tuple[str | list[str], dict[str, Any]]:
    """What a ``jobs submit`` command line asks :meth:`Client.submit` for:
    ``(config or program, options)``."""
    program = list(args.program)
    options: dict[str, Any] = {
        "name": args.name, "devices": args.devices, "nodes": args.nodes,
        "priority": args.priority, "max_restarts": args.max_restarts, "backend": args.backend,
        "env": _pairs(args.env, "--env"), "kill_grace": args.kill_grace,
        "preemptible": args.preemptible,
        "set": list(args.overrides)}
    if args.shell is not None:
        if program:
            raise ValueError("--shell takes the whole command as one line; give no other "
                             "program")
        return args.shell, options | {"shell": True}
    if len(program) == 1 and program[0].endswith(CONFIG_SUFFIXES) and not args.command:
        return program[0], options
    if program and args.overrides:
        raise ValueError("--set applies to a training config; for your own program pass "
                         "its options after --")
    if not program:
        raise ValueError("give a training config (jobs submit CONFIG) or a command "
                         "(jobs submit -- PROGRAM ARGS)")
    return program, options


def _line(job: Mapping[str, Any]) -> str:
    devices = ",".join(map(str, job["devices"])) or "-"
    return (f"{job['name']:<24} {job['state']:<10} devices {devices:<8} restarts "
            f"{job['restarts']}/{job['max_restarts']}  {job['reason']}")


_TABLE = "{:<24} {:<12} {:>8} {:<10} {:>6} {:>8}  {}"
_HEADER = _TABLE.format("NAME", "STATE", "PRIORITY", "DEVICES", "AGE", "RESTARTS", "REASON")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def _row(job: Mapping[str, Any], now: float) -> str:
    state = job["state"] + (f" #{job['queue_position']}" if job.get("queue_position") else "")
    devices = ",".join(map(str, job["devices"])) or f"{job['devices_requested']} asked"
    return _TABLE.format(job["name"], state, job["priority"], devices,
                         _age(now - job["created_at"]), f"{job['restarts']}/{job['max_restarts']}",
                         job["reason"])


def list_order(jobs: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Running jobs (oldest start first), the queue in start order, then finished jobs
    (newest first)."""
    def key(job: Mapping[str, Any]) -> tuple[int, float]:
        if job["state"] == "running":
            return 0, job["started_at"] or 0.0
        if job["state"] in WAITING:
            return 1, job.get("queue_position") or 0
        return 2, -(job["finished_at"] or 0.0)
    return sorted(jobs, key=key)


def waiting_line(job: Mapping[str, Any]) -> str | None:
    """What a queued or preempted job waits for (``None`` when it does not wait), for
    ``wait``/``logs -f``."""
    if job["state"] not in WAITING:
        return None
    place = f"position {job['queue_position']}, " if job.get("queue_position") else ""
    what = (f"{job['devices_requested']} devices" if job["backend"] == "local"
            else f"the {job['backend']} cluster")
    return f"{job['state']}: {place}waiting for {what}"


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data) if args.json else text, flush=True)


@_errors_to_exit
def cmd_submit(args: argparse.Namespace) -> int:
    """Queue a training config or a command as a job."""
    program, options = submit_args(args)
    client = _client(args)
    job = client.submit(program, **options)
    _out(args, job.data, f"submitted {job.name}: {job.state} ({job.reason})")
    if args.wait:
        return _wait(client, args, job.name, None)
    return 0


@_errors_to_exit
def cmd_list(args: argparse.Namespace) -> int:
    """List jobs: queued and running first, then finished."""
    jobs = list_order([j.data for j in _client(args).list(args.state)])
    now = time.time()
    _out(args, jobs, "\n".join([_HEADER, *(_row(j, now) for j in jobs)]) if jobs else "no jobs")
    return 0


@_errors_to_exit
def cmd_show(args: argparse.Namespace) -> int:
    """Show one job: state, reason, devices, attempts."""
    job = _client(args).get(args.name).data
    lines = [_line(job), f"  program: {job['program']}", f"  backend: {job['backend']}, "
             f"nodes {job['nodes']}, devices asked {job['devices_requested']}, "
             f"priority {job['priority']}", f"  directory: {job['job_dir']}"]
    lines += [f"  attempt {h['attempt']}: {h['outcome']} (exit {h['exit_code']}): {h['reason']}"
              for h in job["history"]]
    _out(args, job, "\n".join(lines))
    return 0


@_errors_to_exit
def cmd_logs(args: argparse.Namespace) -> int:
    """Print a job's output; -f follows it until the job ends."""
    said: list[str | None] = [None]
    for text in _client(args).logs(args.name, follow=args.follow,
                                   on_queued=lambda job: _say_waiting(job.data, said)):
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


@_errors_to_exit
def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a job (SIGTERM: a trainer saves a checkpoint and stops)."""
    client = _client(args)
    job = client.cancel(args.name)
    _out(args, job.data, f"{job.name}: {job.state}"
         + (" (SIGTERM sent; it saves a checkpoint and stops)" if job.state == "running"
            else f" ({job.reason})"))
    if args.wait:
        return _wait(client, args, job.name, None)
    return 0


@_errors_to_exit
def cmd_wait(args: argparse.Namespace) -> int:
    """Wait until a job ends; exit 0 succeeded, 1 failed, 130 cancelled (or pruned)."""
    return _wait(_client(args), args, args.name, args.timeout)


def _say_waiting(job: Mapping[str, Any], said: list[str | None]) -> None:
    """Print what a queued job waits for to stderr, once per change."""
    line = waiting_line(job)
    if line is not None and line != said[-1]:
        print(f"info: {job['name']} {line}", file=sys.stderr, flush=True)
    said.append(line)


def _wait(client: Client, args: argparse.Namespace, name: str, timeout: float | None) -> int:
    from hybridtrain.service.client import JobWaitTimeout

    said: list[str | None] = [None]
    try:
        job = client.wait(name, timeout, on_poll=lambda j: _say_waiting(j.data, said))
    except JobWaitTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return WAIT_TIMEOUT
    _out(args, job.data, _line(job.data))
    return WAIT_CODES[job.state]


@_errors_to_exit
def cmd_resubmit(args: argparse.Namespace) -> int:
    """Queue a finished job again (a training job resumes from its newest checkpoint)."""
    job = _client(args).resubmit(args.name, args.overrides)
    _out(args, job.data, f"{job.name}: {job.state} ({job.reason})")
    return 0


@_errors_to_exit
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the training service and the HPO service."""
    from hybridtrain.commands.serve import serve
    from hybridtrain.service.backend import DEFAULT_JOBS_DIR

    return serve(host=args.host, port=args.port, storage=args.storage,
                 token_file=Path(args.token_file) if args.token_file else None,
                 metrics_public=args.metrics_public,
                 jobs_dir=Path(args.jobs_dir) if args.jobs_dir else DEFAULT_JOBS_DIR,
                 ray_address=args.ray, kubernetes_namespace=args.kubernetes, image=args.image,
                 lease=args.lease, preemption=args.preemption)


@_errors_to_exit
def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the service that leads the storage (its running jobs go on)."""
    from hybridtrain.service.address import stop_leader
    from hybridtrain.service.store import JobStore

    print(stop_leader(*JobStore(args.storage).leader(), timeout=args.timeout))
    return 0


@_errors_to_exit
def cmd_users(args: argparse.Namespace) -> int:
    """Issue, revoke and list the service's users' tokens (in its storage)."""
    from hybridtrain.service.users import UserStore

    users = UserStore(args.storage)
    if args.users_command == "add":
        token = users.issue(args.name, admin=args.admin, devices=args.devices)
        quota = f"at most {args.devices} devices" if args.devices is not None else "no device quota"
        print(f"user {args.name}: {'administrator, ' if args.admin else ''}{quota}; their token (shown once, "
              f"any earlier one of theirs no longer works):\n{token}\nthey use it as $HYBRIDTRAIN_HPO_TOKEN, "
              "in a file given with --token-file, or on the page as /jobs?token=TOKEN")
    elif args.users_command == "revoke":
        users.revoke(args.name)
        print(f"user {args.name}: token revoked; their jobs stay (an administrator sees them)")
    else:
        rows = [(u.name, "admin" if u.admin else "user", "-" if u.devices is None else str(u.devices))
                for u in users.users()]
        _out(args, [{"name": n, "role": r, "devices": d} for n, r, d in rows],
             "\n".join(f"{n:<24} {r:<6} {d}" for n, r, d in [("NAME", "ROLE", "DEVICES"), *rows]))
    return 0


def _common(p: argparse.ArgumentParser, server: bool = True) -> None:
    p.add_argument("--storage", default=None, help=_STORAGE_HELP)
    p.add_argument("--token-file", default=None,
                   help="bearer token file (default: $HYBRIDTRAIN_HPO_TOKEN, else "
                        "~/.config/hybridtrain/hpo-token)")
    p.add_argument("--jobs-dir", default=None,
                   help="directory of the jobs' directories (default ./hybridtrain-jobs)")
    if server:
        p.add_argument("--server", default=None,
                       help="service address (default: $HYBRIDTRAIN_SERVER, else the one "
                            "recorded in the storage, else one started in the background)")
        p.add_argument("--json", action="store_true", help="print JSON")


def add_service_commands(sub: Any) -> None:
    """Register ``serve`` and ``jobs …`` on the top-level sub-parsers."""
    p = sub.add_parser("serve", help="run the training service and the HPO service",
                       description="Serve /v1/jobs, /v1/experiments, the jobs page (/jobs), "
                       "the HPO dashboard (/) and /metrics; run jobs on this machine's devices.")
    _common(p, server=False)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0: any free one)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the token (read-only)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="enable the Ray backend: the cluster's job-server address "
                        "(http://HEAD:8265)")
    p.add_argument("--kubernetes", default=None, metavar="NAMESPACE",
                   help="enable the Kubernetes backend (PyTorchJob) in NAMESPACE")
    p.add_argument("--image", default="hybridtrain:latest",
                   help="container image of Kubernetes jobs")
    p.add_argument("--lease", type=float, default=10.0,
                   help="seconds the scheduler's leader lease lives without renewal")
    p.add_argument("--no-preemption", dest="preemption", action="store_false",
                   help="a job of higher priority waits for devices instead of preempting "
                        "running jobs of lower priority")
    p.set_defaults(func=cmd_serve)
    more = p.add_subparsers(dest="serve_command", metavar="{stop,users}", required=False)
    q = more.add_parser("stop", help="stop the service that leads the storage (running jobs go on)",
                        description="SIGTERM to the service that leads the storage (started by serve or in "
                        "the background by a jobs command); it gives its lease up and exits. Running jobs go "
                        "on; the next service adopts them.")
    q.add_argument("--storage", default=None, help=_STORAGE_HELP)
    q.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to exit")
    q.set_defaults(func=cmd_stop)
    users = more.add_parser(
        "users", help="issue, revoke and list users' tokens",
        description="Users' tokens: each user sees and moves only their own jobs, within their device "
                    "quota. Works on the storage directly (the service may run or not).")
    actions = users.add_subparsers(dest="users_command", required=True)
    for name, text in (("add", "issue NAME a token (a new one replaces their old one)"),
                       ("revoke", "take NAME's token back"), ("list", "list the users")):
        q = actions.add_parser(name, help=text, description=text)
        q.add_argument("--storage", default=None, help=_STORAGE_HELP)
        q.set_defaults(func=cmd_users)
        if name != "list":
            q.add_argument("name")
        if name == "add":
            q.add_argument("--devices", type=int, default=None, help="device quota (default: none)")
            q.add_argument("--admin", action="store_true", help="sees and moves every job")
        if name == "list":
            q.add_argument("--json", action="store_true", help="print JSON")

    jobs = sub.add_parser("jobs", help="submit, watch and cancel training jobs",
                          description="Training jobs of the service (started in the "
                          "background when none runs).")
    cmds = jobs.add_subparsers(dest="jobs_command", metavar="JOBS_COMMAND", required=True)

    def add(name: str, func: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = cmds.add_parser(name, help=help_text,
                                                     description=help_text)
        _common(q)
        q.set_defaults(func=func)
        return q

    q = add("submit", cmd_submit, "queue a training config (jobs submit CONFIG --set k=v) or "
            "your own program (jobs submit -- PROGRAM ARGS, run without a shell)")
    q.add_argument("program", nargs="*", metavar="CONFIG | -- PROGRAM ARGS")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    q.add_argument("--command", action="store_true",
                   help="treat a single .yaml/.json argument as a program, not a config")
    q.add_argument("--shell", default=None, metavar="LINE",
                   help="run LINE through /bin/sh (only this form uses a shell)")
    q.add_argument("--devices", type=int, default=1,
                   help="devices per node: GPUs, or CPU cores without GPUs (default 1)")
    q.add_argument("--nodes", type=int, default=1, help="nodes (Ray, Kubernetes; default 1)")
    q.add_argument("--name", default=None, help="job name (default: made up)")
    q.add_argument("--priority", type=int, default=0, help="higher starts first (default 0)")
    q.add_argument("--max-restarts", type=int, default=0,
                   help="restarts after a failure, from the newest checkpoint (default 0)")
    q.add_argument("--backend", default="local", choices=("local", "ray", "kubernetes"))
    q.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable of the job (repeatable)")
    q.add_argument("--kill-grace", type=float, default=None,
                   help="seconds from SIGTERM to SIGKILL on cancel (default 120)")
    q.add_argument("--not-preemptible", dest="preemptible", action="store_false",
                   help="a job of higher priority may not preempt this one (by default it may: "
                        "SIGTERM, checkpoint, resumed when devices free up)")
    q.add_argument("--wait", action="store_true", help="wait until it ends")
    q = add("list", cmd_list, "list jobs (queued and running first)")
    q.add_argument("--state", default=None, help="only these states (comma-separated)")
    add("show", cmd_show, "one job: state, devices, attempts").add_argument("name")
    q = add("resubmit", cmd_resubmit, "queue a finished job again (a training job resumes "
            "from its newest checkpoint)")
    q.add_argument("name")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of a training job from now on, e.g. "
                        "train.steps=400 to continue it (repeatable)")
    q = add("logs", cmd_logs, "print a job's output")
    q.add_argument("name")
    q.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    q = add("cancel", cmd_cancel, "cancel a job (SIGTERM: checkpoint, then stop)")
    q.add_argument("name")
    q.add_argument("--wait", action="store_true", help="wait until it has stopped")
    q = add("wait", cmd_wait, "wait for a job; exit 0 succeeded, 1 failed, 130 cancelled")
    q.add_argument("name")
    q.add_argument("--timeout", type=float, default=None, help="give up after this many s")
