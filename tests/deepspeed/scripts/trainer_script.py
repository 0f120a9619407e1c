"""A Hugging Face Trainer script as a user writes it, with ``--deepspeed ds.json``
(the config full of "auto"). Trains 6 optimizer steps saving a checkpoint every 3, then
resumes a new Trainer from checkpoint-3 through the Trainer's own resume logic and trains
to step 6 again; saves the final model with ``save_model``. Usage: SCRIPT DS_CONFIG WORKDIR OUT.
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
from transformers import Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = token_data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.record = {"losses": [], "lrs": [], "steps": [], "grad_norms": []}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.record["losses"].append(logs["loss"])
            self.record["lrs"].append(logs["learning_rate"])
            self.record["steps"].append(state.global_step)
            self.record["grad_norms"].append(logs.get("grad_norm"))


def train(ds_config: str, workdir: str, resume: str | None) -> tuple[dict, Trainer]:
    args = TrainingArguments(
        output_dir=f"{workdir}/out", deepspeed=ds_config, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=LR, warmup_steps=WARMUP, max_grad_norm=CLIP,
        max_steps=6, save_steps=3, logging_steps=1, save_strategy="steps", report_to=[], seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, weight_decay=0.01,
        bf16=os.environ.get("TRAINER_BF16") == "1",  # fills the config's bf16.enabled: "auto"
    )
    callback = Record()
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return callback.record, trainer


if __name__ == "__main__":
    ds_config, workdir = sys.argv[1], sys.argv[2]
    full, trainer = train(ds_config, workdir, None)
    trainer.save_model(f"{workdir}/final")
    write_record(out_path() + ".full", full, trainer.model)
    resumed, trainer = train(ds_config, workdir, f"{workdir}/out/checkpoint-3")
    write_record(out_path() + ".resumed", resumed, trainer.model)
