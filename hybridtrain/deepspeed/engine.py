"""``DeepSpeedEngine``: DeepSpeed's engine surface over a :class:`hybridtrain.Engine`.

An adapter that holds the engine (composition): forward/backward/step with DeepSpeed's
accumulation rules, the size and rank queries, and checkpoints laid out as DeepSpeed's
(``save_dir/tag`` plus a ``latest`` file naming the newest tag).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.config import Config
from hybridtrain.deepspeed import weights
from hybridtrain.deepspeed.checkpoint import files, loader, writer, zero3
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer
from hybridtrain.engine import Engine

LATEST = "latest"


def cast_inputs_half(inputs: Any) -> Any:
    """``inputs`` with every floating tensor cast to fp16, through lists, tuples and dicts
    (DeepSpeed's ``_cast_inputs_half``)."""
    if isinstance(inputs, list | tuple):
        return inputs.__class__(cast_inputs_half(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: cast_inputs_half(v) for k, v in inputs.items()}
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.half()
    return inputs


class DeepSpeedEngine(nn.Module):
    """What ``deepspeed.initialize`` returns first, backed by a hybridtrain ``Engine``.

    ``engine(x)`` runs the forward under the configured precision; ``backward(loss)``
    accumulates ``loss / gradient_accumulation_steps``; ``step()`` after every micro-batch
    updates at each accumulation boundary and then clears the gradients, as DeepSpeed does.
    Attributes of the model are readable on the engine (``engine.config_attr``), as in DeepSpeed.
    """

    def __init__(self, engine: Engine, config: Config, training_dataloader: Any = None,
                 raw_config: dict[str, Any] | None = None) -> None:
        # An nn.Module holding the model as its child ``module``, as DeepSpeed's engine is:
        # frameworks find it among a model's modules (Fabric) and read ``module.``-prefixed names.
        super().__init__()
        self.engine = engine
        if engine is not None:
            self.add_module("module", engine.module)
        self._config = config
        self.config: dict[str, Any] = raw_config if raw_config is not None else config.model_dump()
        """The DeepSpeed config as given (a dict, as DeepSpeed's ``engine.config``)."""
        self.training_dataloader = training_dataloader
        self._step_applied = False
        self._compiled = False
        self._grad_norm: float | None = None
        self.callers_optimizer: torch.optim.Optimizer | None = None
        """The optimizer the caller gave ``initialize`` when the engine updates through another
        (rebuilt, or the host optimizer of an offload) sharing its param groups."""

    # ------------------------------------------------------------ forward / backward / step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; with DeepSpeed's fp16 math and ``fp16.auto_cast`` (off by
        default, as in DeepSpeed) floating positional inputs are cast to fp16 first, as
        DeepSpeed's ``_cast_inputs_half`` (keyword inputs are not)."""
        if self._casts_inputs_half():
            args = cast_inputs_half(args)
        return self.engine(*args, **kwargs)

    def _casts_inputs_half(self) -> bool:
        fp16 = self.config.get("fp16") if isinstance(self.config, dict) else None
        wrapper = self._master_weights()
        return isinstance(fp16, dict) and fp16.get("auto_cast") is True and wrapper is not None \
            and wrapper.loss_scale is not None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (of ``loss`` with
        ``scale_wrt_gas=False``); returns the scaled loss, as DeepSpeed.

        Several ``backward`` calls before one ``step`` (e.g. a GAN's real and fake losses)
        add up, as in DeepSpeed.
        """
        if retain_graph:
            raise NotImplementedError("backward(retain_graph=True) is not supported by hybridtrain.deepspeed")
        accumulation = self.gradient_accumulation_steps()
        # Under DeepSpeed's bf16/fp16 math the engine asks its wrapper (engine.own_precision) to
        # scale the loss and to average the gradients after the backward.
        self.engine.backward(loss if scale_wrt_gas else loss * accumulation)
        return loss / accumulation if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End of a micro-batch: at the accumulation boundary, clip, update, schedule and
        clear the gradients. A step skipped for inf/NaN gradients updates nothing and, as in
        DeepSpeed, does not advance the LR schedule (it still counts as a global step)."""
        if lr_kwargs:
            raise NotImplementedError("step(lr_kwargs=…) is not supported by hybridtrain.deepspeed")
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        wrapper = self._master_weights()
        if boundary and self._config.gradient_clipping <= 0 and wrapper is None:
            # DeepSpeed reports the norm with clipping off too; the engine measures it only to clip.
            self._grad_norm = weights.grad_norm(self.engine)
        # Clears the gradients after the update, as DeepSpeed; a step DeepSpeed's bf16/fp16 wrapper
        # skipped holds the LR schedule back (engine.own_precision).
        self.engine.step()
        if boundary:
            self._step_applied = self.engine.skipped_steps == skipped
            if self.callers_optimizer is not None:
                # DeepSpeed steps the caller's optimizer itself, so torch's schedulers built on it
                # (Accelerate's) see it stepped; here another optimizer updated through its groups.
                self.callers_optimizer._opt_called = True  # type: ignore[attr-defined]
            if wrapper is not None:  # DeepSpeed's bf16/fp16 wrapper measured it
                self._grad_norm = wrapper.last_grad_norm
            elif self._config.gradient_clipping > 0 and self.engine.last_grad_norm is not None:
                self._grad_norm = float(self.engine.last_grad_norm)

    def _master_weights(self) -> MasterWeightsOptimizer | None:
        wrapper = self.engine.optimizer
        return wrapper if isinstance(wrapper, MasterWeightsOptimizer) else None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends the accumulation window: as set by
        :meth:`set_gradient_accumulation_boundary`, else every ``gradient_accumulation_steps``-th."""
        return self.engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the current micro-batch ends the accumulation window, as Accelerate
        (and Hugging Face's Trainer through it) does before every ``backward``: its
        ``step()`` updates then. Backward still scales by 1/``gradient_accumulation_steps``."""
        self.engine.set_gradient_accumulation_boundary(bool(is_boundary))

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the latest optimizer step; None before
        the first, as DeepSpeed."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        """Whether the latest boundary ``step()`` updated the parameters (no fp16 overflow)."""
        return self._step_applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (always to None, as DeepSpeed's engine)."""
        for param in self.module.parameters():
            param.grad = None

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = mode
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def compile(self, backend: str | None = None, compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the model in place (``nn.Module.compile``), as DeepSpeed's
        ``engine.compile()`` does without DeepCompile; the model's math is unchanged. The
        backend defaults to the accelerator's (``inductor``); a second call does nothing."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError("compile(schedule=…/compiled_autograd_enabled=True): DeepCompile's passes "
                                      "are not supported by hybridtrain.deepspeed")
        if self._compiled:
            return
        from hybridtrain.deepspeed.accelerator import get_accelerator

        self.module.compile(**{**(compile_kwargs or {}), "backend": backend or get_accelerator().get_compile_backend()})
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` has run."""
        return self._compiled

    def destroy(self) -> None:
        """Nothing to release (the process group stays up, as in DeepSpeed)."""

    # ------------------------------------------------------------------ readings
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        # Lightning sets None to step the scheduler itself, as DeepSpeed lets it.
        self.engine.scheduler = scheduler

    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @property
    def global_samples(self) -> int:
        return self.engine.global_step * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        return self.engine.global_step * self.gradient_accumulation_steps() + self.engine.micro_step

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def global_rank(self) -> int:
        return self.engine.topology.rank

    @property
    def world_size(self) -> int:
        return self.engine.topology.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def dp_world_size(self) -> int:
        return self.engine.options.batch.data_parallel

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.options.batch.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.engine.options.batch.accumulation_steps

    def train_batch_size(self) -> int:
        return self.engine.options.batch.global_batch

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_mom(self) -> list[Any]:
        return [group.get("betas", (group.get("momentum"),))[0] for group in self.engine.optimizer.param_groups]

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def steps_per_print(self) -> int:
        return self._config.steps_per_print

    @property
    def loss_scale(self) -> float:
        wrapper = self._master_weights()
        return wrapper.cur_scale if wrapper is not None else self.engine.loss_scale

    # ------------------------------------------------------------------ weights
    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_optimization.stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The whole model's state dict (CPU copies; a collective under ZeRO/TP/PP)."""
        state = self.engine.model_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {prefix + k: v for k, v in state.items()}

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Any:
        """See :func:`hybridtrain.deepspeed.weights.consolidated_state_dict`."""
        return weights.consolidated_state_dict(self.engine, self._config, exclude_frozen_parameters)

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """See :func:`hybridtrain.deepspeed.weights.save_16bit_model`."""
        return weights.save_16bit_model(self.engine, self._config, save_dir, save_filename,
                                        exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: Any = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save to ``save_dir/tag`` (default tag ``global_step{N}``) and, with ``save_latest``,
        write the tag to ``save_dir/latest``. Call it on every rank.

        Without ZeRO (fp32) and under ZeRO-1/2 the files are DeepSpeed's own
        (:mod:`hybridtrain.deepspeed.checkpoint.writer`): the real DeepSpeed resumes them and
        its ``zero_to_fp32`` reads them; so are bf16 runs with DeepSpeed's math
        (:mod:`hybridtrain.deepspeed.master_weights`) and ZeRO-3 runs in fp32 or with DeepSpeed's
        bf16/fp16 math (a model-states and an optimizer file per data-parallel rank). Tensor/pipeline
        parallel and other 16-bit runs write hybridtrain's sharded checkpoint in the tag directory instead."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if exclude_frozen_parameters:
            raise NotImplementedError("save_checkpoint(exclude_frozen_parameters=True) is not supported")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        if self.writes_deepspeed_layout():
            writer.save(self.engine, self._config, self.config, Path(save_dir) / tag, client_state or {})
        else:
            self.engine.save_checkpoint(Path(save_dir) / tag, client_state or {})
        if save_latest and self.global_rank == 0:
            latest = Path(save_dir) / LATEST
            tmp = latest.with_name(f".{LATEST}.tmp-{os.getpid()}")
            tmp.write_text(tag)
            tmp.replace(latest)
        return True

    def writes_deepspeed_layout(self) -> bool:
        """Whether :meth:`save_checkpoint` writes DeepSpeed's files (see there)."""
        topology = self.engine.topology
        stage = self._config.zero_optimization.stage
        half = self._config.bf16.enabled or self._config.fp16.enabled
        master = isinstance(self.engine.optimizer, MasterWeightsOptimizer)
        return topology.tp == 1 and topology.pp == 1 and (stage in (1, 2) or (stage == 0 and (master or not half))
                                                          or (stage == 3 and (master or not half)))

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (``tag`` read from ``load_dir/latest`` when None): DeepSpeed's
        files (the real DeepSpeed's ZeRO-0/1/2 checkpoints, or the drop-in's) or hybridtrain's.

        Returns:
            ``(path, client_state)``: the model-states file (DeepSpeed's layout) or the tag directory
            (hybridtrain's); ``(None, None)`` when no tag is given and there is no
            ``latest`` file, as DeepSpeed.
        """
        if not load_module_strict or custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(load_module_strict=False / custom_load_fn) is not supported")
        if tag is None:
            latest = Path(load_dir) / LATEST
            if not latest.is_file():
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / str(tag)
        if files.is_deepspeed_layout(path):
            # DeepSpeed returns the model-states file's path here (this rank's under ZeRO-3).
            states = zero3.model_states_name(self.engine.topology.dp_rank) if zero3.is_zero3_layout(path) \
                else files.MODEL_STATES
            return str(path / states), loader.load(self.engine, path, load_optimizer_states,
                                                   load_lr_scheduler_states, load_module_only)
        if load_module_only:
            return str(path), self.engine.load_checkpoint(path, model_only=True)
        optimizer_state = None if load_optimizer_states else copy.deepcopy(self.engine.optimizer.state_dict())
        scheduler = self.engine.scheduler
        scheduler_state = None if load_lr_scheduler_states or scheduler is None else copy.deepcopy(
            scheduler.state_dict())
        groups = self.engine.optimizer.param_groups
        client_state = self.engine.load_checkpoint(path)
        if optimizer_state is not None:
            self.engine.optimizer.load_state_dict(optimizer_state)
        # Loading gave the optimizer a new group list; the caller's optimizer and schedulers
        # hold the old one (see building.build_engine): it gets the loaded groups.
        groups[:] = self.engine.optimizer.param_groups
        self.engine.optimizer.param_groups = groups
        if scheduler_state is not None and scheduler is not None:
            scheduler.load_state_dict(scheduler_state)
        return str(path), client_state

    # ------------------------------------------------------------------ internals
    def __getattr__(self, name: str) -> Any:
        # nn.Module's children, parameters and buffers first; then, as DeepSpeed's engine,
        # the wrapped model's attributes.
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name.startswith("__") or name in ("engine", "_modules", "_parameters", "_buffers"):
            raise AttributeError(name)
        module = self.engine.module
        if hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'DeepSpeedEngine' (hybridtrain.deepspeed) has no attribute {name!r}, and the "
                             "model has none either")
