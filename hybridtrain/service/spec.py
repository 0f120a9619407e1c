"""What a job is: a validated, frozen :class:`JobSpec`, and the command it runs.

A job is either a training config (``hybridtrain train CONFIG --set …``, resumed from its
newest checkpoint on every restart) or the user's own command, given as an argument
vector and run without a shell; only ``shell=True`` (``jobs submit --shell "…"``) runs a
line through ``/bin/sh``, because then the user wrote a shell command.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridtrain.service.errors import JobSpecError

#: A job name is a path component of its directory and a label on Kubernetes and Ray:
#: letters, digits, ``-``, ``_`` and ``.``, starting with a letter or digit, no ``..``.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
BACKENDS = ("local", "ray", "kubernetes")
#: Log files are plain names inside the job's directory.
_LOG_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}\.log$"
#: Longest path and path component Linux takes (``PATH_MAX - 1``, ``NAME_MAX``): a longer
#: one fails every file call with "File name too long", so it is refused at submit.
MAX_PATH, MAX_NAME = 4095, 255
#: Environment variable names a job may set (POSIX portable names).
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class JobSpec(BaseModel):
    """A training job as submitted.

    Attributes:
        name: unique name (its directory is ``JOBS_DIR/NAME``).
        config: training config file (``hybridtrain train``); exclusive with ``command``.
        overrides: ``KEY=VALUE`` config overrides (``--set``).
        command: the user's own program as an argument vector (no shell).
        shell: run ``command[0]`` through ``/bin/sh -c`` (a shell line the user wrote).
        devices: devices per node (GPUs, or CPU cores on a machine without GPUs); 0 = none.
        nodes: nodes (one rank group per node; beyond 1 only on Ray and Kubernetes).
        priority: higher starts first; waiting raises it (see :mod:`.devices`).
        max_restarts: restarts after a failure, each from the newest checkpoint.
        preemptible: a queued job of higher priority may stop it (SIGTERM: a trainer
            saves a checkpoint) to take its devices; it resumes when devices free up.
        backend: ``local`` (this machine), ``ray`` or ``kubernetes``.
        workdir: working directory of the command.
        env: extra environment variables.
        kill_grace: seconds between SIGTERM and SIGKILL on cancel (the trainer saves a
            checkpoint in between).
        stdout_file, stderr_file: the job's output files in its directory (one by default).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    config: str | None = None
    overrides: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    shell: bool = False
    devices: int = Field(default=1, ge=0, le=4096)
    nodes: int = Field(default=1, ge=1, le=1024)
    priority: int = Field(default=0, ge=-1000, le=1000)
    max_restarts: int = Field(default=0, ge=0, le=1000)
    preemptible: bool = True
    backend: Literal["local", "ray", "kubernetes"] = "local"
    workdir: str = "."
    env: dict[str, str] = Field(default_factory=dict)
    kill_grace: float = Field(default=120.0, gt=0, le=86400)
    stdout_file: str = Field(default="output.log", pattern=_LOG_NAME)
    stderr_file: str = Field(default="output.log", pattern=_LOG_NAME)

    @field_validator("name")
    @classmethod
    def _no_dots(cls, value: str) -> str:
        if ".." in value:
            raise ValueError("must not contain '..'")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"variable name {key!r} is not allowed (letters, digits, _)")
            if "\0" in val:
                raise ValueError(f"value of {key} contains a NUL byte")
        return value

    @field_validator("workdir", "config")
    @classmethod
    def _path_fits(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if "\0" in value:
            raise ValueError("contains a NUL byte")
        if len(value) > MAX_PATH:
            raise ValueError(f"a path of {len(value)} characters; at most {MAX_PATH}")
        longest = max((len(part) for part in value.split("/")), default=0)
        if longest > MAX_NAME:
            raise ValueError(f"a path component of {longest} characters; at most {MAX_NAME}")
        return value

    @field_validator("command", "overrides")
    @classmethod
    def _no_nul(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any("\0" in part for part in value):
            raise ValueError("contains a NUL byte")
        return value

    @model_validator(mode="after")
    def _one_program(self) -> JobSpec:
        if (self.config is None) == (not self.command):
            raise ValueError("give either config (a training config) or command (your own program)")
        if self.overrides and self.config is None:
            raise ValueError("overrides (--set) apply to a training config; this job runs a command")
        if self.shell and len(self.command) != 1:
            raise ValueError("shell=true takes one shell line as the command")
        if self.nodes > 1 and self.backend == "local":
            raise ValueError(f"nodes={self.nodes} needs backend ray or kubernetes; the local "
                             "backend runs on this machine only")
        return self

    def program(self, run_dir: Path, python: str = sys.executable) -> list[str]:
        """The argument vector of one node of this job.

        A training config runs ``hybridtrain train`` with ``--resume`` (a restart continues
        from the newest checkpoint in ``run_dir``) and, for several devices, its own
        ``--nproc-per-node`` (torchrun's rendezvous, as ``hybridtrain launch``). A Python
        script on several devices or nodes runs under ``hybridtrain launch``; anything else
        as is.
        """
        per_node = max(self.devices, 1)
        if self.config is not None:
            argv = [python, "-m", "hybridtrain", "train", self.config, "--resume",
                    "--no-progress", "--output-dir", str(run_dir)]
            for item in self.overrides:
                argv += ["--set", item]
            return argv + (["--nproc-per-node", str(per_node)] if per_node > 1 else [])
        if self.shell:
            return ["/bin/sh", "-c", self.command[0]]
        if (per_node > 1 or self.nodes > 1) and self.command[0].endswith(".py"):
            return [python, "-m", "hybridtrain", "launch", "--nproc-per-node",
                    str(per_node), *self.command]
        return list(self.command)

    def display(self) -> str:
        """The job's program as one line, for listings."""
        if self.config is not None:
            return shlex.join(["train", self.config, *(f"--set={o}" for o in self.overrides)])
        return self.command[0] if self.shell else shlex.join(self.command)


def load_job_spec(data: dict[str, Any]) -> JobSpec:
    """Validate a job spec dict.

    Raises:
        JobSpecError: one line naming the first bad field, its value and what is allowed.
    """
    if not isinstance(data, dict):
        raise JobSpecError(f"a job spec is a JSON object; got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{…}"
        raise JobSpecError(f"job spec field {field} = {shown[:120]}: {err['msg']}") from None
