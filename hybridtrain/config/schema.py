"""The one typed configuration schema (pydantic v2), with DeepSpeed key names: the engine's sections
and :class:`Config`, the whole file (the CLI run's own sections are in :mod:`.run_sections`).

Every field's docstring is its documentation: the config reference (docs/configuration.md) is
generated from these modules (``python -m hybridtrain.config.reference``). Sections that DeepSpeed
also has use DeepSpeed's key names, so an existing ``ds_config.json`` loads; our own sections
(``model``, ``data``, ``train``) say what DeepSpeed leaves to the user's script.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hybridtrain.config.numbers import check_numbers
from hybridtrain.config.run_sections import (
    CSVMonitorConfig,
    DataConfig,
    FlopsProfilerConfig,
    MLflowConfig,
    ModelConfig,
    TensorBoardConfig,
    TrainConfig,
    WandbConfig,
)
from hybridtrain.config.section import Section
from hybridtrain.units import parse_bytes


class OptimizerConfig(Section):
    """Optimizer by name, as DeepSpeed's ``optimizer`` section."""

    type: str = "AdamW"
    """``Adam``/``AdamW`` as DeepSpeed builds them (``adam_w_mode`` defaults to true, so ``Adam``
    with weight decay is decoupled AdamW; ``weight_decay`` defaults to 0; ``bias_correction:
    false`` and ``torch_adam`` understood); DeepSpeed's ``Lamb``, and on one process its
    ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb``, with DeepSpeed's math; or any
    ``torch.optim`` class name (case-insensitive)."""
    params: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-3})
    """Keyword arguments of the optimizer class (``lr``, ``betas``, ``eps``, ``weight_decay`` …)."""


class SchedulerConfig(Section):
    """Learning-rate schedule, as DeepSpeed's ``scheduler`` section (stepped once per optimizer step)."""

    type: str = "constant"
    """DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and
    ``LRRangeTest`` with DeepSpeed's formulas, defaults (``warmup_type: log``, 1000 warm-up
    steps …) and step indexing; or our ``constant`` (warm-up then constant), ``linear``
    (then linear decay to 0 at ``total_num_steps``) and ``cosine`` (then cosine decay to
    ``cos_min_ratio``), whose warm-up is linear unless ``warmup_type: log``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The schedule's parameters, with DeepSpeed's names (``warmup_num_steps``,
    ``total_num_steps``, ``warmup_min_lr``/``warmup_max_lr``, ``warmup_min_ratio``,
    ``cos_min_ratio``, ``warmup_type``, ``cycle_*``, ``lr_range_test_*`` …)."""


class FP16Config(Section):
    """fp16 mixed precision with dynamic loss scaling (DeepSpeed semantics)."""

    enabled: bool = False
    """Run forward/backward under fp16 autocast; master weights stay fp32."""
    loss_scale: float = Field(default=0.0, ge=0.0)
    """0 = dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = Field(default=16, ge=0, le=64)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = Field(default=1000, ge=1)
    """Steps without overflow after which the scale doubles."""
    hysteresis: int = Field(default=2, ge=1)
    """Overflowing steps tolerated before the scale is shrunk (the step is skipped either way)."""
    min_loss_scale: float = Field(default=1.0, gt=0.0)
    """The scale never shrinks below this value."""
    auto_cast: bool = True
    """Accepted for DeepSpeed compatibility; hybridtrain always autocasts the forward pass."""


class BF16Config(Section):
    """bf16 mixed precision: autocast to bfloat16, fp32 master weights, no loss scaling."""

    enabled: bool = False
    """Run forward/backward under bfloat16 autocast."""


class OffloadOptimizerConfig(Section):
    """Where optimizer states and the update live (ZeRO-Offload)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """``cpu`` keeps fp32 master weights and optimizer states in host memory."""
    pin_memory: bool = False
    """Use page-locked host buffers for faster device↔host copies."""
    ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of the update done on the host (DeepSpeed's twin-flow ``ratio``)."""
    gpu_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of the update kept on the device (twin-flow); the same as ``ratio = 1 - gpu_ratio``."""
    gradients_wait: Literal["host", "device"] = "host"
    """Where offloaded gradients wait when the host step cannot take them as they land (clipping,
    fp16, ``nonfinite_loss: skip``, accumulation): ``host``, a 4-byte buffer per parameter in host
    memory; ``device``, on the device at the width backward gave them, streamed to the host step
    through a few pooled buffers (host: 12 bytes per AdamW parameter; the same math)."""
    device_share: Literal["last", "first"] = "last"
    """Which parameters Twin-Flow (``ratio`` below 1) updates on the device: ``last``, DeepSpeed's
    choice, or ``first``. Under layer streaming their blocks stay resident: with ``first`` a deferred
    host step (clipping, fp16) hides behind the next forward through them, with ``last`` their
    activations are freed first in backward (the room held gradients need). The same math either way;
    ``hybridtrain plan`` picks."""

    @model_validator(mode="before")
    @classmethod
    def _one_ratio(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or raw.get("gpu_ratio") is None:
            return raw
        gpu = raw["gpu_ratio"]
        if not isinstance(gpu, int | float) or not 0.0 <= gpu <= 1.0:
            return raw  # the field's own validation names the problem
        if "ratio" in raw and abs(float(raw["ratio"]) + gpu - 1.0) > 1e-9:
            raise ValueError(f"offload_optimizer.ratio = {raw['ratio']} and gpu_ratio = {gpu} disagree; "
                             "give one of them (ratio = 1 - gpu_ratio)")
        return {**raw, "ratio": 1.0 - gpu}


class OffloadParamConfig(Section):
    """Where parameters live between uses (ZeRO-3 offload)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """``cpu`` keeps parameters in host memory and fetches them for each use."""
    pin_memory: bool = False
    """Use page-locked host buffers."""


class ZeroConfig(Section):
    """ZeRO sharding of optimizer states (1), gradients (2) and parameters (3)."""

    stage: Literal[0, 1, 2, 3] = 0
    """0 = off; 1 shards optimizer states; 2 also gradients; 3 also parameters."""
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer offload (ZeRO-Offload)."""
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3)."""
    contiguous_gradients: bool = True
    """Accepted for DeepSpeed compatibility (a memory-layout hint with no effect on the math)."""
    overlap_comm: bool = True
    """Accepted for DeepSpeed compatibility: communication is always overlapped where possible."""
    reduce_bucket_size: int = Field(default=500_000_000, ge=1)
    """Elements per gradient bucket when gradients are reduced or offloaded."""
    allgather_bucket_size: int = Field(default=500_000_000, ge=1)
    """Accepted for DeepSpeed compatibility (bucket size of parameter all-gathers)."""
    stage3_prefetch_bucket_size: int = Field(default=50_000_000, ge=0)
    """Accepted for DeepSpeed compatibility (stage-3 prefetch size)."""
    stage3_param_persistence_threshold: int = Field(default=100_000, ge=0)
    """Accepted for DeepSpeed compatibility (small parameters stay unsharded)."""
    stage3_max_live_parameters: int = Field(default=1_000_000_000, ge=0)
    """Accepted for DeepSpeed compatibility."""
    stage3_max_reuse_distance: int = Field(default=1_000_000_000, ge=0)
    """Accepted for DeepSpeed compatibility."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Accepted for DeepSpeed compatibility: ``model_state_dict()`` is always gathered."""


class ActivationCheckpointingConfig(Section):
    """Activation checkpointing: keep block inputs, recompute the rest in backward. Under
    layer streaming (which recomputes its streamed blocks itself) it checkpoints the blocks
    that stay on the device: ``layer_streaming.resident`` and Twin-Flow's device share."""

    enabled: bool = False
    """Checkpoint the model's blocks."""
    every_n_blocks: int = Field(default=1, ge=1)
    """Checkpoint every n-th block (1 = all blocks; under layer streaming, every n-th block staying on
    the device): fewer checkpoints, more memory, less recompute."""
    module_classes: list[str] = Field(default_factory=list)
    """Checkpoint modules of these class names instead of the blocks (e.g. ``["GPT2Block"]``)."""
    cpu_checkpointing: bool = False
    """DeepSpeed: keep the checkpoints (block inputs) in host memory; the same as
    ``activation_offload.enabled`` for the checkpointed blocks (no effect without ``enabled``:
    DeepSpeed's section only configures checkpoints the model itself takes)."""


class ActivationOffloadConfig(Section):
    """Activation swapping (vDNN): tensors saved for backward inside the chosen blocks move
    to host memory during forward and come back, prefetched, ahead of their use in backward."""

    enabled: bool = False
    """Swap the saved activations of the blocks to host memory."""
    blocks: list[int] = Field(default_factory=list)
    """Indices of the blocks to swap (empty = every block). With activation checkpointing
    only the inputs of the checkpointed blocks are swapped."""
    prefetch_blocks: int = Field(default=1, ge=0)
    """In backward, start copying this many blocks ahead of the one computing back."""
    pin_memory: bool = True
    """Page-locked host buffers (needed for copies that overlap compute)."""
    min_bytes: int = Field(default=1024, ge=0)
    """Saved tensors smaller than this stay on the device (copies of tiny tensors cost more
    latency than the memory is worth)."""


class LayerStreamingConfig(Section):
    """Layer-to-layer streaming (L2L): the blocks' weights, gradients and optimizer state live
    in host memory; only the executing block(s) are on the device, and each block's host
    update runs as soon as its gradients are complete."""

    enabled: bool = False
    """Stream the blocks through the device."""
    prefetch_blocks: int = Field(default=1, ge=1)
    """Blocks uploaded ahead of the one computing (1 = double buffering); at most
    ``prefetch_blocks + 1`` blocks' weights are on the device at once."""
    layer_major: bool = False
    """Run each block over all micro-batches before the next block, so weights cross the
    bus once per step instead of once per micro-batch."""
    keep_blocks_for_backward: int = Field(default=0, ge=-1)
    """How many streamed blocks (the last ones) keep their uploaded weights on the device
    from their forward to their backward instead of uploading them again (-1 = all): fewer
    bytes up, more device memory. With all kept a half-width parameter crosses at 2 bytes
    per step layer-major, per micro-batch micro-batch-major (4 without keeping)."""
    boundary_activations: Literal["device", "host", "recompute"] = "recompute"
    """``recompute``: keep each block's input on the device and recompute the block in
    backward; ``host``: the same with the inputs swapped to host memory (device memory
    independent of depth); ``device``: keep all activations on the device (no recompute)."""
    resident: list[str] = Field(default_factory=list)
    """Module paths of blocks that stay on the device instead of streaming (e.g.
    ``["blocks.0"]``). Modules outside the blocks (embeddings, final norm, head) are always
    resident; their optimizer state lives in host memory."""
    pin_memory: bool = True
    """Page-locked host buffers for the blocks' weights and gradients."""
    half_images: Literal["kept", "per_upload"] = "kept"
    """Under bf16/fp16, the half copy of each block's Linear weights that crosses to the device:
    ``kept`` per block in host memory (2 bytes per such parameter; backward re-sends it), or
    ``per_upload``: cast from the masters into a few pooled host buffers at every upload
    (forward and backward), so the host holds none between uses. The same bits either way."""


class DataParallelConfig(Section):
    """Data parallel (DDP) over the replicas of the ``dp × tp × pp`` topology."""

    size: int = Field(default=-1, ge=-1)
    """Number of data-parallel replicas; -1 = the rest (world size / (tensor × pipeline sizes))."""
    gradient_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """Gradient all-reduce compression (DDP comm hook): ``none`` is exact; ``fp16``/``bf16``
    round gradients to half precision on the wire; ``powersgd`` sends low-rank factors."""
    powersgd_rank: int = Field(default=1, ge=1)
    """Rank of PowerSGD's low-rank gradient approximation (higher = closer to exact)."""
    powersgd_start_iter: int = Field(default=2, ge=2)
    """Exact all-reduce steps before PowerSGD starts compressing."""
    bucket_cap_mb: float = Field(default=25.0, gt=0.0)
    """DDP gradient bucket size in MiB."""



PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
"""Schedules that run several (virtual) stages per rank."""

class PipelineConfig(Section):
    """Pipeline parallel: the blocks split into consecutive stages, one rank per stage (or
    ``virtual_stages`` per rank), micro-batches flowing through them on a schedule."""

    stages: int = Field(default=1, ge=1)
    """Number of pipeline ranks (``pipeline_model_parallel_size`` is the same setting)."""
    schedule: PipelineSchedule = "1f1b"
    """``gpipe``: all forwards, then all backwards; ``1f1b``: one forward, one backward
    (at most ``stages`` micro-batches' activations in flight); ``interleaved_1f1b``: 1F1B
    over ``virtual_stages`` chunks per rank (smaller bubble); ``zero_bubble``: interleaved
    schedule that splits backward into input and weight gradients to fill the bubble."""
    micro_batches: int | None = Field(default=None, ge=1)
    """Micro-batches per step (= ``gradient_accumulation_steps``, which it sets when that is absent)."""
    virtual_stages: int = Field(default=1, ge=1)
    """Stages per rank for ``interleaved_1f1b`` / ``zero_bubble`` (chunks placed round-robin)."""
    partition: Literal["time", "params", "uniform"] | list[int] = "time"
    """How blocks are split into stages: ``time`` balances each block's measured forward +
    backward time (profiled once), ``params`` balances parameter counts, ``uniform`` gives
    equal block counts, or a list of blocks per stage (e.g. ``[3, 2, 2, 3]``)."""


class TensorParallelConfig(Section):
    """Tensor parallel (Megatron-style, on DTensor): attention and MLP weights sharded over
    ``size`` ranks, column-wise into a layer pair and row-wise out of it."""

    size: int = Field(default=1, ge=1)
    """Tensor-parallel degree (``tensor_model_parallel_size`` is the same setting)."""
    plan: dict[str, Literal["colwise", "rowwise"]] = Field(default_factory=dict)
    """Module path pattern → ``colwise``/``rowwise`` (``*`` matches one path component, e.g.
    ``{"blocks.*.attn.q": "colwise", "blocks.*.attn.out": "rowwise"}``); empty = the built-in
    plan for the reference GPT and Hugging Face models that publish one (Llama family)."""


class DistributedConfig(Section):
    """The process group of a multi-process run."""

    timeout_s: float = Field(default=600.0, gt=0.0, le=86400.0)
    """Seconds a collective may wait for the other ranks before the run ends with a message
    naming the rank that did not arrive (torch's own default is 30 minutes). Raise it when a
    rank legitimately works alone for long, e.g. writing a large checkpoint."""


class OOMRecoveryConfig(Section):
    """What an out-of-memory error inside a training step does: stop (off), or free the
    step's tensors, switch to a plan that needs less memory and computes the same math (the
    planner's choice, or the next of: no blocks kept for backward under layer
    streaming, checkpoint every block, swap activations, offload the optimizer, stream layers,
    smaller micro-batches with more accumulation at the same global batch) and rerun the same
    step from the same state. In ``hybridtrain train``, or a loop
    of your own through ``hybridtrain.recovery.oom.initialize_guarded`` (the model
    is rebuilt, so ``initialize(model, …)`` refuses it)."""

    enabled: bool = False
    """Recover from out-of-memory errors (logged once per switch)."""
    max_attempts: int = Field(default=3, ge=1)
    """Plan switches tried for one step before it stops with the numbers."""


class Config(Section):
    """The whole hybridtrain configuration."""

    train_batch_size: int | None = Field(default=None, ge=1)
    """Samples per optimizer step over all data-parallel ranks
    (= micro batch × accumulation steps × data-parallel size)."""
    train_micro_batch_size_per_gpu: int | None = Field(default=None, ge=1)
    """Samples per forward/backward pass on one rank."""
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    """Micro-batches whose gradients are summed before one optimizer step."""
    gradient_clipping: float = Field(default=0.0, ge=0.0)
    """Clip the global gradient L2 norm to this value (0 = off)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer (ignored when ``initialize`` is given one)."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule (none = constant)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision with loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bf16 mixed precision."""
    precision_math: Literal["deepspeed", "autocast"] | None = None
    """Which math ``bf16.enabled``/``fp16.enabled`` train with. ``deepspeed``: DeepSpeed's, as
    DeepSpeed 0.19.8 trains them: the module's parameters cast to the half dtype, gradients
    accumulated in it, fp32 masters in the optimizer, DeepSpeed's loss scaler and overflow skips
    (docs/deepspeed.md, "DeepSpeed's bf16 and fp16 math"; ZeRO-0/1/2/3, ZeRO-1/2/3 with
    ``offload_optimizer.device: cpu`` (ZeRO-3: the whole update, no partial ratio), ZeRO-3's
    parameter offload on several processes; no layer streaming, tensor or pipeline parallel;
    refused in one line elsewhere). ``autocast``: the
    forward under autocast over fp32 weights (hybridtrain's own, any technique). Unset: DeepSpeed's
    under the DeepSpeed drop-in (``deepspeed.initialize``) wherever it supports it, autocast
    under ``hybridtrain.initialize`` and ``hybridtrain train``."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO sharding and offload."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing."""
    activation_offload: ActivationOffloadConfig = Field(default_factory=ActivationOffloadConfig)
    """Activation swapping to host memory (vDNN)."""
    layer_streaming: LayerStreamingConfig = Field(default_factory=LayerStreamingConfig)
    """Layer-to-layer streaming of the blocks through the device (L2L)."""
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel degree (DeepSpeed/Megatron name of ``tensor_parallel.size``)."""
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """Pipeline-parallel degree (DeepSpeed/Megatron name of ``pipeline.stages``)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallel: stages, schedule, micro-batches, partition."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallel: size and sharding plan."""
    data_parallel: DataParallelConfig = Field(default_factory=DataParallelConfig)
    """Data parallel (DDP) and gradient compression."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Process-group settings (collective timeout)."""
    device_map: dict[str, str] = Field(default_factory=dict)
    """Naive model parallel inside one process: module path → device (e.g.
    ``{"blocks.0": "cuda:0", "blocks.1": "cuda:1"}``); activations move to each module's
    device before it runs and back to ``device`` after. Unlisted modules stay on ``device``."""
    steps_per_print: int = Field(default=10, ge=1)
    """Print a ``step=… loss=…`` line every n optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and optimizer step separately and report them per step, with
    the host↔device transfers, collectives and offloaded-optimizer waits inside them
    counted apart (``engine.last_timings``)."""
    zero_allow_untested_optimizer: bool = True
    """Accepted for DeepSpeed compatibility: any ``torch.optim`` optimizer is allowed."""
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    """Seed of model initialisation (CLI), data sampling and dropout (0 … 2^32 - 1)."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    nonfinite_loss: Literal["error", "skip"] = "error"
    """What an inf/NaN loss does without fp16 loss scaling: stop with the step number, or skip the step."""
    device_memory_limit: int | None = None
    """Device memory this process may use, in bytes or with a unit (``"24GiB"``, ``"512MB"``);
    none = all of it. On CUDA it caps the process's share of the device
    (``torch.cuda.set_per_process_memory_fraction``); on CPU the live tensor bytes of each
    training step are counted and an allocation past the limit is an out-of-memory error, so
    memory plans and ``oom_recovery`` can be tried without a GPU."""
    oom_recovery: OOMRecoveryConfig = Field(default_factory=OOMRecoveryConfig)
    """Out-of-memory recovery: rerun the step under a plan that needs less memory."""
    auto: bool = False
    """Let the planner choose how to train: ``initialize`` (``initialize_guarded``, ``hybridtrain train``)
    estimate every same-math variant of this config (micro-batch × accumulation,
    checkpointing, activation swapping, optimizer offload, layer streaming; the parallel
    split and ZeRO stage for several processes) on this machine's device and host memory
    and train the fastest that fits (``hybridtrain plan`` shows the ranking). DeepSpeed's
    ``autotuning.enabled`` maps here."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model built by the CLI and its block structure."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data for the CLI."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The CLI's training loop."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard event files of the CLI's runs (DeepSpeed's monitor section)."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV files of the CLI's runs (DeepSpeed's monitor section)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging of the CLI's runs (DeepSpeed's monitor section)."""
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    """MLflow tracking of the CLI's runs: the config as parameters and artifact, metrics by step."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """Profile two training steps of the CLI's runs (DeepSpeed's flops profiler)."""

    @model_validator(mode="before")
    @classmethod
    def _usable_numbers(cls, raw: Any) -> Any:
        check_numbers(raw)  # infinities, integers past 64 bits, typed optimizer/scheduler params
        return raw

    @field_validator("device_memory_limit", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> int | None:
        return None if value is None else parse_bytes(value)

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self
