"""Lightning's and Fabric's own DeepSpeed strategy names on the CPU, as a user writes them
(no hybridtrain import): two optimizer steps each. Usage: SCRIPT STRATEGY_NAME."""

import sys

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer

name = sys.argv[1]


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
trainer = Trainer(accelerator="cpu", devices=1, strategy=name, max_steps=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), data)
assert trainer.global_step == 2, trainer.global_step
print("trainer strategy", type(trainer.strategy).__module__, trainer.global_step)

fabric = Fabric(accelerator="cpu", devices=1, strategy=name)
fabric.launch()
model = torch.nn.Linear(4, 2)
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
before = model.weight.detach().clone()
for _ in range(2):
    fabric.backward(model(torch.ones(2, 4)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
assert not torch.equal(before, model.weight.detach()), "fabric did not train"
print("fabric strategy", type(fabric.strategy).__module__)
