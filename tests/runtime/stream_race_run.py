"""One CUDA training run of an offload mode, saved for comparison (run as a subprocess by
``test_stream_races``: CUDA_LAUNCH_BLOCKING and the CUDA sanitizer must be set before CUDA
starts). Usage: ``python -m tests.runtime.stream_race_run MODE OUT``."""

from __future__ import annotations

import sys

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from tests.equivalence import MODES, engine_config

CFG = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=64, vocab_size=256)
STEPS = 3


def main(mode: str, out: str) -> None:
    """Train ``STEPS`` steps of ``mode`` on CUDA; save losses and parameters to ``out``."""
    torch.manual_seed(0)
    engine = ht.initialize(GPT(CFG), engine_config(MODES[mode], device="cuda"), loss_fn=causal_lm_loss)
    engine.overlap_updates = bool(MODES[mode].extra.get("overlap_updates"))  # host updates during the next forward
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=gen)
        losses.append(engine.train_batch((tokens[:, :-1], tokens[:, 1:])))
    torch.cuda.synchronize()
    torch.save({"losses": losses, "state": engine.model_state_dict()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
