"""How many processes cooperate: launcher, topology, data parallel (DDP), ZeRO (FSDP2),
pipeline, tensor parallel and in-process model parallel (``device_map``)."""
