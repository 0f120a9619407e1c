"""The scheduler: one tick starts, watches, stops and restarts jobs.

Any number of processes may run a scheduler on one storage (``hybridtrain serve``, an
HPO controller, an embedded service); the leader lease (:meth:`JobStore.lead`) lets
exactly one act at a time. One tick of the leader:

1. every running job: send a requested cancel (SIGTERM; SIGKILL after ``kill_grace``),
   then poll it; an ended attempt is settled: succeeded, cancelled, failed with its reason
   (:mod:`.failures`), or queued again for a restart while ``max_restarts`` allows (a
   training job resumes from its newest checkpoint). Jobs started by an earlier leader
   are polled the same way: that is how a restarted service adopts them.
2. a waiting job that does not fit preempts running ones of lower priority
   (:mod:`.preemption`, unless ``preemption=False``): SIGTERM, and when they have saved
   and exited they wait as ``preempted`` and resume from that checkpoint later.
3. queued and preempted jobs start in the order of
   :func:`~hybridtrain.service.devices.plan_starts` on the free slots of this machine
   (local backend), or at once on Ray and Kubernetes, whose own schedulers queue them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hybridtrain.server.owners import new_owner_id
from hybridtrain.service.backend import Backend, Ended, job_log
from hybridtrain.service.devices import Shares, Slots, Want, plan_starts
from hybridtrain.service.errors import JobError
from hybridtrain.service.failures import describe_exit
from hybridtrain.service.preemption import Holder, choose_preemptions
from hybridtrain.service.states import WAITING
from hybridtrain.service.store import PREEMPTING, PRUNING, JobRecord, JobStore

log = logging.getLogger(__name__)

#: Exit code of a trainer (or launcher) that stopped on SIGTERM after saving a checkpoint.
STOPPED = 130


def training_finished(job: JobRecord) -> bool:
    """Whether this attempt's training ran to its last step: ``run/summary.json`` written
    since the attempt started and not marked interrupted. A SIGTERM that reaches a trainer
    after that (while it exits) makes its exit code 143, but nothing was left to train."""
    path = Path(job.job_dir) / "run" / "summary.json"
    try:
        if job.started_at is None or path.stat().st_mtime < job.started_at:
            return False
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("interrupted") is False


def want_of(job: JobRecord) -> Want:
    """A waiting job as start order and preemption see it."""
    return Want(job.name, job.spec.devices, job.priority, job.queued_at, job.submitter or "")


class Scheduler:
    """Runs the jobs of one storage while it holds the leader lease.

    Args:
        store: the job storage.
        slots: this machine's device slots.
        backends: backends by name (``local`` at least).
        url: this service's REST address, published with the lease (clients find it).
        lease: seconds the leader lease lives without renewal.
        aging_s, reserve_after_s: see :func:`~hybridtrain.service.devices.plan_starts`.
        preemption: whether waiting jobs preempt running ones of lower priority.
        on_event: called with one line per job event.
        quotas: the users' device quotas, read at each round (default: none).
    """

    def __init__(self, store: JobStore, slots: Slots, backends: Mapping[str, Backend],
                 url: str | None = None, lease: float = 10.0, aging_s: float = 300.0,
                 reserve_after_s: float = 600.0, preemption: bool = True,
                 on_event: Callable[[str], None] | None = None,
                 quotas: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.store = store
        self.slots = slots
        self.backends = dict(backends)
        self.url = url
        self.lease = lease
        self.aging_s = aging_s
        self.reserve_after_s = reserve_after_s
        self.preemption = preemption
        self.owner = new_owner_id()
        self.on_event = on_event or (lambda line: log.info("%s", line))
        self.quotas = quotas or dict
        self.leading = False
        self._lock = threading.Lock()  # one tick at a time (thread and API calls)
        self._unwatched: set[str] = set()  # jobs already reported as not watchable here
        #: Set to tick at once (a job was submitted or cancelled) instead of at the interval.
        self.wake = threading.Event()

    # -- the loop --------------------------------------------------------------------------
    def tick(self) -> bool:
        """One round (module docstring). Returns whether this scheduler leads."""
        with self._lock:
            leads = self.store.lead(self.owner, self.lease, self.url)
            if leads != self.leading:
                self.leading = leads
                self.on_event("leading the job queue" if leads else "another service leads")
            if not leads:
                return False
            for job in self.store.jobs(("running",)):
                self._watch(job)
            self._start_queued()
            return True

    def run(self, stop: threading.Event, interval: float = 0.5) -> None:
        """Tick every ``interval`` seconds until ``stop`` is set, then resign the lease.

        Running jobs are left running (the next leader adopts them)."""
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a database hiccup must not end the service
                log.exception("scheduler tick failed; retrying")
            self.wake.wait(interval)
            self.wake.clear()
        self.store.resign(self.owner)

    # -- running jobs -----------------------------------------------------------------------
    def _watch(self, job: JobRecord) -> None:
        backend = self.backends.get(job.spec.backend)
        if backend is None:
            # Started by a service that had this backend: it still runs there. Leave it to
            # a leader that can watch it rather than call it failed.
            if job.name not in self._unwatched:
                self._unwatched.add(job.name)
                self.on_event(f"job {job.name}: its backend {job.spec.backend!r} is not enabled "
                              "here; start the service with it to watch the job")
            return
        now = time.time()
        if job.cancel_requested is not None and job.stop_sent_at is None:
            backend.stop(job, force=False)
            self.store.mark_stop_sent(job)
            self.on_event(f"job {job.name}: cancel requested, SIGTERM sent")
        elif job.stop_sent_at is not None and now - job.stop_sent_at > job.spec.kill_grace:
            backend.stop(job, force=True)
        try:
            ended = backend.poll(job)
        except JobError as exc:
            log.warning("job %s: poll failed (will retry): %s", job.name, exc)
            return
        if ended is not None:
            self._settle(job, ended)

    def _settle(self, job: JobRecord, ended: Ended) -> None:
        if ended.never_started:
            self.store.end_attempt(job, "interrupted", "queued again: its service stopped "
                                   "before starting it", None, restart=True)
            self.on_event(f"job {job.name}: attempt {job.attempt} never started; queued again")
            return
        code = ended.code
        stopped = job.cancel_requested is not None or job.preempting
        if stopped and (code == 0 or training_finished(job)):
            how = ("exit 0" if code == 0
                   else f"exit {code}, after its training wrote its final summary")
            what = "cancel" if job.cancel_requested is not None else "preemption"
            self.store.end_attempt(job, "succeeded", f"{how} (it finished before the {what} "
                                   "reached it)", code)
            self.on_event(f"job {job.name} succeeded before its {what} took effect")
            return
        if stopped:
            saved = ("it saved a checkpoint and stopped" if job.spec.config is not None
                     else "it stopped on SIGTERM")
            how = (f"{saved} (exit 130)" if code == STOPPED else
                   f"exit {code}" if code is not None else "exit unknown")
            forced = (" after kill_grace (SIGKILL)" if job.stop_sent_at is not None
                      and time.time() - job.stop_sent_at > job.spec.kill_grace else "")
            if ended.reason:
                how += f"; {ended.reason}"
            if job.cancel_requested is not None and job.reason.startswith(PRUNING):
                self.store.end_attempt(job, "pruned", f"pruned by its HPO pruner: {how}{forced}",
                                       code)
                self.on_event(f"job {job.name} pruned ({how})")
                return
            if job.cancel_requested is not None:
                self.store.end_attempt(job, "cancelled", f"cancelled on request: {how}{forced}",
                                       code)
                self.on_event(f"job {job.name} cancelled ({how})")
                return
            by = job.reason.removeprefix(PREEMPTING).strip()
            line = f"{by}: {how}{forced}; it resumes when devices free up"
            self.store.end_attempt(job, "preempted", line, code, restart=True, waiting="preempted")
            self.on_event(f"job {job.name} preempted ({how})")
            return
        if code == 0:
            self.store.end_attempt(job, "succeeded", "exit 0", 0)
            self.on_event(f"job {job.name} succeeded")
            return
        reason, restartable = describe_exit(code, job_log(job))
        if ended.reason:
            reason = f"{reason}; {ended.reason}"
        if restartable and job.restarts < job.spec.max_restarts:
            resumes = " (it resumes from its newest checkpoint)" if job.spec.config else ""
            line = f"restart {job.restarts + 1}/{job.spec.max_restarts}{resumes} after: {reason}"
            self.store.end_attempt(job, "failed", line, code, restart=True)
            self.on_event(f"job {job.name}: {line}")
            return
        self.store.end_attempt(job, "failed", reason, code)
        self.on_event(f"job {job.name} failed: {reason}")

    # -- queued jobs -------------------------------------------------------------------------
    def _start_queued(self) -> None:
        queued = self.store.jobs(WAITING)
        if not queued:
            return
        local = [j for j in queued if self.backends.get(j.spec.backend, None) is not None
                 and self.backends[j.spec.backend].uses_local_slots]
        running = self.store.jobs(("running",))
        busy = {d for j in running for d in j.devices}
        free = [s for s in self.slots.ids if s not in busy]
        wants = [want_of(j) for j in local]
        by_name = {j.name: j for j in queued}
        shares = self.shares(running)
        if self.preemption:
            victims = self._preempt(wants, running, len(free), shares)
            stopping = [j.priority for j in running if j.preempting] + victims
            if stopping:
                # Slots that preemption frees are for the jobs that preempted: a job of no
                # higher priority than one being preempted would take them back (and be
                # preempted in turn, over and over, while the others stop).
                wants = [w for w in wants if w.priority > max(stopping)]
        for name, devices in plan_starts(wants, free, time.time(), self.aging_s,
                                         self.reserve_after_s, shares):
            self._start(by_name[name], devices)
        local_names = {j.name for j in local}
        for job in queued:
            # A job for a backend this service lacks waits for a service that has it.
            if job.name not in local_names and job.spec.backend in self.backends:
                self._start(job, ())

    def shares(self, running: list[JobRecord]) -> Shares:
        """Devices of this machine each user's running jobs hold, and the quotas."""
        held: dict[str, int] = {}
        for job in running:
            user = job.submitter or ""  # as want_of names it
            held[user] = held.get(user, 0) + len(job.devices)
        return Shares(held, self.quotas())

    def _preempt(self, wants: list[Want], running: list[JobRecord], free: int,
                 shares: Shares) -> list[int]:
        """Send SIGTERM to the running jobs :func:`choose_preemptions` picks; they are
        settled as ``preempted`` when they exit (:meth:`_settle`). Returns their priorities."""
        holders = [Holder(j.name, len(j.devices), j.priority, j.spec.preemptible,
                          j.started_at or 0.0, j.stop_sent_at is not None)
                   for j in running if j.devices]
        by_name = {j.name: j for j in running}
        priority = {w.name: w.priority for w in wants}
        marked: list[int] = []
        for name, waiting in choose_preemptions(wants, holders, free, time.time(), self.aging_s,
                                                shares):
            job = by_name[name]
            why = f"preempted for {waiting} (priority {priority[waiting]} > {job.priority})"
            if self.store.mark_preempting(job, why):
                self.backends[job.spec.backend].stop(job, force=False)
                self.on_event(f"job {job.name}: {why}, SIGTERM sent")
                marked.append(job.priority)
        return marked

    def _start(self, job: JobRecord, devices: tuple[int, ...]) -> None:
        backend = self.backends[job.spec.backend]
        if not self.store.mark_running(job, self.owner, devices):
            return  # cancelled or taken meanwhile
        job = self.store.get(job.id)
        run_dir = Path(job.job_dir) / "run"
        env = job.spec.env | {"HYBRIDTRAIN_JOB_NAME": job.name,
                              "HYBRIDTRAIN_JOB_DIR": job.job_dir,
                              "HYBRIDTRAIN_JOB_ATTEMPT": str(job.attempt),
                              "HYBRIDTRAIN_JOB_RESTARTS": str(job.restarts),
                              "PYTHONUNBUFFERED": "1"}
        try:
            started = backend.start(job, job.spec.program(run_dir), env, devices)
        except (OSError, JobError) as exc:
            self.store.end_attempt(job, "failed", f"cannot start: {exc}", None)
            self.on_event(f"job {job.name} failed to start: {exc}")
            return
        self.store.set_process(job, started.pgid, started.start_ticks, started.ref)
        where = f"devices {list(devices)}" if devices else backend.name
        self.on_event(f"job {job.name} started (attempt {job.attempt}, {where})")
