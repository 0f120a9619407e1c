"""How one training step executes on one process, one sub-package per technique:

- :mod:`.offload`: optimizer offload (host masters, gradients and state; the host worker)
- :mod:`.streaming`: layer-to-layer streaming of the blocks through the device
- :mod:`.activations`: activation checkpointing and swapping to host memory
- :mod:`.precision`: autocast, loss scaling, weights that cross in half

and what every technique shares: micro-batches (:mod:`.batch`), devices (:mod:`.device`),
who runs a step (:mod:`.step_runner`), what the step asks of the optimizer
(:mod:`.step_optimizer`), timings (:mod:`.step_parts`, :mod:`.stream_marks`), copies
(:mod:`.transfer`) and live-byte counting (:mod:`.memory_limit`, :mod:`.thread_counters`).
Optimizers and schedules by name are :mod:`hybridtrain.optim`.
"""
