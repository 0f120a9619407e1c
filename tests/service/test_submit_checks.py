"""A training job's config and its ``--set`` keys are checked at submit (and at resubmit,
which may add overrides), so a typo is refused in one line before anything is queued."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.service.conftest import AUTH, api_client, tiny_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(storage: str, tmp_path: Path) -> TestClient:
    return api_client(storage, tmp_path / "jobs", slots="cpu:1")


@pytest.fixture
def config(tmp_path: Path) -> str:
    return str(tiny_config(tmp_path / "tiny.yaml", steps=2, checkpoint_every=1))


BAD = [
    (["train.stepz=10"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    (["train.steps=-5"], "train.steps"),
    (["train_batch_size=abc"], "train_batch_size"),
]


@pytest.mark.parametrize(("overrides", "words"), BAD, ids=[o[0] for o, _ in BAD])
def test_a_bad_config_key_or_value_is_refused_at_submit(client: TestClient, config: str,
                                                        overrides: list[str], words: str) -> None:
    answer = client.post("/v1/jobs", headers=AUTH, json={"config": config, "overrides": overrides})
    detail = answer.json()["detail"]
    assert answer.status_code == 422 and "\n" not in detail, detail
    assert detail.startswith(f"job spec field config = {config!r}: ") and words in detail
    assert client.get("/v1/jobs", headers=AUTH).json() == []  # nothing queued


def test_a_bad_config_file_is_refused_at_submit(client: TestClient, tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("train: {stepz: 3}\n")
    answer = client.post("/v1/jobs", headers=AUTH, json={"config": str(tmp_path / "bad.yaml")})
    assert answer.status_code == 422 and "train.stepz" in answer.json()["detail"]


def test_resubmit_takes_more_overrides_checked_like_a_submit(client: TestClient,
                                                            config: str) -> None:
    job = client.post("/v1/jobs", headers=AUTH, json={"name": "t", "config": config,
                                                      "overrides": ["train.steps=2"]})
    assert job.status_code == 201
    assert client.post("/v1/jobs/t/cancel", headers=AUTH).json()["state"] == "cancelled"
    bad = client.post("/v1/jobs/t/resubmit", headers=AUTH, json={"set": ["train.stepz=4"]})
    assert bad.status_code == 422 and "train.stepz" in bad.json()["detail"]
    assert client.get("/v1/jobs/t", headers=AUTH).json()["state"] == "cancelled"
    again = client.post("/v1/jobs/t/resubmit", headers=AUTH, json={"set": ["train.steps=4"]})
    assert again.status_code == 200 and again.json()["state"] == "queued"
    # Later overrides win: hybridtrain train applies --set in order.
    assert again.json()["spec"]["overrides"] == ["train.steps=2", "train.steps=4"]
    assert again.json()["program"].endswith("--set=train.steps=2 --set=train.steps=4")
    client.post("/v1/jobs/t/cancel", headers=AUTH)
    plain = client.post("/v1/jobs/t/resubmit", headers=AUTH)  # no body: as it was
    assert plain.status_code == 200 and plain.json()["spec"]["overrides"][-1] == "train.steps=4"


def test_resubmit_overrides_need_a_training_job(client: TestClient, tmp_path: Path) -> None:
    client.post("/v1/jobs", headers=AUTH, json={"name": "c", "command": ["true"],
                                                "workdir": str(tmp_path)})
    client.post("/v1/jobs/c/cancel", headers=AUTH)
    answer = client.post("/v1/jobs/c/resubmit", headers=AUTH, json={"set": ["train.steps=4"]})
    assert answer.status_code == 422 and "runs a command" in answer.json()["detail"]
