"""``from hybridtrain.service import Client``: submit, wait, read logs, list, cancel and
resubmit from Python, with typed job records, against a real ``hybridtrain serve``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridtrain.service import Attempt, Client, Job
from hybridtrain.service.client import spec_dict
from hybridtrain.service.errors import JobError, JobSpecError
from tests.service.conftest import TOKEN, tiny_config

pytestmark = pytest.mark.timeout(120)


def test_the_client_submits_waits_and_reads_logs(served: dict[str, str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    monkeypatch.delenv("HYBRIDTRAIN_SERVER", raising=False)
    # No address given: the service that leads the storage is found through it.
    client = Client(storage=f"sqlite:///{tmp_path / 's.db'}")
    assert client.transport.base == served["base"]
    job = client.submit([sys.executable, "-S", "-c", "print('hello from a job')"], name="hi")
    assert isinstance(job, Job) and job.name == "hi" and job.state in ("queued", "running")
    done = client.wait("hi", timeout=60)
    assert done.state == "succeeded" and done.finished and done.exit_code == 0
    assert [type(a) for a in done.attempts] == [Attempt] and done.attempts[0].outcome == "succeeded"
    assert "hello from a job" in "".join(client.logs("hi"))
    assert "hello from a job" in "".join(client.logs("hi", follow=True))  # ends with the job
    assert [j.name for j in client.list()] == ["hi"] and client.list("queued") == []
    assert client.get("hi").attempts == done.attempts

    again = client.resubmit("hi")
    assert again.state == "queued" and again.reason == "resubmitted"
    assert client.cancel("hi").state in ("cancelled", "running")
    assert client.wait("hi", timeout=60).state in ("cancelled", "succeeded")


def test_the_client_refuses_bad_jobs_in_one_line(served: dict[str, str], tmp_path: Path) -> None:
    client = Client(served["base"], TOKEN)
    config = tiny_config(tmp_path / "tiny.yaml", steps=2, checkpoint_every=1)
    with pytest.raises(JobError, match=r"unknown config key 'train\.stepz'"):
        client.submit(str(config), set=["train.stepz=3"])
    with pytest.raises(JobSpecError, match="no training config"):
        client.submit("echo hi")
    with pytest.raises(JobSpecError, match="applies to a training config"):
        client.submit(["true"], set=["train.steps=3"])
    with pytest.raises(JobError, match="not found"):
        client.get("nope")
    with pytest.raises(JobError, match="invalid bearer token"):
        Client(served["base"], "x" * 32).list()
    assert client.list() == []


def test_a_job_is_preemptible_unless_submitted_otherwise(tmp_path: Path) -> None:
    assert "preemptible" not in spec_dict(["true"], workdir=tmp_path)
    assert spec_dict(["true"], workdir=tmp_path, preemptible=False)["preemptible"] is False
