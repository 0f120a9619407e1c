"""What the hardware can do, in one home: dense peak FLOP/s and memory per GPU model
(:mod:`~hybridtrain.hardware.peaks`) and how fast bytes move between host, device and
GPUs (:mod:`~hybridtrain.hardware.links`). The planner, the profiler and the monitors read
these tables; nothing here imports the rest of hybridtrain."""
