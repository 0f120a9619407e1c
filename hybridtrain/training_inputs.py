"""What ``hybridtrain train`` trains, built from a config: the data, the model (checked on the meta
device against host memory first), one example batch, and the plan such a run would follow.

The training loop (:mod:`hybridtrain.trainer`) and the commands that plan or profile a run
(``hybridtrain config --plan``, ``hybridtrain profile``) build their inputs here, so they agree.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.config import Config, ConfigError
from hybridtrain.config.batch_sizes import resolve_batch_sizes
from hybridtrain.data import TokenBatches, load_tokens
from hybridtrain.models.factory import build_model, parameter_count
from hybridtrain.optim import optimizer_state_bytes
from hybridtrain.parallel.mesh import env_world_size
from hybridtrain.plan import TrainingPlan, resolve
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.transfer import available_host_bytes


def plan_training(cfg: Config, world_size: int | None = None) -> TrainingPlan:
    """The plan ``hybridtrain train`` would follow, for a model built on the meta device
    (no memory, no initialisation: any size can be planned on a laptop).

    Raises:
        ConfigError / ValueError: as :func:`run_training` would, before training.
    """
    with torch.device("meta"):
        data, model = data_and_model(cfg)
    return resolve(cfg, model, world_size, example_batch=example_batch(cfg, data))


def data_and_model(cfg: Config, fits_host: bool = False) -> tuple[TokenBatches, nn.Module]:
    """The data and the model; with ``fits_host``, first check on the meta device that the
    model's weights fit in host memory (a typo such as ``n_layer: 100000`` is one line, not
    an allocation that runs the machine into swap)."""
    tokens = load_tokens(cfg.data.path)
    data = TokenBatches(tokens, cfg.data.seq_len, cfg.data.val_fraction, cfg.seed, cfg.data.path)
    vocab = int(cfg.model.overrides.get("vocab_size", max(256, data.max_token + 1)))
    if data.max_token >= vocab:
        raise ValueError(f"data tokens go up to {data.max_token} but model.overrides.vocab_size = {vocab}")
    if fits_host:
        count = parameter_count(cfg.model.name, cfg.model.overrides, vocab, cfg.data.seq_len)
        # The model is built in host memory; training on the CPU also keeps its gradients
        # and the optimizer's state there (a lower bound: activations come on top).
        on_cpu = resolve_device(cfg.device).type == "cpu"
        per_param = 4 + 4 + optimizer_state_bytes(cfg.optimizer.type, cfg.optimizer.params) if on_cpu else 4
        needed, available = per_param * count, available_host_bytes()
        if needed > available:
            state = "Adam moments" if "adam" in cfg.optimizer.type.lower() else f"{cfg.optimizer.type} state"
            what = f"fp32 weights, gradients and {state}" if on_cpu else "fp32 weights"
            raise ValueError(f"model {cfg.model.name} with model.overrides {cfg.model.overrides} has "
                             f"{count / 1e9:.2f} B parameters: {needed / 2**30:.1f} GiB of {what}, more than "
                             f"the {available / 2**30:.1f} GiB of host memory available")
        batch = _batch_bytes(cfg, vocab, on_cpu)
        if batch is not None and needed + batch > available:
            what = "token ids, one micro-batch's logits and their gradient" if on_cpu else "token ids"
            raise ValueError(f"train_batch_size = {cfg.train_batch_size}, train_micro_batch_size_per_gpu = "
                             f"{cfg.train_micro_batch_size_per_gpu} with data.seq_len = {cfg.data.seq_len} need at "
                             f"least {batch / 2**30:.1f} GiB of host memory for the batch ({what}), more than the "
                             f"{(available - needed) / 2**30:.1f} GiB left beside the model; use a smaller batch "
                             "(gradient_accumulation_steps keeps the global batch)")
    return data, build_model(cfg.model.name, cfg.model.overrides, vocab, cfg.data.seq_len, cfg.seed)


def _batch_bytes(cfg: Config, vocab: int, on_cpu: bool) -> int | None:
    """A lower bound of the host bytes one step's batch takes: the global batch's token ids
    (int64 inputs and targets, drawn at once) and, training on the CPU, one micro-batch's
    fp32 logits and their gradient. None when the batch sizes do not resolve (the plan
    says why, later)."""
    try:
        # The largest data-parallel size this launch allows gives the smallest micro-batch.
        sizes = resolve_batch_sizes(cfg, env_world_size())
    except ConfigError:
        return None
    tokens = 2 * 8 * sizes.global_batch * cfg.data.seq_len
    logits = 2 * 4 * sizes.micro_batch * cfg.data.seq_len * vocab if on_cpu else 0
    return tokens + logits


def example_batch(cfg: Config, data: TokenBatches) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of ``data``: pipelines are split at initialize from one traced
    forward of it."""
    return data.train_batch(0, cfg.train_micro_batch_size_per_gpu or 1)
