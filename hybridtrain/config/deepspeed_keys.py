"""Every DeepSpeed config key has exactly one treatment here.

- **implemented**: a key of our schema (:mod:`hybridtrain.config.schema`), with DeepSpeed's
  meaning; not listed below.
- **renamed**: a legacy name, moved to the current key before validation.
- **no effect**: accepted because it cannot change the result on this engine
  (communication, bucketing, memory layout, logging destinations); said once at info level.
- **refused**: it would change the math and hybridtrain does not implement it; one line
  names the key, what it does in DeepSpeed and the nearest hybridtrain setting. Every
  refusal of a file is reported together.

``"auto"`` (Hugging Face's Trainer fills it in) is resolved where the rest of the config
determines it, and refused naming the key where only the Trainer's arguments could.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from hybridtrain.config.schema import Config, TrainConfig

log = logging.getLogger("hybridtrain.config")

Kind = Literal["renamed", "no_effect", "refused"]


@dataclass(frozen=True)
class Treatment:
    """What happens to one DeepSpeed key.

    Attributes:
        kind: ``renamed`` | ``no_effect`` | ``refused``.
        note: what the key does in DeepSpeed, and why it is accepted or what to use instead.
        target: the current key (``renamed``).
        when: a refusal applies only to values for which this is true (``None``: any value).
    """

    kind: Kind
    note: str
    target: str | None = None
    when: Callable[[Any], bool] | None = None


def _no(note: str) -> Treatment:
    return Treatment("no_effect", note)


def _refused(note: str, when: Callable[[Any], bool] | None = None) -> Treatment:
    return Treatment("refused", note, when=when)


def _renamed(target: str) -> Treatment:
    return Treatment("renamed", f"legacy name of {target}", target)


def _truthy(value: Any) -> bool:
    return bool(value) and value != "none"


def _enables(value: Any) -> bool:
    """Whether a DeepSpeed feature section switches anything on (``"enabled": true`` anywhere in it)."""
    if isinstance(value, dict):
        return value.get("enabled") is True or any(_enables(v) for v in value.values())
    if isinstance(value, list):
        return any(_enables(v) for v in value)
    return False


_COMM = "communication or bucketing only; gradients and updates are the same"
_MEMORY = "memory layout or prefetching only; the math is the same"
_LOGGING = "a logging destination; hybridtrain writes metrics.jsonl and prints steps"
_HALF_AVERAGING = ("; except under hybridtrain.deepspeed's bf16/fp16 math on several processes (ZeRO-1/2), "
                   "which averages the half gradients as DeepSpeed does (docs/deepspeed.md)")

TREATMENTS: dict[str, Treatment] = {
    # ---------------------------------------------------------------- legacy names
    "bfloat16": _renamed("bf16"),
    "zero_optimization.cpu_offload": _renamed("zero_optimization.offload_optimizer.device"),
    "zero_optimization.cpu_offload_params": _renamed("zero_optimization.offload_param.device"),
    "zero_optimization.cpu_offload_param": _renamed("zero_optimization.offload_param.device"),
    "zero_optimization.cpu_offload_use_pin_memory": _renamed("zero_optimization.offload_optimizer.pin_memory"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        _renamed("zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    **{f"zero_optimization.{name}": _renamed(f"zero_optimization.stage3_{name}")
       for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                    "max_reuse_distance", "gather_16bit_weights_on_model_save")},
    "tensor_parallel.autotp_size": _renamed("tensor_parallel.size"),
    # ---------------------------------------------------------------- no effect here
    "compile": _no("torch.compile of the model; same math"),
    "log": _no(_LOGGING),
    "comms_config": _no(_COMM),
    "monitor_config": _no(_LOGGING),
    "zero_optimization.model_persistence_threshold": _no(_MEMORY),
    "prescale_gradients": _no("divides gradients before the all-reduce instead of after: " + _COMM + _HALF_AVERAGING),
    "gradient_predivide_factor": _no("splits the gradient averaging around the all-reduce: " + _COMM
                                     + _HALF_AVERAGING),
    "communication_data_type": _no("dtype of gradient communication; gradients are reduced in fp32 here"
                                   + _HALF_AVERAGING),
    "seq_parallel_communication_data_type": _no("dtype of sequence-parallel communication: " + _COMM),
    "sparse_gradients": _no("communicates embedding gradients sparsely: " + _COMM),
    "disable_allgather": _no(_COMM),
    "cuda_visible_devices": _no("device selection is the launcher's"),
    "memory_breakdown": _no(_LOGGING),
    "dump_state": _no(_LOGGING),
    **{f"flops_profiler.{name}": _no("a detail of DeepSpeed's printed profile; hybridtrain's profile shows blocks, "
                                     "embeddings and head, and measures recomputation instead of scaling it")
       for name in ("module_depth", "top_modules", "detailed", "recompute_fwd_factor")},
    "comet": _no(_LOGGING),
    "comms_logger": _no(_LOGGING),
    "timers": _no(_LOGGING),
    "autotuning": _no("settings of DeepSpeed's autotuner (trials, metric, tuner): hybridtrain's planner "
                      "estimates every variant instead of running them"),
    "autotuning.enabled": Treatment("renamed", "DeepSpeed's autotuner → the planner chooses the plan", "auto"),
    "aio": _no("NVMe I/O settings; NVMe offload itself is refused"),
    "checkpoint": _no("checkpoint file layout; hybridtrain writes its own atomic checkpoints"),
    "load_universal_checkpoint": _no("checkpoint file layout"),
    "use_node_local_storage": _no("checkpoint file layout"),
    "zero_force_ds_cpu_optimizer": _no("the host optimizer is torch's fused CPU Adam, same math"),
    "graph_harvesting": _no("CUDA graph capture; same math"),
    "hybrid_engine": _no("DeepSpeed-Chat's generation engine; does not change training"),
    "bf16.immediate_grad_update": _no(_MEMORY),
    "bf16.check_grad_overflow": _no("the drop-in's bf16 always skips a step whose gradients overflow, as "
                                    "DeepSpeed does by default (true); false is not taken over"),
    "bf16.loss_scale": _no("bf16 is not loss-scaled"),
    "bf16.initial_scale_power": _no("bf16 is not loss-scaled"),
    "bf16.loss_scale_window": _no("bf16 is not loss-scaled"),
    "bf16.hysteresis": _no("bf16 is not loss-scaled"),
    "bf16.min_loss_scale": _no("bf16 is not loss-scaled"),
    "bf16.consecutive_hysteresis": _no("bf16 is not loss-scaled"),
    "bf16.auto_cast": _no("inputs are cast by autocast here"),
    "optimizer.legacy_fusion": _no("kernel fusion; same math"),
    "activation_checkpointing.partition_activations": _no("partitions checkpoints over model-parallel ranks: "
                                                          + _MEMORY),
    "activation_checkpointing.contiguous_memory_optimization": _no(_MEMORY),
    "activation_checkpointing.number_checkpoints": _no("sizes the contiguous checkpoint buffer: " + _MEMORY),
    "activation_checkpointing.synchronize_checkpoint_boundary": _no("a device synchronisation; same math"),
    "activation_checkpointing.profile": _no(_LOGGING),
    "zero_optimization.reduce_scatter": _no(_COMM + _HALF_AVERAGING),
    "zero_optimization.allgather_partitions": _no(_COMM),
    "zero_optimization.use_multi_rank_bucket_allreduce": _no(_COMM),
    "zero_optimization.compute_grad_norm": _no("the gradient norm is computed when clipping needs it"),
    "zero_optimization.load_from_fp32_weights": _no("checkpoint loading detail"),
    "zero_optimization.elastic_checkpoint": _no("checkpoint file layout"),
    "zero_optimization.sub_group_size": _no("size of optimizer-step groups: " + _MEMORY),
    "zero_optimization.stage3_model_persistence_threshold": _no(_MEMORY),
    "zero_optimization.stage3_module_granularity_threshold": _no(_MEMORY),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _no(_COMM),
    "zero_optimization.stage3_allgather_sequential": _no(_COMM),
    "zero_optimization.ignore_unused_parameters": _no("unused parameters get no gradient here either"),
    "zero_optimization.legacy_stage1": _no(_MEMORY),
    "zero_optimization.round_robin_gradients": _no(_COMM),
    "zero_optimization.parameter_alignment": _no(_MEMORY),
    "zero_optimization.zero_hpz_partition_size": _no("hierarchical partitioning: " + _COMM),
    "zero_optimization.memory_efficient_linear": _no(_MEMORY),
    "zero_optimization.pipeline_loading_checkpoint": _no("checkpoint loading detail"),
    "zero_optimization.override_module_apply": _no("module initialisation detail"),
    "zero_optimization.log_trace_cache_warnings": _no(_LOGGING),
    "zero_optimization.enable_sanity_checks": _no("debug checks"),
    "zero_optimization.leaf_module": _no("prefetch granularity: " + _MEMORY),
    "zero_optimization.mics_shard_size": _no("MiCS sharding groups: " + _COMM),
    "zero_optimization.mics_hierarchical_params_gather": _no(_COMM),
    **{f"zero_optimization.{section}.{key}": _no("NVMe/host buffer tuning: " + _MEMORY)
       for section in ("offload_param", "offload_optimizer")
       for key in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                   "fast_init", "cpuadam_cores_perc", "super_offload", "pipeline")},
    # ---------------------------------------------------------------- refused: changes the math
    "amp": _refused("NVIDIA Apex mixed precision with its own casting rules; use fp16 or bf16"),
    "fp8": _refused("fp8 training; use bf16"),
    "compression_training": _refused("quantization-aware training and pruning; no hybridtrain equivalent",
                                     when=_enables),
    "sparse_attention": _no("settings of DeepSpeed's sparse-attention modules, which only model code using "
                            "them reads"),
    "progressive_layer_drop": _refused("randomly skips layers during training; no hybridtrain equivalent",
                                       when=_enables),
    "curriculum_learning": _refused("changes the sequence length over training; no hybridtrain equivalent",
                                    when=_enables),
    "data_efficiency": _refused("data sampling and routing schedules; no hybridtrain equivalent", when=_enables),
    "eigenvalue": _refused("eigenvalue-based adaptive layer-wise schedules; no hybridtrain equivalent", when=_enables),
    "quantize_training": _refused("quantized training (MoQ); use bf16"),
    "weight_quantization": _refused("weight quantization; use bf16"),
    "elasticity": _refused("changes batch sizes with the number of GPUs; fix the batch sizes and use "
                           "hybridtrain launch --max-restarts"),
    "sequence_parallel_size": _refused("Ulysses sequence parallelism, used when above 1; use tensor_parallel",
                                       when=lambda v: v not in (None, 1)),
    "data_types": _refused("a gradient-accumulation dtype other than fp32; gradients accumulate in the "
                           "parameters' dtype here",
                           when=lambda v: isinstance(v, dict) and v.get("grad_accum_dtype") not in (None, "fp32")),
    "bf16.bf16_master_weights_and_grads": _refused("bf16 master weights and gradients; masters stay fp32 here",
                                                   when=_truthy),
    "bf16.bf16_optimizer_states": _refused("bf16 optimizer states; they stay fp32 here", when=_truthy),
    "fp16.fp16_master_weights_and_grads": _refused("fp16 master weights and gradients; masters stay fp32 here",
                                                   when=_truthy),
    "fp16.consecutive_hysteresis": _refused("loss-scale hysteresis refilled by every good step; the scaler here "
                                            "refills it when the scale grows, as DeepSpeed does by default",
                                            when=_truthy),
    "zero_optimization.zero_quantized_weights": _refused("ZeRO++ quantized weight all-gather (qwZ); use bf16",
                                                         when=_truthy),
    "zero_optimization.zero_quantized_nontrainable_weights": _refused("quantized frozen weights; use bf16",
                                                                      when=_truthy),
    "zero_optimization.zero_quantized_gradients": _refused("ZeRO++ quantized gradients (qgZ); use "
                                                           "data_parallel.gradient_compression", when=_truthy),
    **{f"zero_optimization.{section}.device": _refused("NVMe offload; use device: cpu",
                                                       when=lambda v: v == "nvme")
       for section in ("offload_param", "offload_optimizer")},
    "zero_optimization.zenflow": _refused("ZenFlow's stale, importance-selected updates; use "
                                          "zero_optimization.offload_optimizer", when=_truthy),
}


@dataclass(frozen=True)
class Applied:
    """The treatment one key of one file got (for ``hybridtrain config`` and the log)."""

    key: str
    treatment: str
    note: str


def apply_treatments(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Applied]]:
    """Rename legacy keys, drop keys without effect, resolve ``"auto"``; returns the config
    to validate and what happened to each DeepSpeed key.

    Raises:
        ValueError: every refused key and unresolvable ``"auto"`` of the config, in one line.
    """
    raw = _normalise_legacy_shapes(raw)
    applied: list[Applied] = [Applied(key, "no effect", "a comment") for key in raw if key.startswith("_")]
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    refusals: list[str] = []
    for key, value in list(_flatten(raw)):
        treatment = TREATMENTS.get(key)
        if treatment is None:
            continue
        if treatment.kind == "refused":
            if treatment.when is None or treatment.when(value):
                shown = "" if isinstance(value, dict) else f" = {value!r}"
                refusals.append(f"{key}{shown}: {treatment.note}")
            elif not in_schema(key):  # a value that changes nothing (false, 1, fp32)
                _delete(raw, key)
                applied.append(Applied(key, "no effect", f"{value!r} is DeepSpeed's default"))
        elif treatment.kind == "renamed":
            _delete(raw, key)
            _set(raw, str(treatment.target), _renamed_value(key, value))
            applied.append(Applied(key, "renamed", f"→ {treatment.target}"))
        else:
            _delete(raw, key)
            applied.append(Applied(key, "no effect", treatment.note))
    for key, value in list(_flatten(raw)):
        if value == "auto":
            outcome = _resolve_auto(raw, key)
            if outcome is None:
                refusals.append(f"{key} = \"auto\": {_auto_hint(key)}")
            else:
                applied.append(Applied(key, "auto", outcome))
    refusals += _deepspeed_optimizer_rules(raw)
    if refusals:
        raise ValueError("DeepSpeed settings hybridtrain cannot honour: " + "; ".join(refusals))
    return raw, applied


# DeepSpeed's own optimizers (hybridtrain.optim.DEEPSPEED_OPTIMIZERS), as named in refusals.
_DEEPSPEED_OPTIMIZER_NAMES = {"lamb": "LAMB", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam",
                              "onebitlamb": "1-bit LAMB"}


def deepspeed_takes_fp16_init_step(raw: dict[str, Any]) -> bool:
    """Whether DeepSpeed (0.19.8) holds the optimizer of this config — its own or the
    caller's — in its fp16 wrapper, which steps it once with zero gradients when built
    (the fp16 init step, :mod:`hybridtrain.optim.deepspeed.init_step`).

    ``deepspeed/runtime/engine.py``: ``_do_optimizer_sanity_check`` answers ``FP16`` (fp16)
    or ``DDP_BFLOAT16`` (bf16 unless pipelined) when ZeRO is off, and ``_configure_optimizer``
    then builds ``FP16_Optimizer`` (FusedAdam) or ``FP16_UnfusedOptimizer`` (any other
    optimizer) through ``_configure_fp16_optimizer``; both constructors end in
    ``initialize_optimizer_states``: zero gradients, ``self.optimizer.step()``. The LR
    scheduler is built after (``_configure_lr_scheduler``), so that step uses the
    optimizer's own ``lr``. ZeRO stages 1–3 (``stage_1_and_2.py``/``stage3.py``
    ``initialize_optimizer_states`` only make zero gradients) and the pipelined bf16
    ``BF16_Optimizer`` do not step; ``torch_autocast`` keeps fp32 parameters and no wrapper.

    Args:
        raw: the DeepSpeed config as written (legacy ``bfloat16`` and boolean
            ``zero_optimization`` understood; ``"auto"`` is not enabled).
    """
    zero = raw.get("zero_optimization")
    stage = int(zero) if isinstance(zero, bool) else _get(raw, "zero_optimization.stage") or 0
    pipeline = [_get(raw, "pipeline.stages"), raw.get("pipeline_model_parallel_size")]
    pipelined = any(isinstance(n, int) and n > 1 for n in pipeline)
    bf16 = _get(raw, "bf16.enabled") is True or _get(raw, "bfloat16.enabled") is True
    return stage == 0 and (_get(raw, "fp16.enabled") is True or (bf16 and not pipelined))


def _deepspeed_optimizer_rules(raw: dict[str, Any]) -> list[str]:
    """For DeepSpeed's LAMB and 1-bit optimizers, the combinations its engine asserts
    against (or computes differently) are refused. DeepSpeed's fp16 init step is not
    a key treatment: the DeepSpeed drop-in takes it (:mod:`hybridtrain.deepspeed.building`),
    so loading a config adds nothing a written config would carry."""
    optimizer = raw.get("optimizer")
    if not isinstance(optimizer, dict):
        return []
    name = str(optimizer.get("type", "")).lower()
    label = _DEEPSPEED_OPTIMIZER_NAMES.get(name)
    return _deepspeed_optimizer_refusals(raw, name, f"optimizer.type = {optimizer.get('type')!r} ({label})") \
        if label is not None else []


def _deepspeed_optimizer_refusals(raw: dict[str, Any], name: str, shown: str) -> list[str]:
    label = _DEEPSPEED_OPTIMIZER_NAMES[name]
    stage = _get(raw, "zero_optimization.stage") or 0
    refusals = []
    if stage and name != "lamb":
        # deepspeed/runtime/engine.py, _configure_basic_optimizer: assert not self.zero_optimization()
        refusals.append(f"{shown} with zero_optimization.stage = {stage}: DeepSpeed asserts "
                        f"'{label} is not compatible with ZeRO'; use stage 0")
    # Pipelined bf16 gets BF16_Optimizer, which flattens; unpipelined bf16 at stage 0 gets
    # FP16_UnfusedOptimizer, per tensor as with fp16 (see deepspeed_takes_fp16_init_step).
    bf16_flat = _get(raw, "bf16.enabled") is True and not deepspeed_takes_fp16_init_step(raw)
    if name in ("lamb", "onebitlamb") and (stage or bf16_flat):
        refusals.append(f"{shown} with {'ZeRO' if stage else 'bf16 and pipeline parallel'}: DeepSpeed then takes "
                        "the trust ratio over each flattened partition of parameters, not per tensor as "
                        "hybridtrain does; use zero_optimization.stage 0 (with fp16, bf16 or fp32) and no pipeline")
    if name in ("lamb", "onebitlamb") and _get(raw, "fp16.enabled") is True and (_get(raw, "fp16.loss_scale") or 0) > 0:
        refusals.append(f"{shown} with fp16.loss_scale = {_get(raw, 'fp16.loss_scale')}: DeepSpeed asserts it "
                        "'requires dynamic loss scaling'; use fp16.loss_scale 0")
    if _get(raw, "layer_streaming.enabled") is True:
        refusals.append(f"{shown} with layer_streaming: the update is not split into the streamed blocks' "
                        "host updates; use Adam or AdamW")
    return refusals


def log_treatments(applied: list[Applied]) -> None:
    """Say once, at info level, what happened to the DeepSpeed keys."""
    if applied:
        log.info("DeepSpeed keys: %s", "; ".join(f"{a.key} ({a.treatment}: {a.note})" for a in applied))


# Keys whose "auto" the rest of the config determines (what the Trainer would derive).
AUTO_RESOLVED: dict[str, tuple[Any, str]] = {
    "train_batch_size": (None, "from the other two batch sizes and the batch given"),
    "train_micro_batch_size_per_gpu": (None, "from the other two batch sizes and the batch given"),
    "gradient_accumulation_steps": (None, "from the other two batch sizes and the batch given"),
    "gradient_clipping": (1.0, "1.0, the Trainer's max_grad_norm default"),
    "fp16.enabled": (False, "false, the Trainer's default without --fp16"),
    "bf16.enabled": (False, "false, the Trainer's default without --bf16"),
    "zero_optimization.reduce_bucket_size": (None, "bucket size: " + _COMM),
    "zero_optimization.allgather_bucket_size": (None, "bucket size: " + _COMM),
    "zero_optimization.stage3_prefetch_bucket_size": (None, _MEMORY),
    "zero_optimization.stage3_param_persistence_threshold": (None, _MEMORY),
    "zero_optimization.stage3_max_live_parameters": (None, _MEMORY),
    "zero_optimization.stage3_max_reuse_distance": (None, _MEMORY),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (None, "export detail"),
}


# What the Hugging Face Trainer puts where only its own arguments decide (its defaults):
# resolved to those, and said, naming the key and what to put there instead.
TRAINER_DEFAULTS: dict[str, tuple[Any, str]] = {
    "optimizer.params.lr": (5e-5, "the Trainer's default learning_rate"),
    "optimizer.params.betas": ([0.9, 0.999], "the Trainer's default adam_beta1, adam_beta2"),
    "optimizer.params.eps": (1e-8, "the Trainer's default adam_epsilon"),
    "optimizer.params.weight_decay": (0.0, "the Trainer's default weight_decay"),
    "scheduler.params.warmup_min_lr": (0.0, "as the Trainer sets it"),
    "scheduler.params.warmup_max_lr": (None, "the learning rate, as the Trainer sets it"),
    # The Trainer's warmup_steps default is 0; DeepSpeed needs a positive count (and warms
    # up over at least 2 steps whatever is given below that).
    "scheduler.params.warmup_num_steps": (1, "the Trainer's default warmup_steps 0, made positive for DeepSpeed"),
    "scheduler.params.total_num_steps": (None, "the run's train.steps, as the Trainer uses max_steps"),
}


def _resolve_auto(raw: dict[str, Any], key: str) -> str | None:
    if key in TRAINER_DEFAULTS:
        return _trainer_default(raw, key)
    if key not in AUTO_RESOLVED:
        return None
    value, why = AUTO_RESOLVED[key]
    if value is None:
        _delete(raw, key)
    else:
        _set(raw, key, value)
    return why


def _trainer_default(raw: dict[str, Any], key: str) -> str | None:
    value, argument = TRAINER_DEFAULTS[key]
    if key == "scheduler.params.warmup_max_lr":
        value = _get(raw, "optimizer.params.lr")
        value = TRAINER_DEFAULTS["optimizer.params.lr"][0] if value in (None, "auto") else value
    if key == "scheduler.params.total_num_steps":
        # The run's length: train.steps (the CLI trains that many steps).
        value = _get(raw, "train.steps") or TrainConfig().steps
    _set(raw, key, value)
    return f"{value!r}, {argument}; put your value there"


def _get(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _auto_hint(key: str) -> str:
    return "nothing in the config determines it; put the value there"


def _normalise_legacy_shapes(raw: dict[str, Any]) -> dict[str, Any]:
    # Early DeepSpeed: "zero_optimization": true meant stage 1.
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        raw = {**raw, "zero_optimization": {"stage": 1 if zero else 0}}
    # DeepSpeed's torch_autocast (fp32 masters, autocast compute) is our bf16/fp16.
    autocast = raw.get("torch_autocast")
    if isinstance(autocast, dict):
        raw = {k: v for k, v in raw.items() if k != "torch_autocast"}
        if autocast.get("enabled"):
            dtype = str(autocast.get("dtype", "bfloat16")).removeprefix("torch.")
            section = "fp16" if dtype in ("float16", "half", "fp16") else "bf16"
            raw[section] = {**raw.get(section, {}), "enabled": True}
    return raw


def _renamed_value(key: str, value: Any) -> Any:
    # cpu_offload / cpu_offload_params were booleans; their successors name a device.
    if key.endswith(("cpu_offload", "cpu_offload_params", "cpu_offload_param")) and isinstance(value, bool):
        return "cpu" if value else "none"
    return value


def _flatten(node: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.append((path, value))
        # Free-form parameter dicts are not walked into, except for "auto" values.
        if isinstance(value, dict):
            out += _flatten(value, path + ".")
    return out


def in_schema(key: str) -> bool:
    """Whether ``key`` (dotted) is a field of our schema."""
    model: type[BaseModel] | None = Config
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return False
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return True


def _delete(raw: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value
