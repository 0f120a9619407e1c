"""``deepspeed.pipe``'s model description: a list of layers run one after the other,
cut into pipeline stages, with layers that share one module across stages.

:class:`PipelineModule` is an ``nn.Module`` whose forward is the layer loop DeepSpeed
documents (``x = layer(x)`` for each layer, the input as the data loader gives it)::

    layers   [TiedLayerSpec("embed", Embedding), LayerSpec(Block) × n, TiedLayerSpec("embed", …, forward_fn)]
    parts    DeepSpeed's boundaries for num_stages (see :mod:`.partition`)
    blocks   self.layers: one module per layer (a function layer or a tied position gets a
             parameterless wrapper); hybridtrain's pipeline splits these blocks by parts
    tied     self.tied_modules[key]: built once, outside the blocks, used by every position
             of the key; the stages using it each hold it and their gradients are summed

Every layer is built here, on every process, in list order (one seed gives one model,
whatever the number of processes); ``hybridtrain.deepspeed.initialize`` frees the
layers of other stages when it splits the pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hybridtrain.deepspeed.pipe.partition import METHODS, method_parts
from hybridtrain.runtime.activations import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

log = logging.getLogger("hybridtrain.deepspeed")

_GPT_PIPES = ("GPTModelPipe", "GPT2ModelPipe")  # DeepSpeed's own checkpoint rule for these classes
_DEFAULT_SEED = 1234


class LayerSpec:
    """A layer described by its class and arguments, built by :class:`PipelineModule`.

    Args:
        typename: an ``nn.Module`` subclass.
        *module_args / **module_kwargs: its constructor's arguments.

    Raises:
        TypeError: ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec({typename!r}): the layer type must be an nn.Module subclass")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """A new module of this spec."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every position with the same ``key`` (e.g. an
    embedding reused as the output head).

    Args:
        key: positions with equal keys share one module, built at the first of them.
        typename / module_args / module_kwargs: as :class:`LayerSpec`.
        forward_fn: ``forward_fn(module, x)`` run at this position instead of ``module(x)``.
        tied_weight_attr: the attribute names DeepSpeed all-reduces between the stages;
            here every parameter of the module that several stages use has its gradient
            summed over them (the one-module math), so this only names what is expected.
    """

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class FunctionLayer(nn.Module):
    """A function in the layer list (``lambda x: torch.flatten(x, 1)``) as a block."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


class TiedLayer(nn.Module):
    """One position of a tied module. The module is held unregistered: it lives in
    ``PipelineModule.tied_modules``, outside the blocks, so the pipeline treats its
    parameters as shared by the stages whose positions use them."""

    _tied: nn.Module

    def __init__(self, key: str, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any] | None) -> None:
        super().__init__()
        self.key = key
        object.__setattr__(self, "_tied", module)
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        return self._tied(x) if self.forward_fn is None else self.forward_fn(self._tied, x)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule`` on hybridtrain: pass it to
    ``hybridtrain.deepspeed.initialize`` and train with ``engine.train_batch()``.

    Args:
        layers: ``nn.Module`` instances, :class:`LayerSpec` / :class:`TiedLayerSpec`, or
            functions of one argument (an ``nn.Sequential`` works too).
        num_stages: pipeline stages; ``world_size / num_stages`` data-parallel replicas.
            On one process every stage runs in that process (DeepSpeed would need
            ``num_stages`` processes); the math is the same.
        topology: DeepSpeed's ``PipeDataParallelTopology`` (or any object with
            ``get_dim``/``get_axis_names``) instead of ``num_stages``; a model-parallel axis
            above 1 is refused.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; without it the last
            layer's output is the loss.
        seed_layers: only False (per-layer reseeding is not implemented).
        seed_fn / base_seed: used by DeepSpeed with ``seed_layers`` only; no effect here either.
        partition_method: ``parameters`` (default), ``uniform`` or ``type:<regex>``, cut
            exactly as DeepSpeed cuts (:mod:`hybridtrain.deepspeed.pipe.partition`).
        activation_checkpoint_interval: DeepSpeed checkpoints each chunk of this many
            layers of a stage that holds parameters (0: none); here every layer with
            parameters in such a chunk is checkpointed (same math; it keeps each layer's
            input rather than each chunk's).
        activation_checkpoint_func: not called; torch's non-reentrant checkpoint (RNG
            state preserved) recomputes, with the same result.
        checkpointable_layers: class names allowed in a checkpointed chunk (DeepSpeed's rule).
        dynamic_shape: activation shapes that change from batch to batch (one process only).

    Raises:
        ValueError / TypeError: a bad or unsupported argument, before anything is built.
    """

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = _DEFAULT_SEED,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] | None = None,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        self.num_stages = _stage_count(num_stages, topology)
        if seed_layers:
            raise ValueError("PipelineModule(seed_layers=True) is not supported (per-layer reseeding of the random "
                             "generators); allowed: False — seed once with torch.manual_seed before building")
        if seed_fn is not None or base_seed != _DEFAULT_SEED:
            log.info("PipelineModule(seed_fn=…/base_seed=%s): no effect without seed_layers, as in DeepSpeed",
                     base_seed)
        if activation_checkpoint_func is not None:
            log.info("PipelineModule(activation_checkpoint_func=…): not called; layers are checkpointed with torch's "
                     "non-reentrant checkpoint (RNG state preserved), the same math")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"PipelineModule(checkpointable_layers={checkpointable_layers!r}) must be a list of "
                            "class names")
        _check_method(partition_method)
        interval = _interval(activation_checkpoint_interval)
        specs = list(layers)
        for index, spec in enumerate(specs):
            if isinstance(spec, PipelineModule):
                raise ValueError(f"PipelineModule: layer {index} is itself a PipelineModule; nesting is not "
                                 "supported (as in DeepSpeed); give its layers instead")
            if not isinstance(spec, LayerSpec | nn.Module) and not callable(spec):
                raise TypeError(f"PipelineModule: layer {index} is a {type(spec).__name__}; allowed: nn.Module, "
                                "LayerSpec, TiedLayerSpec or a function of one argument")
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.pipelined = False  # set when initialize splits the layers over processes
        self.reentrant_rule = True  # DeepSpeed's checkpoint is reentrant unless pipeline.use_reentrant is false
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._layer_specs = specs
        # forward_funcs: each layer as DeepSpeed's module sees it (for its checkpoint rule).
        self.forward_funcs: list[Any] = []
        self.layers = nn.ModuleList(self._block(spec) for spec in specs)
        self.parts = method_parts(partition_method, self.num_stages,
                                  [_trainable(_parameters_used(layer)) for layer in self.layers],
                                  [_name(spec) for spec in specs])
        self.activation_checkpoint_interval = 0
        self._checkpointed: list[nn.Module] = []
        self.set_checkpoint_interval(interval)

    # ------------------------------------------------------------------ building
    def _block(self, spec: Any) -> nn.Module:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:  # built once, at its first position
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
            tied = self.tied_modules[spec.key]
            self.forward_funcs.append(tied if spec.forward_fn is None else spec.forward_fn)
            return TiedLayer(spec.key, tied, spec.forward_fn)
        module = spec.build() if isinstance(spec, LayerSpec) else spec
        self.forward_funcs.append(module)
        return module if isinstance(module, nn.Module) else FunctionLayer(module)

    # ------------------------------------------------------------------ running
    def forward(self, forward_input: Any) -> Any:
        """Run the layers in order: ``x = layer(x)`` (tuples are passed whole, as in DeepSpeed)."""
        x = forward_input
        for layer in self.layers:
            x = layer(x)
        return x

    def flow(self, forward_input: Any) -> list[Any]:
        """What enters each layer and what leaves the last one (``n + 1`` values), from one
        forward without gradients; random generators and buffers are left as they were."""
        seen: list[Any] = []
        buffers = [b.detach().clone() for b in self.buffers()]
        cuda = sorted({p.device.index or 0 for p in self.parameters() if p.device.type == "cuda"})
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                x = forward_input
                for layer in self.layers:
                    seen.append(x)
                    x = layer(x)
                seen.append(x)
        finally:
            with torch.no_grad():
                for buffer, saved in zip(self.buffers(), buffers, strict=True):
                    buffer.copy_(saved)
        return seen

    # ------------------------------------------------------------------ DeepSpeed's queries
    def partitions(self) -> list[int]:
        """Stage boundaries: stage ``s`` holds layers ``parts[s]`` to ``parts[s + 1] - 1``."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``.

        Raises:
            IndexError: no such layer.
        """
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"stage_owner({layer_idx}): the module has {len(self.layers)} layers")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Extra losses to report (DeepSpeed's hook for subclasses); none."""
        return None

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint the layers with parameters of every chunk of ``interval`` layers of a
        stage that DeepSpeed would checkpoint (0: none).

        Raises:
            ValueError: a negative interval.
            RuntimeError: after ``initialize`` split the model into pipeline stages.
        """
        interval = _interval(interval)
        if self.pipelined:
            raise RuntimeError("set_checkpoint_interval: the pipeline is already split; call it before "
                               "deepspeed.initialize")
        remove_activation_checkpointing(self._checkpointed)
        self.activation_checkpoint_interval = interval
        self._checkpointed = [self.layers[i] for i in self._checkpoint_indices()]
        apply_activation_checkpointing(self._checkpointed)

    def _checkpoint_indices(self) -> list[int]:
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return []
        chosen = []
        for stage in range(self.num_stages):
            stop = self.parts[stage + 1]
            for start in range(self.parts[stage], stop, interval):
                chunk = range(start, min(start + interval, stop))
                if self._is_checkpointable([self.forward_funcs[i] for i in chunk]):
                    chosen += [i for i in chunk if any(True for _ in _parameters_used(self.layers[i]))]
        return chosen

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        """DeepSpeed's rule (``PipelineModule._is_checkpointable``): Megatron's GPT pipes
        checkpoint transformer layers (with the reentrant function); a given
        ``checkpointable_layers`` names the classes allowed; otherwise a chunk with
        parameters."""
        if self.reentrant_rule and type(self).__name__ in _GPT_PIPES:
            extra = self.checkpointable_layers or []
            return all("ParallelTransformerLayerPipe" in type(f).__name__ or type(f).__name__ in extra
                       for f in funcs)
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)


def _parameters_used(layer: nn.Module) -> Iterable[nn.Parameter]:
    return layer._tied.parameters() if isinstance(layer, TiedLayer) else layer.parameters()


def _trainable(params: Iterable[nn.Parameter]) -> int:
    # DeepSpeed counts a tied position's whole module, whatever its forward_fn uses.
    return sum(p.numel() for p in params if p.requires_grad)


def _name(spec: Any) -> str | None:
    """The name ``type:`` partitions match: the class of a spec or module, else the function's."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", None)


def _interval(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"PipelineModule(activation_checkpoint_interval={value!r}) must be an integer >= 0 "
                         "(0: no checkpointing)")
    return value


def _check_method(method: Any) -> None:
    if not isinstance(method, str) or not (method.lower() in ("parameters", "uniform")
                                           or method.lower().startswith("type:")):
        raise ValueError(f"PipelineModule(partition_method={method!r}) is not supported; use {METHODS}")


def _stage_count(num_stages: int | None, topology: Any) -> int:
    if topology is not None:
        axes = list(topology.get_axis_names()) if hasattr(topology, "get_axis_names") else ["pipe"]
        others = {axis: topology.get_dim(axis) for axis in axes if axis not in ("pipe", "data")}
        if any(size > 1 for size in others.values()):
            raise ValueError(f"PipelineModule(topology=…) has model-parallel axes {others}; only 'pipe' and 'data' "
                             "are supported: pass num_stages (replicas are the rest of the world)")
        num_stages = int(topology.get_dim("pipe"))
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages (or topology)")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"PipelineModule(num_stages={num_stages!r}) must be a positive integer")
    return num_stages
