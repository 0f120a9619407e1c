"""The sections the CLI's run reads and the engine never does: which model and data ``hybridtrain train``
builds, its loop, DeepSpeed's monitors (TensorBoard, CSV, W&B), MLflow tracking and its flops profiler.

DeepSpeed leaves these to the user's script; the monitor and profiler sections keep DeepSpeed's key names
so a ``ds_config.json`` that has them loads.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from hybridtrain.config.section import Section


class ModelConfig(Section):
    """Which model the CLI builds, and where its repeated blocks are."""

    name: str = "gpt-tiny"
    """``gpt-<size>`` for the reference GPT (``gpt-tiny`` … ``gpt-13b``), or ``hf:<model_type>``
    (e.g. ``hf:gpt2``, ``hf:llama``) for a randomly initialised Hugging Face model."""
    blocks: str | list[str] | None = None
    """Dotted path to the ModuleList of repeated blocks (e.g. ``transformer.h``), or a list
    of paths for models with several (``["encoder.block", "decoder.block"]`` of T5); found
    automatically when absent, every block list of an encoder–decoder model included."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields that override the named size (reference GPT) or the Hugging Face config
    (e.g. ``{"n_layer": 4}``)."""


class DataConfig(Section):
    """The training text for the CLI."""

    path: str | None = Field(default=None, pattern=r"^[^\x00]*$")
    """A UTF-8 text file, or a ``.npy``/``.bin`` token file (uint8/uint16/int32/int64);
    empty = the embedded corpus."""
    seq_len: int = Field(default=128, ge=2)
    """Tokens per sample."""
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of the tokens held out for evaluation."""


class TrainConfig(Section):
    """The CLI's training loop."""

    steps: int = Field(default=100, ge=1)
    """Optimizer steps to train for."""
    output_dir: str = Field(default="runs/default", min_length=1, pattern=r"^[^\x00]*$")
    """Where metrics (``metrics.jsonl``) and checkpoints go (a path: no NUL character)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every n steps (0 = only at the end)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """How many recent checkpoints to keep."""
    checkpoint_async: bool = False
    """Write checkpoints in the background: training continues once the state is copied to
    host memory (one extra copy of this rank's shard), and the next save waits for the last."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate on held-out data every n steps (0 = only at the end)."""
    eval_batches: int = Field(default=4, ge=1)
    """Batches per evaluation."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus metrics (``hybridtrain_*``: loss, learning rate, tokens/s, TFLOP/s,
    MFU, step-time parts, device memory, checkpoints, restarts; every series labelled
    ``rank``) at ``http://metrics_host:PORT/metrics`` while training; 0 = off (also
    ``--metrics-port``). With several processes per node each rank serves on
    ``PORT + LOCAL_RANK``. Needs ``prometheus_client`` (``pip install 'hybridtrain[monitor]'``).
    MFU is exposed only where the device's peak is known (H100, H200, A100, or
    ``peak_tflops``); on CPU ``hybridtrain_mfu`` is absent."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds to (``0.0.0.0`` to be scraped from other hosts)."""
    metrics_linger_s: float = Field(default=0.0, ge=0.0)
    """Keep serving ``/metrics`` this many seconds after training ends, so a scraper
    catches the final values (SIGTERM/Ctrl-C ends the wait)."""
    peak_tflops: float | None = Field(default=None, gt=0.0)
    """Peak TFLOP/s of one device for MFU (default: the dense bf16 peak of H100/H200/A100
    from the device name; unknown elsewhere)."""


class TensorBoardConfig(Section):
    """DeepSpeed's TensorBoard monitor: each step's metrics as TensorBoard scalars, under
    our names (``hybridtrain/loss`` … by step) and DeepSpeed's (``Train/Samples/train_loss``,
    ``lr``, ``loss_scale`` by samples seen). Rank 0 writes. Needs the ``tensorboard`` package."""

    enabled: bool = False
    """Write TensorBoard event files (``hybridtrain train``)."""
    output_path: str = ""
    """Directory of the job directories; empty = ``train.output_dir`` (DeepSpeed: the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The event files go to ``output_path/job_name``."""


class CSVMonitorConfig(Section):
    """DeepSpeed's CSV monitor: one CSV file per metric (``hybridtrain_loss.csv``,
    ``Train_Samples_train_loss.csv`` …, a ``step,<name>`` header then one row per step), as
    DeepSpeed writes them. Rank 0 writes."""

    enabled: bool = False
    """Write CSV files (``hybridtrain train``)."""
    output_path: str = ""
    """Directory of the job directories; empty = ``train.output_dir`` (DeepSpeed: the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The CSV files go to ``output_path/job_name``."""


class WandbConfig(Section):
    """DeepSpeed's Weights & Biases monitor: each step's metrics under our and DeepSpeed's
    names. Rank 0 logs. Needs the ``wandb`` package (refused in one line when it is missing).
    Without ``WANDB_MODE`` set, a run that cannot reach the W&B server logs offline. The run is
    named after the training service's job (else ``train.output_dir``'s last part), and a
    resumed run continues it (its id is kept in ``train.output_dir/wandb_run.json``)."""

    enabled: bool = False
    """Log to W&B (``hybridtrain train``)."""
    group: str | None = None
    """W&B group of the run."""
    team: str | None = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project (DeepSpeed's default name)."""


#: Tracking-URI schemes MLflow's client stores runs under (a plain directory is taken too).
MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")


class MLflowConfig(Section):
    """MLflow tracking of ``hybridtrain train`` runs (and so of the training service's jobs): the
    config as parameters (flattened, ``optimizer.params.lr``…) and as the artifact ``config.json``,
    and each metrics.jsonl field (``loss``, ``lr``, ``eval_loss``, ``tokens_per_s``…) as a metric
    by step. Rank 0 logs; a resumed run logs into the same MLflow run. Needs the ``mlflow`` (or
    ``mlflow-skinny``) package: ``pip install 'hybridtrain[tracking]'``."""

    enabled: bool = False
    """Log to MLflow (``hybridtrain train``)."""
    tracking_uri: str = Field(default="", pattern=r"^[^\x00]*$")
    """Where runs go: a tracking server (``http://HOST:5000``), a database (``sqlite:///mlflow.db``) or
    a directory (MLflow 3 refuses directories unless ``MLFLOW_ALLOW_FILE_STORE=true``); empty =
    ``$MLFLOW_TRACKING_URI``, else MLflow's default (MLflow 3: ``sqlite:///mlflow.db`` in the
    working directory; before: ``./mlruns``). A store that cannot be used (a server that does not
    answer) is refused in one line before training starts."""
    experiment: str = Field(default="hybridtrain", min_length=1)
    """MLflow experiment of the run (created when missing)."""
    run_name: str = ""
    """Name of the run; empty = the training service's job name (``$HYBRIDTRAIN_JOB_NAME``), else
    the last part of ``train.output_dir``."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags set on the run (the service's job name is added as ``hybridtrain.job``)."""

    @field_validator("tracking_uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme = value.split(":", 1)[0].lower() if "://" in value or value == "databricks" else ""
        if scheme and scheme.split("+", 1)[0] not in MLFLOW_SCHEMES:
            raise ValueError(f"scheme {scheme!r} is not one MLflow tracks runs under; give a directory or a URI of "
                             + ", ".join(MLFLOW_SCHEMES))
        return value


class FlopsProfilerConfig(Section):
    """Profile two steps of ``hybridtrain train`` (DeepSpeed's ``flops_profiler``; the same
    profile as ``hybridtrain profile``): FLOPs forward and backward, saved activations and
    time per module, the step split into parts, TFLOP/s and MFU, a diagnosis, a Chrome
    trace and a memory timeline. Rank 0 only, as DeepSpeed's."""

    enabled: bool = False
    """Profile once, at ``profile_step``."""
    profile_step: int = Field(default=1, ge=0)
    """Optimizer steps completed before the profiled one (DeepSpeed's rule,
    ``global_steps == profile_step``): that step is counted (FLOPs, memory) and the next
    one timed; both train as usual."""
    output_file: str | None = None
    """Where the printed profile goes (none: stdout); ``profile.json``, ``trace.json`` and
    ``memory.png`` are written next to it (none: in ``<train.output_dir>/profile``)."""
