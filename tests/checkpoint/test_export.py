"""``hybridtrain checkpoint export``: one consolidated model from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hybridtrain as ht
from hybridtrain.commands.cli import main
from hybridtrain.config import Config
from tests.equivalence import gpt_case


def test_export_writes_one_safetensors_file_of_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    case = gpt_case()
    engine = ht.initialize(case.build(), {"device": "cpu"}, loss_fn=case.loss_fn)
    engine.train_batch(case.batches(1)[0])
    engine.save_checkpoint(tmp_path / "ck")
    assert main(["checkpoint", "export", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    expected = engine.model_state_dict()
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], v) for k, v in expected.items())

    assert main(["checkpoint", "export", str(tmp_path / "missing"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: checkpoint {tmp_path / 'missing'} does not exist"]


def test_export_of_a_hugging_face_run_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from hybridtrain.models.factory import build_model

    cfg = Config.model_validate({"device": "cpu", "model": {"name": "hf:gpt2", "overrides": {
        "n_layer": 2, "n_embd": 32, "n_head": 2}}, "data": {"seq_len": 16}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(cfg.model_dump_json())
    model = build_model(cfg.model.name, cfg.model.overrides, 80, cfg.data.seq_len, 0)
    engine = ht.initialize(model, {"device": "cpu"})
    ids = torch.randint(0, 80, (2, 16))
    engine.train_batch({"input_ids": ids, "labels": ids})
    engine.save_checkpoint(run / "checkpoints" / "step-0000001")
    assert main(["checkpoint", "export", str(run / "checkpoints" / "step-0000001"), str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 80
    mine = engine.model_state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, mine[name], rtol=0, atol=0)
