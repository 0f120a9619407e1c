"""A Lightning script as a user writes it, with ``DeepSpeedStrategy(config=ds.json)``.
Trains 6 optimizer steps and saves a checkpoint after 3 (``trainer.save_checkpoint``), then
a new Trainer resumes from it (``fit(ckpt_path=…)``) to step 6. Usage: SCRIPT DS_CONFIG WORKDIR OUT.

Lightning's DeepSpeedStrategy accepts CUDA accelerators only; on a CPU machine the test
runs it through :mod:`lightning_on_cpu`, which lifts that one check (for the real
DeepSpeed and for hybridtrain alike). With ``HYBRIDTRAIN_LIGHTNING_STRATEGY`` set it uses
hybridtrain's subclass instead (``hybridtrain.deepspeed.lightning``), started as a plain
``python script.py``.
"""

import os
import sys

import torch
from common import (
    ACCUMULATION,
    CLIP,
    LR,
    MICRO,
    WARMUP,
    out_path,
    tiny_llama,
    token_data,
    write_record,
)
from lightning.pytorch import Callback, LightningModule, Trainer
from transformers import get_linear_schedule_with_warmup

if os.environ.get("HYBRIDTRAIN_LIGHTNING_STRATEGY"):  # hybridtrain's subclass: the CPU is allowed
    from hybridtrain.deepspeed.lightning import DeepSpeedStrategy
else:
    import lightning_on_cpu  # noqa: F401  (lifts the CUDA-only check; see the docstring)
    from lightning.pytorch.strategies import DeepSpeedStrategy


class TinyLlama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.record = {"losses": [], "lrs": [], "steps": []}

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.record["losses"].append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, 6)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_data(), batch_size=MICRO, shuffle=False)


class Steps(Callback):
    def __init__(self, save: str | None) -> None:
        self.save, self.last = save, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step != self.last:  # an optimizer step was taken
            self.last = step
            module.record["steps"].append(step)
            module.record["lrs"].append(trainer.optimizers[0].param_groups[0]["lr"])
            if self.save and step == 3:
                trainer.save_checkpoint(self.save)


def train(ds_config: str, workdir: str, resume: bool) -> tuple[dict, torch.nn.Module]:
    torch.manual_seed(0)
    module = TinyLlama()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(config=ds_config),
                      accumulate_grad_batches=ACCUMULATION, gradient_clip_val=CLIP, max_steps=6,
                      precision=os.environ.get("LIGHTNING_PRECISION", "32-true"),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Steps(None if resume else f"{workdir}/ckpt")], default_root_dir=workdir)
    trainer.fit(module, ckpt_path=f"{workdir}/ckpt" if resume else None)
    return module.record, module.model


if __name__ == "__main__":
    ds_config, workdir = sys.argv[1], sys.argv[2]
    full, model = train(ds_config, workdir, resume=False)
    write_record(out_path() + ".full", full, model)
    resumed, model = train(ds_config, workdir, resume=True)
    write_record(out_path() + ".resumed", resumed, model)
