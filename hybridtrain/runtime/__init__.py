"""How one training step executes on one process: devices, precision, checkpointing, optimizers."""
