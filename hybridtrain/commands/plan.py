"""``hybridtrain estimate`` and ``hybridtrain plan``: bytes and seconds of a training step
before training, and the fastest same-math plan that fits a device."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_planner_commands(sub: Any) -> None:
    """Register ``estimate`` and ``plan`` on the top-level sub-parsers."""
    est = sub.add_parser(
        "estimate", help="peak device bytes, host bytes and seconds of one training step (nothing allocated)",
        description="Estimate one training step of CONFIG from its model traced on the meta device: peak "
        "device bytes and host bytes by kind (parameters, gradients, optimizer state, activations, transfer "
        "buffers, workspace) and the predicted step time. No GPU needed.")
    _common(est)
    est.add_argument("--json", action="store_true", help="print JSON (device_peak_bytes, host_bytes, step_seconds …)")
    est.set_defaults(func=_estimate)

    plan = sub.add_parser(
        "plan", help="the fastest same-math variant of a config that fits a device",
        description="Estimate every same-math variant of CONFIG (micro-batch × accumulation, checkpointing, "
        "activation swapping, optimizer offload, layer streaming; parallel split and ZeRO stage for several "
        "processes), drop those that do not fit with a margin, rank the rest by predicted step time.")
    _common(plan)
    plan.add_argument("-o", "--output", metavar="PLAN.yaml", help="write the chosen config (YAML) here")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="variants to show (default 5)")
    plan.add_argument("--margin", type=float, default=None, metavar="F",
                      help="share of device memory left free (default 0.10)")
    plan.set_defaults(func=_plan)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="JSON/YAML config (DeepSpeed keys accepted)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", metavar="NAME",
                       help="GPU model (H100, A100-80GB, L4 …) or cpu; default: this machine")
    where.add_argument("--device-memory", metavar="BYTES", help="device memory to fit, e.g. 24GiB")
    parser.add_argument("--host-memory", metavar="BYTES", help="host memory to fit offloaded state in, e.g. 128GiB")
    parser.add_argument("--host-bandwidth", metavar="BYTES/S",
                        help="host memory bandwidth of the machine planned for, e.g. 152GB/s (default: measured "
                             "when planning for this machine, else the GPU model's figure)")
    parser.add_argument("--link-bandwidth", metavar="BYTES/S",
                        help="host<->device bytes/s per direction of the machine planned for, e.g. 53GB/s "
                             "(`part: link` of the GPU check; default: measured when planning for this machine's "
                             "GPU, else the GPU model's figure)")
    parser.add_argument("--world-size", type=int, default=1, metavar="N", help="processes (default 1)")


def _inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The config and the target; every error here is one line, before any tracing."""
    from hybridtrain.compose import asks_deepspeed_math
    from hybridtrain.config import load_config
    from hybridtrain.planner.estimate import resolve_target
    from hybridtrain.units import parse_bytes, parse_rate

    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: use a positive number of processes")
    device_memory = _bytes("--device-memory", args.device_memory, parse_bytes)
    host_memory = _bytes("--host-memory", args.host_memory, parse_bytes)
    host_bandwidth = _bytes("--host-bandwidth", args.host_bandwidth, parse_rate)
    link = _bytes("--link-bandwidth", getattr(args, "link_bandwidth", None), parse_rate)
    target = resolve_target(args.device, device_memory, host_memory, host_bandwidth, link)
    cfg = load_config(args.config, args.overrides)
    if asks_deepspeed_math(cfg):
        # Its memory and time models, and variants such as layer streaming, are autocast's.
        raise ValueError("precision_math = 'deepspeed': the planner models bf16/fp16 as autocast over fp32 weights; "
                         "allowed: 'autocast' or unset (--set precision_math=autocast)")
    return cfg, target


def _bytes(flag: str, value: str | None, parse: Any) -> Any:
    if value is None:
        return None
    try:
        amount = parse(value)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return amount


def _estimate(args: argparse.Namespace) -> int:
    from hybridtrain.config import ConfigError
    from hybridtrain.planner.estimate import estimate

    try:
        cfg, target = _inputs(args)
        result = estimate(cfg, target, args.world_size)
    except (ConfigError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problems = result.problems()
    if args.json:
        print(json.dumps({**result.as_dict(), "fits": not problems, "problems": problems}, indent=2))
    else:
        print(render_estimate(result))
    for problem in problems:
        print(f"does not fit: {problem}", file=sys.stderr)
    return 1 if problems else 0


def render_estimate(result: Any) -> str:
    """The human-readable estimate."""
    from hybridtrain.units import format_bytes

    lines = [f"target: {result.target.name}" + (f", device memory {format_bytes(result.target.memory_bytes)}"
                                                if result.target.memory_bytes else "")]
    lines.append(f"device peak: {format_bytes(result.device_peak_bytes)} (at {result.memory.peak_at})")
    for kind, value in result.memory.device.as_dict().items():
        if kind != "total":
            lines.append(f"  {kind:<17} {format_bytes(value)}")
    lines.append(f"host: {format_bytes(result.host_bytes)}")
    for kind, value in result.memory.host.as_dict().items():
        if kind != "total" and value:
            lines.append(f"  {kind:<17} {format_bytes(value)}")
    t = result.time
    tokens = result.tokens_per_step / t.total if t.total else 0.0
    lines.append(f"step: {t.total:.4g} s predicted ({tokens:,.0f} tokens/s)")
    for part, value in t.as_dict().items():
        if part != "total" and value:
            lines.append(f"  {part:<17} {value:.4g} s")
    if result.target.kind == "cuda":
        from hybridtrain.planner.estimate import host_bandwidth_source, link_bandwidth_source

        bandwidth, source = host_bandwidth_source(result.target)
        link, link_source = link_bandwidth_source(result.target)
        lines.append(compute_rate(result.target, result.plan.compute_dtype))
        lines.append(f"host memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({source})")
        lines.append(f"host<->device link: {link / 1e9:.1f} GB/s each way ({link_source})")
    if result.target.kind == "cpu":
        lines.append("(on a CPU, host and device are one memory: the device peak includes the host bytes)")
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
    from hybridtrain.config import ConfigError
    from hybridtrain.planner.search import MARGIN, no_fit_message, plan

    try:
        cfg, target = _inputs(args)
        if target.memory_bytes is None:
            raise ValueError("plan needs the device memory to fit: give --device NAME or --device-memory BYTES")
        margin = MARGIN if args.margin is None else args.margin
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"--margin {margin}: use a share in [0, 1)")
        result = plan(cfg, target, args.world_size, margin)
    except (ConfigError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.best is None:
        from hybridtrain.planner.binding import least_needs

        # The error stays one line; what binds, per memory, is the report on stdout.
        print(f"error: {no_fit_message(result, target)}", file=sys.stderr)
        for line in least_needs([(c.describe(), c.estimate) for c in result.refused], margin):
            print(line)
        print(searched_modes())
        return 1
    print(render_plan(result, target, margin, args.top))
    if args.output:
        write_config(result.best.config, Path(args.output))
        print(f"wrote {args.output}")
    return 0


def render_plan(result: Any, target: Any, margin: float, top: int) -> str:
    """The ranking: the best few, each with its bytes, seconds and where the time goes."""
    from hybridtrain.units import format_bytes

    total = len(result.ranked) + len(result.refused)
    host = f", host {format_bytes(target.host_memory_bytes)}" if target.host_memory_bytes else ""
    lines = [f"{total} same-math variants estimated for {target.name} ({format_bytes(target.memory_bytes)} "
             f"with {margin:.0%} kept free{host}): {len(result.ranked)} fit"]
    lines.append(compute_rate(target, result.ranked[0].estimate.plan.compute_dtype) if result.ranked else "")
    lines.append(searched_modes())
    for rank, c in enumerate(result.ranked[:top], 1):
        e = c.estimate
        tokens = e.tokens_per_step / e.step_seconds if e.step_seconds else 0.0
        lines.append(f"{rank}. {e.step_seconds:.4g} s/step ({tokens:,.0f} tokens/s), device "
                     f"{format_bytes(e.device_peak_bytes)}, host {format_bytes(e.host_bytes)}: {c.describe()}")
        lines.append(f"   why: {_why(e)}")
        if rank == 1:
            from hybridtrain.planner.binding import binding_report

            lines += [f"   {line}" for line in binding_report(e, margin)]
    if result.refused:
        lines.append(f"{len(result.refused)} do not fit (the config as it is: "
                     + ("fits" if any(not c.changes for c in result.ranked) else
                        "; ".join(next((c.problems for c in result.refused if not c.changes), ("not estimated",))))
                     + ")")
    return "\n".join(lines)


def compute_rate(target: Any, dtype: Any) -> str:
    """``device compute: 0.474 of H100 SXM's dense bf16 peak (989.4 TFLOP/s) = 469 TFLOP/s
    (measured: …)``: the kernel efficiency the step times rest on, and its source."""
    import torch

    from hybridtrain.hardware.efficiency import kernel_efficiency
    from hybridtrain.planner.estimate import hardware

    efficiency = kernel_efficiency(target.name)
    rate = hardware(target, dtype).flops
    name = str(dtype or torch.float32).removeprefix("torch.")
    if target.kind == "cpu":
        return f"device compute: {rate / 1e12:.3g} TFLOP/s ({efficiency.source})"
    return (f"device compute: {efficiency.share:.3g} of {target.name}'s dense {name} peak "
            f"({rate / efficiency.share / 1e12:.1f} TFLOP/s) = {rate / 1e12:.0f} TFLOP/s ({efficiency.source})")


def searched_modes() -> str:
    """The runtime's modes the planner searches (what a plan may choose), in one line."""
    return ("modes searched (each implemented by the runtime): micro-batch x accumulation, activation checkpointing "
            "every n blocks, activation swapping, optimizer offload (ZeRO-Offload) with its Twin-Flow ratio, "
            "layer streaming (micro-batch- or layer-major, block inputs recomputed or in host memory, kept blocks, "
            "Twin-Flow ratio and its share first or last, resident blocks checkpointed, half-width images kept or "
            "cast per upload), waiting "
            "gradients on the host or the device; several processes: data/tensor/pipeline split and ZeRO stage")


def _why(estimate: Any) -> str:
    """Where the predicted time goes (what makes this variant faster or slower)."""
    t = estimate.time
    parts = [f"compute {t.compute:.3g} s"]
    for name, value in (("recompute", t.recompute), ("optimizer", t.optimizer), ("transfers", t.transfers),
                        ("host optimizer", t.host_step),
                        ("communication", t.communication), ("pipeline bubble", t.bubble)):
        if value > 0.005 * t.total:
            parts.append(f"{name} {value:.3g} s")
    hidden = t.compute + t.recompute + t.optimizer + t.transfers + t.host_step + t.communication + t.bubble - t.total
    if hidden > 0.005 * t.total:
        parts.append(f"{hidden:.3g} s of it hidden behind compute")
    return ", ".join(parts)


def write_config(config: Any, path: Path) -> None:
    """Write ``config`` as YAML that ``hybridtrain train`` loads back to the same config:
    the user's keys and hybridtrain's own, nothing a DeepSpeed rule adds (loading adds
    none; the DeepSpeed drop-in applies its rules to whatever it loads)."""
    import yaml

    data = config.model_dump(mode="json", exclude_defaults=True)
    # What the plan trains is spelled out even where it is a default, so the file still
    # means the same model and optimizer if a default changes.
    full = config.model_dump(mode="json")
    data = {**data, **{key: full[key] for key in ("model", "optimizer")}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
