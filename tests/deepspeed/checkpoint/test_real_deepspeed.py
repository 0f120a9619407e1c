"""Checkpoints cross between the real DeepSpeed (0.19.8, CPU) and hybridtrain's drop-in, both
ways, without ZeRO and under ZeRO-1/2/3, with one process and with two (and the optimizer
offloaded): the resuming system loads exactly the weights the saving one had (bit for bit), and continues as the saving
system's run straight through (same steps and learning rates; losses and parameters as
the two systems' fp32 math agrees, to the last bits of float32).

Each case launches the real DeepSpeed once (its run, saving at step 3, then a resume of the
drop-in's checkpoint), between the drop-in's run and its resume of the real one's checkpoint
(in this process on one rank: :func:`tests.deepspeed.frameworks.run_dropin`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.deepspeed.frameworks import finish, record, run_dropin, start

pytest.importorskip("deepspeed")  # the reference

SCRIPT = "checkpoint_script.py"


def _cross(tmp: Path, stage: int, nproc: int, env: dict[str, str] | None = None) -> tuple[dict[str, Path],
                                                                                       dict[str, Path]]:
    """Both systems' runs saving at step 3, and each one's resume of the other's checkpoint.
    Returns each system's checkpoint directory and record path."""
    dirs = {"real": tmp / "real-ckpt", "ours": tmp / "our-ckpt"}
    out = {"real": tmp / "real.json", "ours": tmp / "ours.json"}
    run_dropin(SCRIPT, [str(stage), str(dirs["ours"]), "-", str(out["ours"])], tmp, nproc, env)
    finish(start(SCRIPT, [str(stage), str(dirs["real"]), str(dirs["ours"]), str(out["real"])], tmp, real=True,
                 env=env, nproc=nproc), f"the real DeepSpeed (ZeRO-{stage}, {nproc} process(es))")
    run_dropin(SCRIPT, [str(stage), "-", str(dirs["real"]), str(out["ours"])], tmp, nproc, env)
    return dirs, out


def _assert_continuation(resumed: Path, saver: Path) -> None:
    """``resumed`` loaded what the ``saver`` run had at its save, bit for bit, and ended as that run."""
    _, loaded = record(Path(f"{resumed}.loaded"))
    _, at_save = record(Path(f"{saver}.at_save"))
    assert loaded.keys() == at_save.keys()
    for name, value in at_save.items():
        assert torch.equal(loaded[name], value), name
    mine, my_params = record(resumed)
    theirs, their_params = record(saver)
    assert mine["client_state"]["epoch"] == 7, mine["client_state"]
    assert mine["client_state"]["file"] in ("global_step3/mp_rank_00_model_states.pt",
                                           "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert mine["steps"] == theirs["steps"][3:] == [4, 5, 6], (mine["steps"], theirs["steps"])
    assert mine["lrs"] == theirs["lrs"][3:]
    torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"][3:]), rtol=1e-6, atol=0)
    assert my_params.keys() == their_params.keys()
    for name, value in their_params.items():
        torch.testing.assert_close(my_params[name], value, rtol=1e-6, atol=1e-7)


def _assert_crossed(out: dict[str, Path], nproc: int) -> None:
    _assert_continuation(Path(f"{out['ours']}.resumed"), out["real"])  # the real DeepSpeed's run, resumed here
    _assert_continuation(Path(f"{out['real']}.resumed"), out["ours"])  # ours, resumed on the real DeepSpeed
    if nproc > 1:  # launched ranks import `deepspeed`: the drop-in's (in process, hybridtrain.deepspeed is passed)
        assert "+hybridtrain" in json.loads(Path(f"{out['ours']}.resumed").read_text())["deepspeed"]


@pytest.mark.parametrize(("stage", "nproc", "offload"), [(0, 1, False), (1, 1, False), (2, 1, False), (2, 2, False),
                                                        (2, 2, True)])
def test_checkpoints_cross_both_ways(tmp_path: Path, stage: int, nproc: int, offload: bool) -> None:
    """Real DeepSpeed's checkpoint resumes on hybridtrain, hybridtrain's on the real
    DeepSpeed: the weights arrive exactly, the run continues as the saving system's; two ranks
    under ZeRO-2: DeepSpeed's own ``zero_to_fp32`` reads the drop-in's checkpoint, and the
    drop-in's reads the real one's, as the weights saved. ``module.state_dict()`` and
    ``parameters()`` hold plain whole tensors on either system (two ranks: no DTensors)."""
    dirs, out = _cross(tmp_path, stage, nproc, {"CHECKPOINT_OFFLOAD": "1" if offload else "0"})
    assert (dirs["ours"] / "latest").read_text() == "global_step3"
    expected = {"mp_rank_00_model_states.pt"} | ({f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                  for r in range(nproc)} if stage else set())
    assert {p.name for p in (dirs["ours"] / "global_step3").iterdir()} == expected
    assert {p.name for p in (dirs["real"] / "global_step3").iterdir()} == expected
    _assert_crossed(out, nproc)
    ours, theirs = (record(out[system])[0]["kinds"] for system in ("ours", "real"))
    assert ours == theirs == {"state_dict": ["Tensor"], "parameters": ["Parameter"]}  # no DTensor on 2 ranks
    if (stage, nproc, offload) == (2, 2, False):
        _assert_zero_to_fp32_reads_both(dirs, out)


def _assert_zero_to_fp32_reads_both(dirs: dict[str, Path], out: dict[str, Path]) -> None:
    from deepspeed.utils import zero_to_fp32 as theirs

    from hybridtrain.deepspeed.utils import zero_to_fp32 as ours

    for system in ("real", "ours"):
        _, params = record(Path(f"{out[system]}.at_save"))
        for reading in (theirs.get_fp32_state_dict_from_zero_checkpoint(str(dirs[system])),
                        ours.get_fp32_state_dict_from_zero_checkpoint(dirs[system])):
            assert reading.keys() == params.keys()
            for name, value in params.items():
                assert torch.equal(reading[name], value), (system, name)


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_checkpoints_cross_both_ways(tmp_path: Path, nproc: int) -> None:
    """ZeRO-3 (a model-states and an optimizer file per rank, every parameter cut over the
    ranks): the real DeepSpeed's checkpoint resumes on hybridtrain and the drop-in's on the real
    DeepSpeed, continuing as the saving system's run; DeepSpeed's own ``zero_to_fp32`` reads ours."""
    from deepspeed.utils import zero_to_fp32 as theirs

    dirs, out = _cross(tmp_path, 3, nproc)
    names = {f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(nproc) for kind in ("model", "optim")}
    assert {p.name for p in (dirs["ours"] / "global_step3").iterdir()} == names
    assert {p.name for p in (dirs["real"] / "global_step3").iterdir()} == names
    _, params = record(Path(f"{out['ours']}.at_save"))
    reading = theirs.get_fp32_state_dict_from_zero_checkpoint(str(dirs["ours"]))
    assert reading.keys() == params.keys() and all(torch.equal(reading[k], v) for k, v in params.items())
    _assert_crossed(out, nproc)
