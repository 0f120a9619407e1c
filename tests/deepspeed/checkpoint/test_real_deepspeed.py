"""Checkpoints cross between the real DeepSpeed (0.19.8, CPU) and hybridtrain's drop-in, both
ways, without ZeRO and under ZeRO-1/2/3, with one process and with two (and the optimizer
offloaded): the resuming system loads exactly the weights the saving one had (bit for bit), and continues as the saving
system's run straight through (same steps and learning rates; losses and parameters as
the two systems' fp32 math agrees, to the last bits of float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.deepspeed.frameworks import finish, record, start

pytest.importorskip("deepspeed")  # the reference

SCRIPT = "checkpoint_script.py"


def _run_pair(tmp: Path, stage: int, mode: str, nproc: int, dirs: dict[str, Path],
              env: dict[str, str] | None = None) -> dict[str, Path]:
    """``mode`` on both systems at once; ``dirs`` maps each system ("real", "ours") to the
    checkpoint directory its run saves to or resumes from. Returns each run's record path."""
    records = {}
    runs = []
    for system, checkpoint in dirs.items():
        records[system] = tmp / f"{system}-{mode}-{checkpoint.name}.json"
        runs.append((system, start(SCRIPT, [str(stage), mode, str(checkpoint), str(records[system])], tmp,
                                   real=system == "real", env=env, nproc=nproc)))
    for system, process in runs:
        finish(process, f"{system} {mode} (ZeRO-{stage}, {nproc} process(es))")
    return records


def _assert_continuation(resumed: Path, saved: Path, full: Path) -> None:
    """``resumed`` loaded what ``saved`` had, bit for bit, and ended as ``full``."""
    _, loaded = record(Path(f"{resumed}.loaded"))
    _, at_save = record(saved)
    assert loaded.keys() == at_save.keys()
    for name, value in at_save.items():
        assert torch.equal(loaded[name], value), name
    mine, my_params = record(resumed)
    theirs, their_params = record(full)
    assert mine["client_state"]["epoch"] == 7, mine["client_state"]
    assert mine["client_state"]["file"] in ("global_step3/mp_rank_00_model_states.pt",
                                           "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert mine["steps"] == theirs["steps"][3:] == [4, 5, 6], (mine["steps"], theirs["steps"])
    assert mine["lrs"] == theirs["lrs"][3:]
    torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"][3:]), rtol=1e-6, atol=0)
    assert my_params.keys() == their_params.keys()
    for name, value in their_params.items():
        torch.testing.assert_close(my_params[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("stage", "nproc", "offload"), [(0, 1, False), (1, 1, False), (2, 1, False), (2, 2, False),
                                                        (2, 2, True)])
def test_checkpoints_cross_both_ways(tmp_path: Path, stage: int, nproc: int, offload: bool) -> None:
    """Real DeepSpeed's checkpoint resumes on hybridtrain, hybridtrain's on the real
    DeepSpeed: the weights arrive exactly, the run continues as the saving system's."""
    real_dir, our_dir = tmp_path / "real-ckpt", tmp_path / "our-ckpt"
    env = {"CHECKPOINT_OFFLOAD": "1" if offload else "0"}
    full = _run_pair(tmp_path, stage, "full", nproc, {"real": tmp_path / "none-r", "ours": tmp_path / "none-o"}, env)
    saved = _run_pair(tmp_path, stage, "save", nproc, {"real": real_dir, "ours": our_dir}, env)
    assert (our_dir / "latest").read_text() == "global_step3"
    expected = {"mp_rank_00_model_states.pt"} | ({f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                  for r in range(nproc)} if stage else set())
    assert {p.name for p in (our_dir / "global_step3").iterdir()} == expected
    assert {p.name for p in (real_dir / "global_step3").iterdir()} == expected
    crossed = _run_pair(tmp_path, stage, "resume", nproc, {"ours": real_dir, "real": our_dir}, env)
    _assert_continuation(crossed["ours"], saved["real"], full["real"])
    _assert_continuation(crossed["real"], saved["ours"], full["ours"])
    assert "+hybridtrain" in json.loads(crossed["ours"].read_text())["deepspeed"]


def test_real_zero_to_fp32_reads_ours_and_ours_reads_real(tmp_path: Path) -> None:
    """DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` reads a drop-in
    checkpoint (two ranks, ZeRO-2), and the drop-in's reads the real one: same weights."""
    from deepspeed.utils import zero_to_fp32 as theirs

    from hybridtrain.deepspeed.utils import zero_to_fp32 as ours

    real_dir, our_dir = tmp_path / "real-ckpt", tmp_path / "our-ckpt"
    saved = _run_pair(tmp_path, 2, "save", 2, {"real": real_dir, "ours": our_dir})
    for directory, system in ((real_dir, "real"), (our_dir, "ours")):
        _, params = record(saved[system])
        for reading in (theirs.get_fp32_state_dict_from_zero_checkpoint(str(directory)),
                        ours.get_fp32_state_dict_from_zero_checkpoint(directory)):
            assert reading.keys() == params.keys()
            for name, value in params.items():
                assert torch.equal(reading[name], value), (system, name)


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_checkpoints_cross_both_ways(tmp_path: Path, nproc: int) -> None:
    """ZeRO-3 (a model-states and an optimizer file per rank, every parameter cut over the
    ranks): the real DeepSpeed's checkpoint resumes on hybridtrain and the drop-in's on the real
    DeepSpeed, continuing as the saving system's run; DeepSpeed's own ``zero_to_fp32`` reads ours."""
    from deepspeed.utils import zero_to_fp32 as theirs

    real_dir, our_dir = tmp_path / "real-ckpt", tmp_path / "our-ckpt"
    full = _run_pair(tmp_path, 3, "full", nproc, {"real": tmp_path / "none-r", "ours": tmp_path / "none-o"})
    saved = _run_pair(tmp_path, 3, "save", nproc, {"real": real_dir, "ours": our_dir})
    names = {f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(nproc) for kind in ("model", "optim")}
    assert {p.name for p in (our_dir / "global_step3").iterdir()} == names
    assert {p.name for p in (real_dir / "global_step3").iterdir()} == names
    _, params = record(saved["ours"])
    reading = theirs.get_fp32_state_dict_from_zero_checkpoint(str(our_dir))
    assert reading.keys() == params.keys() and all(torch.equal(reading[k], v) for k, v in params.items())
    crossed = _run_pair(tmp_path, 3, "resume", nproc, {"ours": real_dir, "real": our_dir})
    _assert_continuation(crossed["ours"], saved["real"], full["real"])
    _assert_continuation(crossed["real"], saved["ours"], full["ours"])
