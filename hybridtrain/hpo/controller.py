"""The controller: runs an experiment's trials, at most ``parallel_trials`` at a time.

Any number of controllers (``hpo run`` or ``hpo worker``, on one or many machines) may
work on the same experiment through the same storage; slots and leases
(:mod:`hybridtrain.hpo.records`, :mod:`hybridtrain.hpo.leases`) make them share the
work without running a slot twice. One loop iteration:

1. settle slots whose lease expired (their controller died): stop the leftover
   processes if they are on this machine, record the trial as interrupted and run its
   parameters again (the controller's death is not the trial's failure, so no retry is
   used up); a trial that had in fact finished is kept as it is;
2. poll the running trials (metrics, pruning, timeout, exit) and record the finished;
3. claim pending slots and start trials while there is room;
4. leave once the experiment is over, or it is stopping and nothing of ours runs;
5. sleep until a trial exits, a stop signal arrives, or ``poll_interval`` passed.

Per trial the service adds to Optuna's own ask and tell a claim (one read, one write),
two writes attaching the trial and then its process to the slot (the first also records
where and how it runs) and a release, and it reads the experiment's state at most once
per ``poll_interval``, besides the
metrics the trial reports (intermediate values, and a ``metrics`` user attribute for
metrics other than the objective);
``benchmarks/hpo_overhead.py`` measures it against a bare ask/tell loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from hybridtrain.hpo.algorithms import build_pruner, build_sampler, distributions
from hybridtrain.hpo.errors import HPOError
from hybridtrain.hpo.leases import Claim, Heartbeat, Leases
from hybridtrain.hpo.process import wait_for_exit
from hybridtrain.hpo.records import ExperimentRecord, Records, TrialRun
from hybridtrain.hpo.spec import ExperimentSpec
from hybridtrain.hpo.storage import open_optuna_storage, resolve_url
from hybridtrain.hpo.trial import Outcome, RunningTrial
from hybridtrain.hpo.trial_jobs import JobProcess, TrialJobs
from hybridtrain.server.owners import new_owner_id
from hybridtrain.server.process_groups import stop_orphan_group
from hybridtrain.server.storage import open_engine

log = logging.getLogger(__name__)

_LEASE_EXPIRED = "lease expired: its controller stopped renewing it (crashed or killed)"
_STATES = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED,
           "failed": TrialState.FAIL, "interrupted": TrialState.FAIL}


class Controller:
    """Runs one experiment from this process.

    Args:
        spec: the validated spec.
        storage: storage URL (default: ``$HYBRIDTRAIN_HPO_STORAGE`` or ``sqlite:///hpo.db``).
        on_event: called with one line for each trial started or finished.

    Raises:
        StorageError: the storage cannot be opened.
        SpecError: the experiment exists in the storage with a different search spec.
        HPOError: ``trial.workdir`` does not exist.
    """

    def __init__(self, spec: ExperimentSpec, storage: str | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        if not Path(spec.trial.workdir).is_dir():
            raise HPOError(f"trial.workdir {spec.trial.workdir!r} is not a directory; create "
                           "it or fix the spec")
        self.spec = spec
        self.url = resolve_url(storage)
        self.on_event = on_event or (lambda line: log.info("%s", line))
        self.records = Records(open_engine(self.url))
        self.storage = open_optuna_storage(self.url)
        self.record = self.records.ensure_experiment(spec)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(
            storage=self.storage, study_name=spec.name,
            sampler=build_sampler(spec, self.records.join(spec.name)),
            pruner=build_pruner(spec), direction=spec.objective.direction,
            load_if_exists=True)
        self.study_id = self.storage.get_study_id_from_name(spec.name)
        self.owner = new_owner_id()
        self.leases = Leases(self.records.engine, spec.name, self.owner,
                             spec.durability.lease_duration)
        self.heartbeat = Heartbeat(self.leases, spec.durability.heartbeat_interval)
        # Trials run as training-service jobs: one queue, one allocator, one runner.
        self.trial_jobs = TrialJobs(self.url, spec.durability.lease_duration)
        self.running: dict[int, RunningTrial] = {}
        self._attached: dict[int, int | None] = {}  # slot: process group recorded for it
        self._free_gpus = list(spec.resources.gpus)
        self._distributions = distributions(spec)
        self._interrupted = threading.Event()
        # Written by the stop-signal handler to end the loop's wait at once.
        self._wake: tuple[int, int] | None = None
        # A lease expires lease_duration after its last renewal, so looking for abandoned
        # slots once per heartbeat delays a takeover by at most that, and saves a query
        # per poll (poll_interval is much shorter).
        self._settle_every = spec.durability.heartbeat_interval
        self._next_settle = 0.0

    # -- main loop ---------------------------------------------------------------------
    def run(self, stop_signals: tuple[signal.Signals, ...] = (signal.SIGINT,)
            ) -> ExperimentRecord:
        """Work on the experiment until it is over (or stopped) for this controller.

        Ctrl-C stops this controller's trials, returns their slots to ``pending`` with
        the same parameters, and raises :class:`KeyboardInterrupt`.

        Args:
            stop_signals: signals that mean Ctrl-C (the CLI adds SIGTERM). Caught only
                when ``run`` is called in the main thread; a signal then sets a flag the
                loop checks between database operations, because a KeyboardInterrupt
                raised inside a commit leaves the connection broken and the stop unclean.

        Returns:
            The experiment record at the end.

        Raises:
            KeyboardInterrupt: after a clean stop on Ctrl-C (or ``stop_signals``).
        """
        self.heartbeat.start()
        previous = {}
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in stop_signals}
        try:
            try:
                record = self._loop()
            except KeyboardInterrupt:
                record = None  # raised directly (signals not caught here): same clean stop
            if record is not None:
                return record
            self._stop_all("interrupted (Ctrl-C); rerun to resume", "pending")
            if not self.records.running_slots(self.spec.name):
                self.records.set_state(self.spec.name, "interrupted", "Ctrl-C",
                                       only_from=("running",))
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise
        except BaseException:
            # The database was gone past its timeout, or a bug: nothing can be recorded,
            # but the trials must not run on unsupervised. Their slots keep the leases
            # until expiry; then the next controller settles and retries them.
            for rt in self.running.values():
                rt.process.stop(self.spec.trial.kill_grace)
            raise
        finally:
            for sig, handler in previous.items():
                if handler is not None:  # None: installed outside Python, cannot restore
                    signal.signal(sig, handler)
            self.heartbeat.stop()
            self.trial_jobs.close()
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def _on_stop_signal(self, _signum: int, _frame: FrameType | None) -> None:
        # A second Ctrl-C changes nothing: the stop in progress takes at most kill_grace.
        self._interrupted.set()
        if self._wake is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake[1], b"!")

    def _loop(self) -> ExperimentRecord | None:
        """The loop of the module docstring; ``None`` once a stop signal arrived."""
        next_read = 0.0
        while not self._interrupted.is_set():
            # At most once per poll: the loop wakes at every trial's exit, and a stop
            # request need not be seen sooner than a poll would see it.
            if time.monotonic() >= next_read:
                record = self.records.get(self.spec.name)
                next_read = time.monotonic() + self.spec.durability.poll_interval
            if record.state != "running" and self.running:
                # Stopped: the slots wait for a resume. Over: they will never run.
                after = "pending" if record.state == "stopping" else "cancelled"
                self._stop_all(f"experiment {record.state}: {record.reason}", after)
            if time.monotonic() >= self._next_settle:
                self._settle_abandoned()
                self._next_settle = time.monotonic() + self._settle_every
            self._poll_running()
            if record.state == "running":
                self._start_trials()
            if not self.running:
                self.records.settle(self.spec.name)
                record = self.records.get(self.spec.name)
                if record.state != "running":
                    return record
            if not self._interrupted.is_set():
                wait_for_exit((rt.process for rt in self.running.values()),
                              self.spec.durability.poll_interval,
                              self._wake[0] if self._wake else None)
        return None

    def _settle_abandoned(self) -> None:
        while (claim := self.leases.claim(allow_pending=False)) is not None:
            self._settle(claim)

    def _start_trials(self) -> None:
        # The experiment was running when this loop iteration read it. A stop requested
        # since starts at most this round's trials, which the next iteration stops; a
        # goal reached or a failure limit hit here has cancelled the pending slots.
        while (len(self.running) < self.spec.parallel_trials and self._gpus_free()
               and not self._interrupted.is_set()):
            claim = self.leases.claim(allow_pending=True)
            if claim is None:
                return
            if claim.taken_over:
                self._settle(claim)
                continue
            self._start(claim)

    def _poll_running(self) -> None:
        for slot in self.heartbeat.take_lost():
            if slot not in self.running or self.leases.holds(slot):
                continue  # released, or released and claimed again during a renewal
            rt = self.running.pop(slot)
            self.heartbeat.untrack(slot)
            # Another controller took the slot over (we missed our heartbeats): it
            # settles the trial; we only make sure our copy stops.
            rt.stop("lease lost")
            self._release_gpus(rt)
            self.on_event(f"trial {rt.number}: lease lost, stopped")
        for rt in list(self.running.values()):
            outcome = rt.poll()
            if outcome is not None:
                self._finish(rt, outcome)
            elif rt.process.pid is not None and rt.process.pid != self._attached.get(rt.slot):
                # A trial job queued at its start runs now: record its process group.
                self._attached[rt.slot] = rt.process.pid
                self.leases.attach(rt.slot, rt.number, rt.params, rt.process.pid,
                                   rt.process.start_ticks)

    def _stop_all(self, reason: str, slot_state: str) -> None:
        # SIGTERM every trial first, so their grace periods run together, not one by one.
        for rt in self.running.values():
            rt.process.terminate()
        for rt in list(self.running.values()):
            self._finish(rt, rt.stop(reason), slot_state)

    # -- one trial -----------------------------------------------------------------------
    def _start(self, claim: Claim) -> None:
        # Renew from the start: sampling (GP, CMA-ES) may take a while.
        self.heartbeat.track(claim.slot)
        dists = self._distributions
        if claim.params is None:
            trial = self.study.ask(fixed_distributions=dists)
        else:
            # A rerun keeps the parameters: write them into a fresh trial before the
            # Trial object reads it, so suggest_* returns them instead of sampling.
            trial_id = self.storage.create_new_trial(self.study_id)
            for name, value in claim.params.items():
                self.storage.set_trial_param(trial_id, name, dists[name].to_internal_repr(value),
                                             dists[name])
            trial = optuna.Trial(self.study, trial_id)
        gpus = self._take_gpus()
        rt = RunningTrial(self.spec, trial, claim.slot, claim.attempt, gpus,
                          runner=lambda *args: JobProcess(
                              self.trial_jobs, self.spec.name, trial.number, len(gpus),
                              self.spec.trial.kill_grace, *args))
        # Record the trial in its slot before its process starts, so whoever takes the
        # slot over after a crash from here on finds the trial and settles it.
        run = TrialRun(claim.slot, claim.attempt, socket.gethostname(), rt.command,
                       str(rt.dir))
        if not self.leases.attach(claim.slot, trial.number, rt.params, run=run):
            self._release_gpus(rt)
            self.heartbeat.untrack(claim.slot)
            self._tell(trial, Outcome("failed", reason="lease lost before start"))
            return
        try:
            rt.start()
        except OSError as exc:
            self._release_gpus(rt)
            self.heartbeat.untrack(claim.slot)
            self._record_failure(trial, claim, rt.params, f"cannot start command: {exc}")
            return
        self.running[claim.slot] = rt
        # The process group next: a controller killed from here on leaves it to the
        # takeover to stop.
        self.leases.attach(claim.slot, trial.number, rt.params, rt.process.pid,
                           rt.process.start_ticks)
        self._attached[claim.slot] = rt.process.pid
        self.on_event(f"trial {trial.number} started (slot {claim.slot}, attempt "
                      f"{claim.attempt}): {rt.params}")

    def _finish(self, rt: RunningTrial, outcome: Outcome, stopped_slot: str = "pending") -> None:
        self.running.pop(rt.slot, None)
        self._release_gpus(rt)
        self.heartbeat.untrack(rt.slot)
        claim = Claim(rt.slot, rt.attempt, rt.params)
        if outcome.state in ("complete", "pruned"):
            if self._tell(rt.trial, outcome) and self.leases.release(rt.slot, "done",
                                                                      rt.attempt, None):
                self._check_goal(rt.number, outcome)
            self.on_event(f"trial {rt.number} {outcome.state}: value={outcome.value}")
        elif outcome.state == "interrupted":
            if self._tell(rt.trial, outcome):
                self.leases.release(rt.slot, stopped_slot, rt.attempt, rt.params)
            self.on_event(f"trial {rt.number} interrupted: {outcome.reason}")
        else:
            self._record_failure(rt.trial, claim, rt.params, outcome.reason)

    def _record_failure(self, trial: optuna.Trial, claim: Claim, params: dict[str, Any],
                        reason: str) -> None:
        if not self._tell(trial, Outcome("failed", reason=reason)):
            return
        self._after_failure(claim, params, reason)
        self.on_event(f"trial {trial.number} failed: {reason}")

    def _after_failure(self, claim: Claim, params: dict[str, Any] | None, reason: str) -> None:
        """Release a slot whose trial failed: retry it, or count a failed trial."""
        if params is not None and claim.attempt < self.spec.trial.retries:
            self.leases.release(claim.slot, "pending", claim.attempt + 1, params)
            return
        # Release first, count second: a crash in between loses a count, never a trial.
        if self.leases.release(claim.slot, "pending", 0, None):
            self.records.add_failure(self.spec.name, self.spec.max_failed_trials, reason)

    def _tell(self, trial: optuna.Trial | int, outcome: Outcome) -> bool:
        """Record the outcome of a trial (object, or number of an abandoned one).

        Returns:
            ``False`` if the trial was already finished (by another controller).
        """
        attrs: dict[str, Any] = {"fail_reason": outcome.reason} if outcome.reason else {}
        if outcome.state == "interrupted":
            # Optuna has no such state; status and trial listings tell it from failures.
            attrs["interrupted"] = True
        try:
            for key, value in attrs.items():  # failures only: not on every trial's path
                if isinstance(trial, int):
                    self.storage.set_trial_user_attr(self._trial_id(trial), key, value)
                else:
                    trial.set_user_attr(key, value)
            # Optuna takes a pruned trial's value from its last intermediate report.
            value = outcome.value if outcome.state == "complete" else None
            self.study.tell(trial, value, state=_STATES[outcome.state])
        except UpdateFinishedTrialError:
            return False
        return True

    def _trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def _check_goal(self, number: int, outcome: Outcome) -> None:
        goal = self.spec.objective.goal
        if goal is None or outcome.state != "complete" or outcome.value is None:
            return
        reached = (outcome.value <= goal if self.spec.objective.direction == "minimize"
                   else outcome.value >= goal)
        if reached:
            self.records.finish(self.spec.name, "succeeded",
                                f"goal {goal} reached by trial {number} ({outcome.value})")

    # -- takeover of abandoned slots --------------------------------------------------------
    def _settle(self, claim: Claim) -> None:
        """Settle a slot taken over from a dead controller (see module docstring).

        The controller's death is not the trial's failure: the trial is recorded as
        interrupted and its slot runs the same parameters again, without using up a
        retry or counting against ``max_failed_trials``. Only a trial that had already
        failed by itself before its controller died counts as a failure.
        """
        if claim.abandoned_trial is None:
            # The dead controller claimed the slot but never attached a trial to it; it
            # may have died between creating the Optuna trial and attaching it.
            self._end_unattached_trials()
            self.leases.release(claim.slot, "pending", claim.attempt, claim.params)
            return
        if claim.host == socket.gethostname() and claim.pgid is not None:
            stop_orphan_group(claim.pgid, claim.start_ticks, self.spec.trial.kill_grace)
        number = claim.abandoned_trial
        self.trial_jobs.cancel_trial(self.spec.name, number)  # still queued, or elsewhere
        told = self._tell(number, Outcome("interrupted", reason=_LEASE_EXPIRED))
        frozen = self.storage.get_trial(self._trial_id(number))
        if frozen.state in (TrialState.COMPLETE, TrialState.PRUNED):
            # It finished just before its controller died: keep it, count it once.
            self.leases.release(claim.slot, "done", claim.attempt, None)
            return
        params = dict(frozen.params) or None
        if told or frozen.user_attrs.get("interrupted"):
            self.leases.release(claim.slot, "pending", claim.attempt, params)
            self.on_event(f"trial {number} interrupted: {_LEASE_EXPIRED}")
            return
        # Its controller had recorded a failure of its own and died before releasing.
        reason = str(frozen.user_attrs.get("fail_reason") or "failed")
        self._after_failure(claim, params, reason)
        self.on_event(f"trial {number} failed: {reason}")

    def _end_unattached_trials(self) -> None:
        """End Optuna trials left ``RUNNING`` outside any slot by a dead controller.

        They are recorded as interrupted, not failed: the trial never ran.

        A live controller attaches its new trial to its slot right after creating it, so
        a running trial in no running slot and older than a lease is abandoned.
        """
        attached = {r.trial_number for r in self.records.running_slots(self.spec.name)}
        cutoff = datetime.now() - timedelta(seconds=self.spec.durability.lease_duration)
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.number not in attached and t.datetime_start and t.datetime_start < cutoff:
                self._tell(t.number, Outcome("interrupted", reason="abandoned: its "
                                             "controller died before the trial started"))

    # -- GPU pool --------------------------------------------------------------------------
    def _gpus_free(self) -> bool:
        res = self.spec.resources
        return not res.gpus or len(self._free_gpus) >= res.gpus_per_trial

    def _take_gpus(self) -> tuple[int, ...]:
        n = self.spec.resources.gpus_per_trial if self.spec.resources.gpus else 0
        taken, self._free_gpus = self._free_gpus[:n], self._free_gpus[n:]
        return tuple(taken)

    def _release_gpus(self, rt: RunningTrial) -> None:
        self._free_gpus.extend(rt.gpus)
