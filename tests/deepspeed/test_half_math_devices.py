"""DeepSpeed's bf16 math under the drop-in on each device: the CPU here, CUDA on the GPU machine
(``scripts/gpu_check.sh`` runs the ``cuda`` cells). The same steps as DeepSpeed's rules written as
a plain loop on the same device, through each wrapper: ZeRO-0 over a caller's optimizer, ZeRO-2 with
the masters offloaded to the host, ZeRO-3 (FSDP2 over one process), ZeRO-3 with the masters offloaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hybridtrain.deepspeed as deepspeed
from tests.deepspeed.test_master_weights import _plain_deepspeed_bf16, _Scaled

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1, "torch_adam": True}}
SETUPS: dict[str, dict[str, Any]] = {
    "zero0_callers_optimizer": {},
    "zero2_offload": {"optimizer": ADAMW, "zero_force_ds_cpu_optimizer": False,
                      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3": {"optimizer": ADAMW, "zero_optimization": {"stage": 3}},
    "zero3_offload": {"optimizer": ADAMW, "zero_force_ds_cpu_optimizer": False,
                      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_math_is_deepspeeds_rules_on_the_device(device: str, setup: str) -> None:
    torch.manual_seed(0)
    model = _Scaled().to(device)
    reference = _Scaled().to(device)
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=generator).to(device), torch.randn(4, 3, generator=generator).to(device))
               for _ in range(8)]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
              "bf16": {"enabled": True}, **SETUPS[setup]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1) if not SETUPS[setup] else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    for inputs, targets in batches:
        loss = F.mse_loss(engine(inputs.bfloat16()).float(), targets)
        assert loss.device.type == device
        engine.backward(loss)
        engine.step()
    assert engine.get_global_grad_norm() > 0.3  # the clip acted
    expected = _plain_deepspeed_bf16(reference, batches, lr=0.05, clip=0.3, init_step=not SETUPS[setup])
    mine = {name: p.detach().float().cpu() for name, p in engine.module.state_dict().items() if name != "scale"}
    theirs = [m.detach().bfloat16().float().cpu() for m in expected]
    for (name, weight), reference_weight in zip(mine.items(), theirs, strict=True):
        # Same rules on the same device; a host-stepped master may sit one fp32 ulp off the device's,
        # which can carry its bfloat16 weight across one rounding boundary: at most one bfloat16 step.
        torch.testing.assert_close(weight, reference_weight, rtol=2.0**-8, atol=1e-6, msg=name)
