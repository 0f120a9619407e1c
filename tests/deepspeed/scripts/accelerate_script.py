"""An Accelerate training script as a user writes it; DeepSpeed is switched on from outside
(``accelerate launch --use_deepspeed --deepspeed_config_file ds.json``, i.e. the
``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` environment).

Trains 6 optimizer steps, saving the state after 3 (``accelerator.save_state``); then
loads that state into a fresh model and trains the last 3 again. Usage: SCRIPT WORKDIR OUT.
"""

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
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
from transformers import get_linear_schedule_with_warmup


def train(workdir: str, resume: bool) -> tuple[dict, torch.nn.Module]:
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(token_data(), batch_size=MICRO, shuffle=False)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, 6)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    record = {"losses": [], "lrs": [], "steps": []}
    skip = 0
    if resume:
        accelerator.load_state(f"{workdir}/state")
        skip = 3 * ACCUMULATION
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        record["losses"].append(loss.item())
        if accelerator.sync_gradients:
            record["lrs"].append(scheduler.get_last_lr()[0])
            record["steps"].append(model.global_steps)
        if i + 1 == 3 * ACCUMULATION and not resume:
            accelerator.save_state(f"{workdir}/state")
    return record, accelerator.unwrap_model(model)


if __name__ == "__main__":
    workdir = sys.argv[1]
    full, model = train(workdir, resume=False)
    write_record(out_path() + ".full", full, model)
    resumed, model = train(workdir, resume=True)
    write_record(out_path() + ".resumed", resumed, model)
