"""The shared equivalence suite: N steps of the engine must equal a plain PyTorch loop.

A *model case* builds a model deterministically and yields its batches; a *mode* is a
config fragment (one technique or a combination) plus what the plain loop must do to be
the same math (autocast dtype, clipping, schedule). Later techniques add a ``Mode`` to
``MODES`` — not a new suite. The plain loop below is written out by hand on purpose: it is
the specification the engine is checked against, and shares no code with the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss

SEED = 1234
STEPS = 4
BATCH = 8
# Adam divides each gradient element by its running RMS, so an element whose gradient is
# at the rounding level gets an O(lr) update either way; a larger eps keeps such elements
# from turning summation-order noise into visible parameter differences.
LR = 1e-3
OPTIMIZER = {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6, "weight_decay": 0.01}}


def reduced_precision_tolerance(dtype: torch.dtype, steps: int = STEPS) -> tuple[float, float]:
    """``(rtol, atol)`` for an engine run under ``dtype`` autocast against the plain loop,
    derived from the precision, not measured on one machine.

    Both sides run the same ops on the same kernels (the plain loop takes the engine's
    optimizer kernel: :func:`plain_optimizers`), so most runs agree bit for bit on any CPU.
    Where the engine adds the same terms in another order (a weight tied between the head
    and the embeddings under layer-major accumulation sums every micro-batch's head part
    before the embedding parts), a sum lands one rounding away, and under autocast that
    can move one half-precision rounding downstream: a relative ``u`` = unit roundoff =
    ``eps / 2`` (2^-8 for bf16, 2^-11 for fp16). Counting one such rounding per step that
    reaches the loss and the fp32 master weights gives ``rtol = steps · u`` (1/64 for bf16
    over the suite's 4 steps). An element near zero moves by AdamW's normalised update,
    whose difference is at most ``lr · u`` per step where its gradient is well above the
    rounding level: ``atol = steps · lr · u``. An element whose true gradient is zero (a
    key projection's bias: softmax ignores a shift shared by every key) has a gradient of
    pure rounding noise, which Adam scales to a full ``lr``; it stays equal only where both
    sides round identically, which is why the kernels must be the same, not merely close.
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    return steps * unit_roundoff, steps * LR * unit_roundoff


@dataclass(frozen=True)
class ModelCase:
    """A model shape the suite covers."""

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[int], list[Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    plain_loss: Callable[[nn.Module, Any], torch.Tensor]
    """The loss as a plain loop computes it (written independently of the engine)."""


@dataclass(frozen=True)
class Mode:
    """A technique (or combination) under test and the plain loop's matching settings."""

    name: str
    config: dict[str, Any]
    autocast_dtype: torch.dtype | None = None
    clip: float = 0.0
    lr_lambda: Callable[[int], float] | None = None
    rtol: float = 1e-5
    atol: float = 1e-6
    """fp32 tolerances; modes under autocast use :func:`reduced_precision_tolerance` instead
    (an ``atol`` given explicitly is kept when it is larger)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.autocast_dtype is not None:
            rtol, atol = reduced_precision_tolerance(self.autocast_dtype)
            object.__setattr__(self, "rtol", max(self.rtol, rtol))
            object.__setattr__(self, "atol", max(self.atol, atol))


class MLPStack(nn.Sequential):
    """``nn.Sequential`` regression model."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _regression_batches(steps: int) -> list[Any]:
    gen = torch.Generator().manual_seed(SEED)
    return [(torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 4, generator=gen)) for _ in range(steps)]


def _token_batches(vocab: int, seq: int) -> Callable[[int], list[Any]]:
    def make(steps: int) -> list[Any]:
        gen = torch.Generator().manual_seed(SEED)
        out = []
        for _ in range(steps):
            tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=gen)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out
    return make


def _hf_batches(vocab: int, seq: int) -> Callable[[int], list[Any]]:
    def make(steps: int) -> list[Any]:
        gen = torch.Generator().manual_seed(SEED)
        out = []
        for _ in range(steps):
            ids = torch.randint(0, vocab, (BATCH, seq), generator=gen)
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out
    return make


def _plain_token_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[1].reshape(-1))


def gpt_case(dropout: float = 0.0) -> ModelCase:
    """Reference GPT: a ModuleList of blocks with tied embeddings."""
    cfg = GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16, vocab_size=64, dropout=dropout)
    return ModelCase(
        name=f"gpt_tied{'_dropout' if dropout else ''}",
        build=lambda: GPT(cfg),
        batches=_token_batches(64, 16),
        loss_fn=causal_lm_loss,
        plain_loss=_plain_token_loss,
    )


def frozen_gpt_case() -> ModelCase:
    """The reference GPT with frozen parameters (``requires_grad`` False), as a fine-tune
    has them: the position embedding, a frozen weight beside a trained bias (block 0's
    ``qkv``), a wholly frozen block (1), a frozen sub-layer (block 2's ``ln_1`` and ``attn``).
    Backward still reads frozen weights; no optimizer may move them."""
    base = gpt_case()

    def build() -> nn.Module:
        model = base.build()
        model.pos_emb.weight.requires_grad_(False)
        model.blocks[0].attn.qkv.weight.requires_grad_(False)
        model.blocks[1].requires_grad_(False)
        model.blocks[2].ln_1.requires_grad_(False)
        model.blocks[2].attn.requires_grad_(False)
        return model

    return dataclasses.replace(base, name="gpt_frozen", build=build)


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _plain_hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def model_cases() -> dict[str, ModelCase]:
    """Every model shape: Sequential, ModuleList with tied embeddings, HF GPT-2 and Llama."""
    cases = {
        "sequential": ModelCase("sequential", MLPStack, _regression_batches,
                                lambda out, batch: F.mse_loss(out, batch[1]),
                                lambda model, batch: F.mse_loss(model(batch[0]), batch[1])),
        "gpt_tied": gpt_case(),
    }
    cases["hf_gpt2"] = ModelCase("hf_gpt2", _hf_gpt2, _hf_batches(64, 16), None, _plain_hf_loss)
    cases["hf_llama"] = ModelCase("hf_llama", _hf_llama, _hf_batches(64, 16), None, _plain_hf_loss)
    return cases


def _warmup_cosine(step: int) -> float:
    # Written out independently of hybridtrain.optim: warm-up 2 steps, cosine to 0.1 at step 6.
    if step < 2:
        return step / 2
    done = min(1.0, (step - 2) / 4)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))


MODES: dict[str, Mode] = {
    "plain": Mode("plain", {}),
    "accum2": Mode("accum2", {"gradient_accumulation_steps": 2}),
    "accum4": Mode("accum4", {"gradient_accumulation_steps": 4}),
    "accum8": Mode("accum8", {"gradient_accumulation_steps": 8}),
    "checkpoint": Mode("checkpoint", {"activation_checkpointing": {"enabled": True}}),
    "checkpoint_every2_accum2": Mode("checkpoint_every2_accum2", {
        "gradient_accumulation_steps": 2, "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}}),
    "clip_schedule": Mode("clip_schedule", {
        "gradient_clipping": 0.05,
        "scheduler": {"type": "cosine", "params": {"warmup_num_steps": 2, "total_num_steps": 6, "cos_min_ratio": 0.1}},
    }, clip=0.05, lr_lambda=_warmup_cosine),
    "bf16": Mode("bf16", {"bf16": {"enabled": True}}, autocast_dtype=torch.bfloat16),
    # hysteresis 1: torch's GradScaler (the plain loop) halves the scale at every overflow.
    "fp16": Mode("fp16", {"fp16": {"enabled": True, "hysteresis": 1}}, autocast_dtype=torch.float16,
                 extra={"grad_scaler": True}),
    # Optimizer offload: small buckets so several host steps overlap backward (eager path);
    # clipping and fp16 defer the host step until every gradient has landed (then, with
    # ``overlap_updates``, it runs while the next step's forward starts).
    "offload_opt": Mode("offload_opt", {"zero_optimization": {
        "stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}),
    "offload_opt_accum2_clip": Mode("offload_opt_accum2_clip", {
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}, clip=0.05,
        extra={"overlap_updates": True}),
    "offload_opt_twinflow_fp16": Mode("offload_opt_twinflow_fp16", {
        "fp16": {"enabled": True, "hysteresis": 1}, "zero_optimization": {"stage": 1, "offload_optimizer": {
            "device": "cpu", "ratio": 0.5}}}, autocast_dtype=torch.float16, extra={"grad_scaler": True}),
    # Activation swapping, alone and with checkpointing (then only block inputs travel).
    "swap": Mode("swap", {"activation_offload": {"enabled": True, "min_bytes": 0}}),
    "swap_checkpoint_bf16": Mode("swap_checkpoint_bf16", {
        "bf16": {"enabled": True}, "activation_checkpointing": {"enabled": True},
        "activation_offload": {"enabled": True, "min_bytes": 0, "prefetch_blocks": 2}}, autocast_dtype=torch.bfloat16),
    "cpu_checkpointing_accum2_offload": Mode("cpu_checkpointing_accum2_offload", {
        "gradient_accumulation_steps": 2,
        "activation_checkpointing": {"enabled": True, "cpu_checkpointing": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 3000, "offload_optimizer": {"device": "cpu"}}}),
    # Layer streaming: eager per-block host updates; accumulation + clipping defer them;
    # boundary activations recomputed (default), swapped to host, or kept on the device.
    "stream": Mode("stream", {"layer_streaming": {"enabled": True}}),
    "stream_host_accum2_clip": Mode("stream_host_accum2_clip", {
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True, "prefetch_blocks": 2, "boundary_activations": "host"}}, clip=0.05,
        extra={"overlap_updates": True}),
    "stream_device_bf16": Mode("stream_device_bf16", {
        "bf16": {"enabled": True}, "layer_streaming": {"enabled": True, "boundary_activations": "device"}},
        autocast_dtype=torch.bfloat16),
    # Layer-major streaming: every micro-batch through a block before the next block; the
    # blocks' gradients are complete at once (eager update), or deferred by clipping.
    "stream_layer_major_accum4": Mode("stream_layer_major_accum4", {
        "gradient_accumulation_steps": 4, "layer_streaming": {"enabled": True, "layer_major": True}}),
    "stream_layer_major_host_accum2_clip": Mode("stream_layer_major_host_accum2_clip", {
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.05, "layer_streaming": {
            "enabled": True, "layer_major": True, "prefetch_blocks": 2, "boundary_activations": "host"}},
        clip=0.05),
    "stream_layer_major_device_accum2": Mode("stream_layer_major_device_accum2", {
        "gradient_accumulation_steps": 2,
        "layer_streaming": {"enabled": True, "layer_major": True, "boundary_activations": "device"}}),
    # Optimizer offload under bf16/fp16: Linear weights' gradients (one widened half
    # gradient per backward) come down in half and are summed in fp32 on the host.
    "offload_opt_bf16_accum2_clip": Mode("offload_opt_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2}),
    # Half-width streaming (bf16/fp16): nn.Linear weights go up and their gradients come
    # down in half (hybridtrain.runtime.precision.half_width), summed in fp32 on the host per
    # micro-batch, or (layer-major, several micro-batches) on the device; clipping that
    # clips (every case's gradient norm is far above 0.05) and fp16 steps that overflow and
    # skip (a loss scale of 2^20 overflows the first steps of most cases).
    "stream_bf16_accum2_clip": Mode("stream_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True}}, autocast_dtype=torch.bfloat16, clip=0.05,
        extra={"plain_micro_batches": 2}),
    "stream_layer_major_host_bf16_accum2_clip": Mode("stream_layer_major_host_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True, "layer_major": True, "boundary_activations": "host"}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2, "overlap_updates": True}),
    "stream_layer_major_fp16_overflow_accum2_clip": Mode("stream_layer_major_fp16_overflow_accum2_clip", {
        "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.05, "layer_streaming": {"enabled": True, "layer_major": True}},
        autocast_dtype=torch.float16, clip=0.05,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "plain_micro_batches": 2, "overlap_updates": True}),
}


HALF_WIDTH_MODES: dict[str, Mode] = {
    # More half-width variants, kept out of MODES (which every Hugging Face family also
    # runs): fp16 overflow under optimizer offload and micro-batch-major streaming, and
    # layer-major streaming with one micro-batch (half gradients down, stepped at once).
    "offload_opt_fp16_overflow": Mode("offload_opt_fp16_overflow", {
        "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, autocast_dtype=torch.float16,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "overlap_updates": True},
        # offload_opt_twinflow_fp16's tolerance, for its reason (fused CPU AdamW's 1-ulp
        # roundings amplified by fp16 forwards); fp32 gradient transfers give the same bits.
        atol=1e-5),
    # Twin-Flow's share on the first parameters under optimizer offload (device_share: first):
    # clipping that clips, the host buckets updating behind the next forward.
    "offload_opt_twinflow_first_bf16_clip": Mode("offload_opt_twinflow_first_bf16_clip", {
        "bf16": {"enabled": True}, "gradient_clipping": 0.05, "zero_optimization": {
            "stage": 1, "reduce_bucket_size": 2000,
            "offload_optimizer": {"device": "cpu", "ratio": 0.5, "device_share": "first"}}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"overlap_updates": True}),
    "stream_fp16_overflow": Mode("stream_fp16_overflow", {
        "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20},
        "layer_streaming": {"enabled": True, "prefetch_blocks": 2}}, autocast_dtype=torch.float16,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "overlap_updates": True}),
    "stream_layer_major_bf16": Mode("stream_layer_major_bf16", {
        "bf16": {"enabled": True}, "layer_streaming": {"enabled": True, "layer_major": True}},
        autocast_dtype=torch.bfloat16),
    # Layer-major with blocks kept on the device from forward to backward (not uploaded
    # again): every block (-1), or the last two (of the reference GPT's three, the Sequential's
    # eight; all of the Hugging Face models' two).
    "stream_layer_major_keep_all_fp16_overflow_accum2_clip": Mode(
        "stream_layer_major_keep_all_fp16_overflow_accum2_clip", {
            "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.05,
            "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": -1}},
        autocast_dtype=torch.float16, clip=0.05,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "plain_micro_batches": 2}),
    "stream_layer_major_keep2_bf16_accum2_clip": Mode("stream_layer_major_keep2_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True, "layer_major": True, "keep_blocks_for_backward": 2}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2}),
    # Micro-batch-major streaming with the last two blocks kept from each micro-batch's
    # forward to its backward (every block of the Hugging Face models' two).
    "stream_keep2_bf16_accum2_clip": Mode("stream_keep2_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True, "keep_blocks_for_backward": 2}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2, "overlap_updates": True}),
}


def steps_with_fused_adam(mode: Mode, device: str = "cpu") -> bool:
    """Whether the plain loop takes torch's fused AdamW kernel for ``mode``.

    The engine steps offloaded and streamed parameters on the host with torch's fused CPU
    AdamW (``runtime/offload/optimizer.py``). Its arithmetic is the same AdamW, but its
    vectorized kernel rounds about 5 % of the elements one ulp away from the default
    single-tensor kernel's (measured on every CPU capability torch offers: ``default``, AVX2,
    AVX-512). Under bf16/fp16 autocast one such ulp can move a weight across a half-precision
    rounding boundary, which changes the rounding noise of every gradient downstream; an
    element whose true gradient is zero (a key projection's bias: softmax ignores a shift
    shared by every key) is pure noise, and Adam scales noise to a full ``lr``-sized update.
    So a reference on the other kernel agrees or not by chance of the CPU's roundings: the
    plain loop takes the kernel the engine runs, and what is compared is the engine's math.
    ``extra["fused_reference"]`` asks for it explicitly (on any device); on the CPU it
    follows from the config.
    """
    if mode.extra.get("fused_reference"):
        return True
    zero = mode.config.get("zero_optimization", {})
    host_stepped = (zero.get("offload_optimizer", {}).get("device") == "cpu"
                    or bool(mode.config.get("layer_streaming", {}).get("enabled")))
    return host_stepped and torch.device(device).type == "cpu"


def plain_optimizers(model: nn.Module, mode: Mode, device: str) -> list[torch.optim.Optimizer]:
    """AdamW over ``model``'s parameters on the kernels the engine steps them with: fused
    where it steps on the host (:func:`steps_with_fused_adam`), except Twin-Flow's device
    share (``offload_optimizer.ratio`` < 1), which the engine steps on the device with the
    default kernel. Twin-Flow keeps ``1 - ratio`` of the elements on the device (DeepSpeed's
    ``ratio``: the share of the optimizer offloaded): the last parameters, or the first with
    ``device_share: first``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not steps_with_fused_adam(mode, device):
        return [torch.optim.AdamW(params, **OPTIMIZER["params"])]
    offload = mode.config.get("zero_optimization", {}).get("offload_optimizer", {})
    ordered = params if offload.get("device_share") == "first" else params[::-1]
    left = (1.0 - offload.get("ratio", 1.0)) * sum(p.numel() for p in params)
    kept = 0
    while left > 0 and kept < len(ordered):
        left -= ordered[kept].numel()
        kept += 1
    on_device_ids = {id(p) for p in ordered[:kept]}
    host = [p for p in params if id(p) not in on_device_ids]
    on_device = [p for p in params if id(p) in on_device_ids]
    opts = [torch.optim.AdamW(host, **OPTIMIZER["params"], fused=True)] if host else []
    return opts + ([torch.optim.AdamW(on_device, **OPTIMIZER["params"])] if on_device else [])


def plain_run(case: ModelCase, mode: Mode, steps: int = STEPS,
              device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """The specification: a hand-written full-batch PyTorch loop, on ``device`` (the model
    built and the batches drawn on the CPU, then moved, so every device sees the same ones);
    the state comes back on the CPU."""
    torch.manual_seed(SEED)
    model = case.build().to(device)
    opts = plain_optimizers(model, mode, device)
    # No zero-gradient step at build: DeepSpeed's fp16 wrapper takes one, and its drop-in
    # (hybridtrain.deepspeed) does too (tests/deepspeed); hybridtrain's own road does not.
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, mode.lr_lambda) for opt in opts] if mode.lr_lambda else []
    kind = torch.device(device).type
    scaler = (torch.amp.GradScaler(kind, init_scale=mode.extra.get("init_scale", 2.0**16))
              if mode.extra.get("grad_scaler") else None)
    losses = []
    torch.manual_seed(SEED + 1)
    micro = mode.extra.get("plain_micro_batches", 1)
    for batch in case.batches(steps):
        batch = _to(batch, device)
        for opt in opts:
            opt.zero_grad()
        loss = torch.zeros(())
        for part in _halves(batch, micro):  # DeepSpeed's accumulation: each loss / micro
            with torch.autocast(kind, dtype=mode.autocast_dtype or torch.bfloat16,
                                enabled=mode.autocast_dtype is not None):
                part_loss = case.plain_loss(model, part)
            if micro > 1:
                part_loss = part_loss / micro
            (scaler.scale(part_loss) if scaler else part_loss).backward()
            loss = loss + part_loss.detach().float().cpu()
        for opt in opts if scaler else ():
            scaler.unscale_(opt)
        if mode.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), mode.clip)
        # GradScaler skips an optimizer whose own gradients overflowed; the step is one
        # whole step, so an overflow anywhere skips every optimizer.
        finite = not scaler or all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
        for opt in opts if finite else ():
            opt.step()
        if scaler:
            scaler.update()
        for sched in scheds:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _halves(batch: Any, parts: int) -> list[Any]:
    """``batch`` (tensors in tuples and dicts) cut along dim 0 into ``parts`` equal pieces."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        cut = {k: _halves(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(parts)]
    cut_items = [_halves(v, parts) for v in batch]
    return [type(batch)(v[i] for v in cut_items) for i in range(parts)]


def _to(batch: Any, device: str) -> Any:
    """A batch (tensors in tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def engine_config(mode: Mode, **extra: Any) -> dict[str, Any]:
    """The engine config of a mode (on CPU, with the suite's optimizer)."""
    return {"device": "cpu", "optimizer": copy.deepcopy(OPTIMIZER), **copy.deepcopy(mode.config), **extra}


def engine_run(case: ModelCase, mode: Mode, steps: int = STEPS,
               **extra: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training through ``hybridtrain.initialize`` and ``train_batch``."""
    torch.manual_seed(SEED)
    model = case.build()
    engine = ht.initialize(model, engine_config(mode, **extra), loss_fn=case.loss_fn)
    # Host updates deferred by clipping or fp16 run while the next forward starts.
    engine.overlap_updates = bool(mode.extra.get("overlap_updates"))
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in case.batches(steps)]
    return losses, engine.model_state_dict()


def train_recording_norms(engine: ht.Engine, case: ModelCase,
                          steps: int = STEPS) -> tuple[list[float], list[float | None]]:
    """Train ``engine`` on ``case``'s batches (seeded as :func:`plain_run`): each step's loss and
    gradient norm."""
    torch.manual_seed(SEED + 1)
    losses, norms = [], []
    for batch in case.batches(steps):
        losses.append(engine.train_batch(batch))
        norms.append(engine.last_grad_norm)
    return losses, norms


def assert_same_training(expected: tuple[list[float], dict[str, torch.Tensor]],
                         actual: tuple[list[float], dict[str, torch.Tensor]], rtol: float, atol: float) -> None:
    """Losses and every parameter agree within tolerance."""
    torch.testing.assert_close(torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=rtol, atol=atol)
    assert actual[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        torch.testing.assert_close(actual[1][name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_resume_exact(make_engine: Callable[[], ht.Engine], batches: list[Any], path: Any,
                        stop_at: int = 2) -> tuple[ht.Engine, ht.Engine]:
    """Train ``batches`` straight through; then train ``stop_at`` of them, save, load into a
    fresh engine and train the rest. Losses and parameters must be bit-identical.

    Returns:
        ``(interrupted_engine, resumed_engine)`` for further checks.
    """
    straight = make_engine()
    expected = [straight.train_batch(b) for b in batches]
    first = make_engine()
    losses = [first.train_batch(b) for b in batches[:stop_at]]
    first.save_checkpoint(path)
    resumed = make_engine()
    resumed.load_checkpoint(path)
    losses += [resumed.train_batch(b) for b in batches[stop_at:]]
    assert losses == expected
    final = resumed.model_state_dict()
    for name, value in straight.model_state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)
    return first, resumed


def _gradients_wait_on_device(mode: Mode) -> Mode:
    """``mode`` with offloaded gradients waiting on the device (``gradients_wait: device``)."""
    config = copy.deepcopy(mode.config)
    offload = config.setdefault("zero_optimization", {}).setdefault("offload_optimizer", {})
    offload["gradients_wait"] = "device"
    return dataclasses.replace(mode, name=f"{mode.name}_grads_on_device", config=config)


GRADS_ON_DEVICE_MODES: dict[str, Mode] = {
    # Every offload mode whose gradients would wait in host memory (a deferred step, or a sum
    # over micro-batches), with them waiting on the device: bf16 and fp16, accumulation,
    # clipping that clips, fp16 overflow that skips, twin-flow, background updates.
    m.name: m for m in map(_gradients_wait_on_device, [
        {**MODES, **HALF_WIDTH_MODES}[name] for name in (
            "offload_opt_accum2_clip", "offload_opt_bf16_accum2_clip", "offload_opt_twinflow_fp16",
            "offload_opt_fp16_overflow", "cpu_checkpointing_accum2_offload", "stream_host_accum2_clip",
            "stream_bf16_accum2_clip", "stream_fp16_overflow", "stream_layer_major_host_accum2_clip",
            "stream_layer_major_fp16_overflow_accum2_clip", "stream_keep2_bf16_accum2_clip")])
}


TWIN_FLOW_STREAMING_MODES: dict[str, Mode] = {
    # Twin-Flow under layer streaming: the last half of the parameters (their blocks resident)
    # updated on the device, the rest streamed and updated on the host; gradients waiting in
    # host memory or on the device.
    "stream_twinflow_bf16_accum2_clip": Mode("stream_twinflow_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True}, "zero_optimization": {"offload_optimizer": {"ratio": 0.5}}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2, "overlap_updates": True}),
    "stream_layer_major_twinflow_fp16_overflow_accum2_clip": Mode(
        "stream_layer_major_twinflow_fp16_overflow_accum2_clip", {
            "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.05, "layer_streaming": {"enabled": True, "layer_major": True},
            "zero_optimization": {"offload_optimizer": {"ratio": 0.5}}},
        autocast_dtype=torch.float16, clip=0.05,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "plain_micro_batches": 2}),
    # The composition the planner picks for GPT-13B on one H100 (docs/planning.md): micro-batch-
    # major streaming of one micro-batch per step, block inputs in host memory, a kept block,
    # gradients held on the device at half width, images cast per upload, Twin-Flow; in bf16 with
    # clipping that clips, and in fp16 with an overflow that skips.
    "stream_host_twinflow_keep1_bf16_clip_held_per_upload": Mode(
        "stream_host_twinflow_keep1_bf16_clip_held_per_upload", {
            "bf16": {"enabled": True}, "gradient_clipping": 0.05, "layer_streaming": {
                "enabled": True, "boundary_activations": "host", "keep_blocks_for_backward": 1,
                "half_images": "per_upload"},
            "zero_optimization": {"offload_optimizer": {"ratio": 0.7, "gradients_wait": "device"}}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"overlap_updates": True}),
    "stream_host_twinflow_keep1_fp16_overflow_held_per_upload": Mode(
        "stream_host_twinflow_keep1_fp16_overflow_held_per_upload", {
            "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "layer_streaming": {
                "enabled": True, "boundary_activations": "host", "keep_blocks_for_backward": 1,
                "half_images": "per_upload"},
            "zero_optimization": {"offload_optimizer": {"ratio": 0.7, "gradients_wait": "device"}}},
        autocast_dtype=torch.float16, extra={"grad_scaler": True, "init_scale": 2.0**20, "overlap_updates": True}),
    # Held gradients landing after step() behind the next forward with a device share (its
    # update in bounded runs): fp16 with accumulation, clipping that clips and an overflow that skips.
    "stream_twinflow_fp16_overflow_accum2_clip_held_later": Mode(
        "stream_twinflow_fp16_overflow_accum2_clip_held_later", {
            "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.05, "layer_streaming": {"enabled": True},
            "zero_optimization": {"offload_optimizer": {"ratio": 0.5, "gradients_wait": "device"}}},
        autocast_dtype=torch.float16, clip=0.05,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "plain_micro_batches": 2, "overlap_updates": True}),
    # The device share on the first blocks (device_share: first; the planner's 6.7B plan):
    # the next forward runs through them while the host updates the rest. bf16 with
    # accumulation and clipping that clips, gradients in host memory; fp16 with an overflow
    # that skips, gradients held on the device and landing after the step.
    "stream_twinflow_first_bf16_accum2_clip": Mode("stream_twinflow_first_bf16_accum2_clip", {
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
        "layer_streaming": {"enabled": True, "boundary_activations": "host", "keep_blocks_for_backward": 1},
        "zero_optimization": {"offload_optimizer": {"ratio": 0.6, "device_share": "first"}}},
        autocast_dtype=torch.bfloat16, clip=0.05, extra={"plain_micro_batches": 2, "overlap_updates": True}),
    "stream_twinflow_first_fp16_overflow_clip_held_later": Mode(
        "stream_twinflow_first_fp16_overflow_clip_held_later", {
            "fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 20}, "gradient_clipping": 0.05,
            "layer_streaming": {"enabled": True},
            "zero_optimization": {"offload_optimizer": {"ratio": 0.6, "gradients_wait": "device",
                                                        "device_share": "first"}}},
        autocast_dtype=torch.float16, clip=0.05,
        extra={"grad_scaler": True, "init_scale": 2.0**20, "overlap_updates": True}),
    "stream_layer_major_twinflow": Mode("stream_layer_major_twinflow", {
        "layer_streaming": {"enabled": True, "layer_major": True},
        "zero_optimization": {"offload_optimizer": {"ratio": 0.7}}}),
}
TWIN_FLOW_STREAMING_MODES.update({m.name: m for m in map(_gradients_wait_on_device, [
    TWIN_FLOW_STREAMING_MODES["stream_twinflow_bf16_accum2_clip"],
    TWIN_FLOW_STREAMING_MODES["stream_layer_major_twinflow_fp16_overflow_accum2_clip"]])})


def _resident_checkpointed(mode: Mode) -> Mode:
    """``mode`` with the blocks staying on the device (Twin-Flow's share) checkpointed too:
    ``activation_checkpointing`` under streaming, their activations recomputed in backward."""
    config = copy.deepcopy(mode.config)
    config["activation_checkpointing"] = {"enabled": True}
    return dataclasses.replace(mode, name=f"{mode.name}_resident_checkpointed", config=config)


# The planner's 6.7B plan (share first, resident blocks checkpointed): bf16 with accumulation
# and clipping that clips; fp16 with an overflow that skips, gradients held on the device and
# landing after the step; layer-major fp16 with accumulation, gradients held on the device.
TWIN_FLOW_STREAMING_MODES.update({m.name: m for m in map(_resident_checkpointed, [
    TWIN_FLOW_STREAMING_MODES["stream_twinflow_first_bf16_accum2_clip"],
    TWIN_FLOW_STREAMING_MODES["stream_twinflow_first_fp16_overflow_clip_held_later"],
    TWIN_FLOW_STREAMING_MODES["stream_layer_major_twinflow_fp16_overflow_accum2_clip_grads_on_device"]])})


def _images_per_upload(mode: Mode) -> Mode:
    """``mode`` with half-width images cast into pooled host buffers at every upload."""
    config = copy.deepcopy(mode.config)
    config["layer_streaming"]["half_images"] = "per_upload"
    return dataclasses.replace(mode, name=f"{mode.name}_images_per_upload", config=config)


PER_UPLOAD_IMAGE_MODES: dict[str, Mode] = {
    # Half-width streaming with no image kept per block: micro-batch-major with accumulation
    # and clipping, layer-major fp16 that overflows, kept blocks, gradients on the device.
    m.name: m for m in map(_images_per_upload, [
        MODES["stream_bf16_accum2_clip"], MODES["stream_layer_major_fp16_overflow_accum2_clip"],
        HALF_WIDTH_MODES["stream_keep2_bf16_accum2_clip"], HALF_WIDTH_MODES["stream_layer_major_bf16"],
        GRADS_ON_DEVICE_MODES["stream_bf16_accum2_clip_grads_on_device"]])
}
