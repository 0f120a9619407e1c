"""One line for every input error, naming the field or file and what is allowed, before
any work starts (issue #25's probe: one parametrized test per class of hostile input)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridtrain.checkpoint.layout import MARKER
from hybridtrain.cli import main
from hybridtrain.config import load_config
from hybridtrain.trainer import run_training
from tests.tiny_run import tiny_config

TINY = ["--set", "device=cpu", "--set", "data.seq_len=16", "--set", "train_batch_size=2", "--set",
        "model.overrides.n_layer=1", "--set", "model.overrides.d_model=32", "--set", "model.overrides.n_head=2",
        "--steps", "1", "--no-progress", "--set", "train.eval_batches=1"]


def _one_error_line(capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for words in expected:
        assert words in err[0], err[0]
    return err[0]


@pytest.mark.parametrize(("key", "value", "words"), [
    ("n_head", "0", "model.overrides.n_head = 0: must be an integer ≥ 1"),
    ("n_head", "-4", "model.overrides.n_head = -4: must be an integer ≥ 1"),
    ("d_model", "0", "model.overrides.d_model = 0"),
    ("d_model", "-64", "model.overrides.d_model = -64"),
    ("n_layer", "1.5", "model.overrides.n_layer = 1.5: must be an integer ≥ 1"),
    ("n_layer", "two", "model.overrides.n_layer = 'two'"),
    ("n_layer", "null", "model.overrides.n_layer = None"),
    ("n_layer", "[1,2]", "model.overrides.n_layer = [1, 2]"),
    ("n_layer", "0", "model.overrides.n_layer = 0"),
    ("n_layer", "-1", "model.overrides.n_layer = -1"),
    ("dropout", ".nan", "model.overrides.dropout = nan: must be a number in [0, 1)"),
    ("tie_embeddings", "maybe", "model.overrides.tie_embeddings = 'maybe': must be true or false"),
    ("seq_len", "8", "model.overrides.seq_len = 8 is shorter than data.seq_len = 16: the data fixes the window"),
    ("vocab_size", "3", "data tokens go up to"),
    ("n_embd", "3", "model.overrides ['n_embd'] are not GPT fields"),
], ids=lambda v: str(v)[:20])
def test_every_model_override_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str,
                                         words: str) -> None:
    assert main(["train", *TINY, "--output-dir", str(tmp_path / "run"), "--set",
                 f"model.overrides.{key}={value}"]) == 2
    _one_error_line(capsys, words)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_overrides_the_data_would_fix_anyway_still_train(tmp_path: Path) -> None:
    cfg = load_config({"device": "cpu", "data": {"seq_len": 16}, "train_batch_size": 2,
                       "model": {"overrides": {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32,
                                               "vocab_size": 300}},
                       "train": {"steps": 1, "output_dir": str(tmp_path), "eval_batches": 1}})
    assert run_training(cfg, progress=False).steps == 1


DEEP = "[" * 100_000 + "]" * 100_000
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]",
                  *(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8))])


@pytest.mark.parametrize(("name", "text", "argv", "words"), [
    ("deep.json", '{"train": {"steps": ' + DEEP + "}}", ["train"], "nested more than 100 levels deep"),
    ("deep.yaml", "train:\n  steps: " + DEEP, ["train"], "nested more than 100 levels deep"),
    ("bomb.yaml", "monitor_config:\n  " + BOMB.replace("\n", "\n  "), ["train"],
     "stands for more than 1,000,000 values"),
    ("spec.yaml", "name: x\nextra: " + DEEP, ["hpo", "run"], "nested more than 100 levels deep"),
    ("bomb-spec.yaml", "name: x\n" + BOMB, ["hpo", "run"], "stands for more than 1,000,000 values"),
], ids=["json-depth", "yaml-depth", "yaml-aliases", "spec-depth", "spec-aliases"])
def test_documents_too_deep_or_too_large_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                                      text: str, argv: list[str], words: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    extra = ["--output-dir", str(tmp_path / "run")] if argv == ["train"] else [
        "--storage", f"sqlite:///{tmp_path / 'hpo.db'}"]
    assert main([*argv, str(path), *extra]) == 2
    _one_error_line(capsys, words)


def test_a_set_value_too_deep_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--output-dir", str(tmp_path), "--set", f"monitor_config.x={DEEP}"]) == 2
    _one_error_line(capsys, "a --set value is nested more than 100 levels deep")


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("meta") / "run"
    run_training(tiny_config(out), progress=False)
    return out


@pytest.mark.parametrize("meta", [[1, 2], "a string", {"format": 2}, {"format": 1, "files": {"../x": 3}},
                                  {"format": True}, None],
                         ids=["list", "string", "format-2-empty", "bogus-format-1", "format-true", "null"])
@pytest.mark.parametrize("command", ["resume", "export", "fresh"])
def test_a_meta_json_of_any_shape_is_one_line(checkpointed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              meta: Any, command: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    step = run / "checkpoints" / "step-0000001"
    text = json.dumps(meta)
    (step / "meta.json").write_text(text)
    # With its commit marker rewritten to match, as whoever crafted it would.
    (step / MARKER).write_text(json.dumps({"meta_sha256": hashlib.sha256(text.encode()).hexdigest()}))
    argv = {"resume": ["train", *TINY, "--output-dir", str(run), "--resume"],
            "export": ["checkpoint", "export", str(step), str(tmp_path / "out")],
            "fresh": ["train", *TINY, "--output-dir", str(run)]}[command]
    assert main(argv) == 2
    words = "none of them complete" if command == "fresh" else "is not a hybridtrain checkpoint (meta.json: "
    _one_error_line(capsys, words)
    # --overwrite is the way out, and it works.
    assert main(["train", *TINY, "--output-dir", str(run), "--overwrite"]) == 0


def _random(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"tokens": [1, 2, 3]}))


def _truncated(path: Path) -> None:
    torch.save(torch.arange(3000) % 200, path)
    path.write_bytes(path.read_bytes()[:1500])


def _sparse(path: Path) -> None:
    torch.save((torch.arange(3000) % 200).to_sparse(), path)


DATA: list[tuple[str, Callable[[Path], Any], str]] = [
    ("rand.pt", _random, "is not a readable torch.save file of a token tensor"),
    ("pickle.pt", _pickle, "is a pickle of something other than tensors"),
    ("truncated.pt", _truncated, "is not a readable torch.save file of a token tensor"),
    ("sparse.pt", _sparse, "holds a torch.sparse_coo tensor; it must hold a dense 1-D tensor"),
    ("empty.txt", lambda p: p.write_text(""), "is empty; give a text file"),
    ("short.txt", lambda p: p.write_text("abc"), "the training data has 2 tokens, fewer than data.seq_len + 1"),
    ("fifo.txt", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    ("dir.txt", lambda p: p.mkdir(), "is a directory"),
    ("loop.txt", lambda p: p.symlink_to(p), "is a symbolic link loop"),
    ("missing.txt", lambda p: None, "does not exist"),
    ("odd.bin", lambda p: p.write_bytes(b"abc"), "is not a whole number of torch.uint16 tokens"),
]


@pytest.mark.parametrize(("name", "make", "words"), DATA, ids=[d[0] for d in DATA])
def test_every_data_file_error_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                              make: Callable[[Path], Any], words: str) -> None:
    path = tmp_path / name
    make(path)
    assert main(["train", *TINY, "--output-dir", str(tmp_path / "run"), "--data", str(path)]) == 2
    _one_error_line(capsys, f"data.path = {str(path)!r}", words)


@pytest.mark.parametrize(("argv", "words"), [
    (["train", "--nproc-per-node", "0"], "--nproc-per-node 0: give a number of processes >= 1"),
    (["train", "--nproc-per-node", "-3"], "--nproc-per-node -3: give a number of processes >= 1"),
    (["train", "--set", "seed=99999999999999999999999"], "seed"),
    (["train", "--set", "seed=-1"], "seed"),
    (["train", "--set", 'train.output_dir="runs/a\\0b"'], "train.output_dir"),
    (["train", "--set", 'data.path="a\\0b"'], "data.path"),
    (["hpo", "serve", "--port", "99999"], "--port 99999 is not a TCP port: give 0..65535"),
], ids=["nproc-0", "nproc-neg", "seed-huge", "seed-neg", "nul-output-dir", "nul-data-path", "port"])
def test_every_bad_command_line_value_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                  words: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    _one_error_line(capsys, words)
    assert list(tmp_path.iterdir()) == []  # nothing written
