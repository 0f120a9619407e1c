"""The Prometheus metric names a ``hybridtrain train`` job exposes, with their help text.

This is the contract with dashboards (the Grafana dashboard under ``deploy/`` queries these
names; a test checks that every query names one of them). Rename nothing here without
changing the dashboards. Every series carries the label ``rank`` (the process's global
rank); ``hybridtrain_step_seconds`` adds ``part`` and ``hybridtrain_device_memory_bytes``
adds ``kind``.
"""

from __future__ import annotations

from hybridtrain.runtime import transfer as _transfer

PREFIX = "hybridtrain_"

METRICS: dict[str, str] = {
    "hybridtrain_step": "Optimizer steps completed (the step of the latest metrics.jsonl record).",
    "hybridtrain_loss": "Training loss of the latest step (the batch's mean loss).",
    "hybridtrain_eval_loss": "Loss on held-out data at the latest evaluation.",
    "hybridtrain_learning_rate": "Learning rate of the first parameter group after the latest step.",
    "hybridtrain_loss_scale": "fp16 dynamic loss scale (1 without fp16).",
    "hybridtrain_skipped_steps_total": "Optimizer steps skipped for inf/NaN gradients or losses.",
    "hybridtrain_tokens_per_second": "Tokens per second of the latest step, over all ranks "
                                     "(global batch × seq_len / step time).",
    "hybridtrain_samples_per_second": "Samples per second of the latest step, over all ranks.",
    "hybridtrain_tflops": "Achieved model TFLOP/s of the latest step over all ranks (FLOPs per token × tokens/s).",
    "hybridtrain_mfu": "Model FLOPs utilisation: tflops / (device bf16 dense peak × world size); absent when "
                       "the peak is unknown (CPU).",
    "hybridtrain_step_seconds": "Seconds of the latest step by part (all but data and total need "
                                "wall_clock_breakdown).",
    "hybridtrain_device_memory_bytes": "Device memory by kind: allocated, reserved (CUDA caching allocator), peak "
                                       "(CUDA peak allocated; peak RSS on CPU), peak_reserved (CUDA peak reserved: "
                                       "what a memory cap counts).",
    "hybridtrain_transfer_bytes": "Bytes copied between host and device in the latest step, by kind "
                                  "(activations_out/in, weights_up, gradients_down, device_map).",
    "hybridtrain_device_alloc_retries_total": "CUDA caching-allocator retries (cudaMalloc failed, cache flushed, "
                                              "retried).",
    "hybridtrain_device_ooms_total": "CUDA out-of-memory errors raised by the caching allocator.",
    "hybridtrain_pinned_host_bytes": "Page-locked host memory held by torch's caching pinned allocator.",
    "hybridtrain_checkpoint_seconds": "Seconds the latest checkpoint took to save.",
    "hybridtrain_checkpoint_bytes": "Size in bytes of the latest checkpoint.",
    "hybridtrain_restarts_total": "Times this run was resumed from one of its checkpoints (carried through the "
                                  "checkpoints).",
}
"""Metric name → help text (the exposed names, counters with their ``_total`` suffix)."""

STEP_PARTS: tuple[str, ...] = ("forward", "backward", "interleaved", "optimizer", "transfer",
                               "communication", "host_optimizer", "data", "total")
"""Values of the ``part`` label of ``hybridtrain_step_seconds``."""

MEMORY_KINDS: tuple[str, ...] = ("allocated", "reserved", "peak", "peak_reserved")
"""Values of the ``kind`` label of ``hybridtrain_device_memory_bytes``."""

TRANSFER_KINDS: tuple[str, ...] = _transfer.TRANSFER_KINDS
"""Values of the ``kind`` label of ``hybridtrain_transfer_bytes``."""

COUNTERS: frozenset[str] = frozenset(name for name in METRICS if name.endswith("_total"))
"""The names exposed as Prometheus counters (the rest are gauges)."""
