"""Measuring what training costs: FLOPs, memory and time per module, the step's parts,
utilisation against the device's peak, and what to change (``hybridtrain profile``).

- :mod:`~hybridtrain.hardware.peaks`: dense peak FLOP/s and memory per GPU model, a
  measured matmul rate elsewhere.
- :mod:`~hybridtrain.profiling.counting`: one step counted (FLOPs forward/backward and saved
  activations per module, live bytes over time).
- :mod:`~hybridtrain.profiling.attention_flops`: FLOPs of the fused attention kernels, grouped
  key/value heads included (shared with the planner's meta-device trace).
- :mod:`~hybridtrain.profiling.breakdown`: the step split into parts from profiler events.
- :mod:`~hybridtrain.profiling.diagnosis`: rules over a measured profile.
- :mod:`~hybridtrain.profiling.profiler`: :func:`profile_engine` ties them together;
  :mod:`~hybridtrain.profiling.scheduled` runs it inside a training loop (DeepSpeed's
  ``flops_profiler``).
"""

from hybridtrain.profiling.memory import SavedTensorMeter

__all__ = ["SavedTensorMeter"]
