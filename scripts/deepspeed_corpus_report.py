"""How hybridtrain treats the real DeepSpeed configs in ``tests/config/deepspeed_corpus/``.

For every corpus file (see ``SOURCES.md`` there for where each one comes from):

1. ``hybridtrain.config.load_config(path)`` on the file as published;
2. if that loads, ``hybridtrain.initialize`` of a fresh ``gpt-tiny`` with
   ``causal_lm_loss``, in this one process (world size 1) on the CPU, from the file's dict
   with ``device: cpu`` and, where needed, batch sizes that fit one CPU process;
3. two ``engine.train_batch`` calls on random tokens.

Each file ends as one of: ``trains``; ``refused`` (a ``ConfigError``, from loading or from
``initialize``); ``crashed`` (any other exception, at any step). The summary counts the
outcomes, groups the refusal messages by the config key they name, and lists which
DeepSpeed keys (flattened, e.g. ``zero_optimization.offload_param.device``) and which
``"auto"`` values the corpus uses, each marked with what the schema makes of it.

Run: ``python scripts/deepspeed_corpus_report.py [--verbose] [--all-keys] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "config" / "deepspeed_corpus"
MAX_BATCH = 8
"""Largest batch trained here: the corpus's batch sizes are for many GPUs."""
SEQ_LEN = 16
"""Tokens per sample (gpt-tiny takes up to 64)."""
STEPS = 2

# One process, whatever launched this script.
for _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    os.environ.pop(_name, None)

import torch  # noqa: E402

import hybridtrain  # noqa: E402
from hybridtrain.config import ConfigError, load_config, resolve_batch_sizes  # noqa: E402
from hybridtrain.models.gpt import build_gpt, causal_lm_loss, gpt_config  # noqa: E402


@dataclass
class Result:
    """What happened to one corpus file."""

    file: str
    outcome: str = "trains"
    """``trains`` | ``refused`` | ``crashed``."""
    phase: str = ""
    """Where it stopped: ``load`` (load_config), ``initialize``, ``train`` (train_batch)."""
    error_type: str = ""
    message: str = ""
    """First line of the exception's message."""
    overrides: list[str] = field(default_factory=list)
    """What was changed in the file's dict before ``initialize`` (beyond ``device: cpu``)."""
    losses: list[float] = field(default_factory=list)
    optimizer: str = ""
    """The class of the optimizer the engine steps (``trains`` only)."""
    seconds: float = 0.0


# ---------------------------------------------------------------------------------- batch sizes
def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def batch_overrides(raw: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """Batch-size keys to set so that the run fits one CPU process, and why.

    The batch is the file's ``train_batch_size`` when it is an int, else micro × accumulation,
    capped at ``MAX_BATCH`` (rounded down to a multiple of the file's accumulation steps, which
    are kept when at most ``MAX_BATCH``). Nothing is overridden when the file's sizes already
    resolve for world size 1 to a batch of at most ``MAX_BATCH``.
    """
    total, micro, accum = (_int(raw.get(k)) for k in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    try:
        sizes = resolve_batch_sizes(load_config(raw), 1)
        if sizes.global_batch <= MAX_BATCH:
            return {}, []
        reason = f"batch {sizes.global_batch} capped at {MAX_BATCH}"
    except ConfigError:
        reason = "sizes inconsistent for world size 1 (written for several ranks)"
    batch = total if total is not None else (micro or 1) * (accum or 1)
    batch = max(1, min(batch, MAX_BATCH))
    if accum and accum <= MAX_BATCH:  # keep the accumulation: the largest multiple of it that fits
        new_accum, batch = accum, max(accum, batch // accum * accum)
    else:
        new_accum = MAX_BATCH if accum else 1
        batch = max(batch, new_accum)
    new = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // new_accum,
           "gradient_accumulation_steps": new_accum}
    was = {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": accum}
    changed = ", ".join(f"{k} {was[k]}→{v}" for k, v in new.items() if was[k] != v)
    return new, [f"{reason}: {changed}"]


# ---------------------------------------------------------------------------------- one file
def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return text.splitlines()[0]


def run_file(path: Path) -> Result:
    """Load, initialize and train one config; never raises."""
    result = Result(path.name)
    start = time.perf_counter()
    phase = "load"
    try:
        load_config(path)
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["device"] = "cpu"
        sizes, result.overrides = batch_overrides(raw)
        raw.update(sizes)
        phase = "initialize"
        torch.manual_seed(0)
        model = build_gpt("gpt-tiny")
        engine = hybridtrain.initialize(model, raw, loss_fn=causal_lm_loss)
        result.optimizer = type(engine.optimizer).__name__
        phase = "train"
        batch = engine.options.batch.global_batch
        vocab = gpt_config("gpt-tiny").vocab_size
        for _ in range(STEPS):
            tokens = torch.randint(0, vocab, (batch, SEQ_LEN + 1))
            result.losses.append(round(engine.train_batch((tokens[:, :-1], tokens[:, 1:])), 4))
    except ConfigError as exc:
        result.outcome, result.phase = "refused", phase
        result.error_type, result.message = "ConfigError", first_line(exc)
    except Exception as exc:  # noqa: BLE001 - every other failure is a finding
        result.outcome, result.phase = "crashed", phase
        result.error_type, result.message = type(exc).__name__, first_line(exc)
    result.seconds = round(time.perf_counter() - start, 3)
    return result


# ---------------------------------------------------------------------------------- messages
# The config code is being reworked, so the key a message names is found by its shape
# ("config a.b = …", "unknown config key 'a.b'", "a.b = …: why", "a.b: why"), not by importing
# its tables.
_KEY = r"([A-Za-z_][\w]*(?:\.[\w]+)*)"
_DOTTED = r"([a-z0-9]+(?:[._][a-z0-9]+)+)"
_NAMED = [
    re.compile(r"config key '" + _KEY + r"' is a DeepSpeed key"),
    re.compile(r"unknown config key '" + _KEY + r"'"),
    re.compile(r"^config " + _KEY + r" = "),
    re.compile(r"^" + _KEY + r"(?: = |: )"),
    re.compile(r"^" + _DOTTED + r"\b"),
]
_LEAD = re.compile(r"^[^'=;]*?: (?=" + _KEY + r"(?: = |: ))")
"""A sentence that introduces a list of ``key = value: why`` or ``key: why`` items."""


def named_keys(message: str) -> list[str]:
    """The config key each of the message's '; '-joined errors names (in order)."""
    keys: list[str] = []
    for part in message.split("; "):
        part = _LEAD.sub("", part.strip())
        for pattern in _NAMED:
            match = pattern.search(part)
            if match:
                keys.append(match.group(1))
                break
        else:
            if part.startswith(("batch sizes do not divide", "inconsistent batch sizes")):
                keys.append("(batch sizes)")
    return list(dict.fromkeys(keys)) or ["(no key named)"]


def message_shape(message: str) -> str:
    """The first error of a message with the file-specific value elided, to group alike ones."""
    head = _LEAD.sub("", message.split("; ")[0])
    head = re.sub(r"config file '[^']*'", "config file …", head)
    head = re.sub(r" = .*? is not allowed:", " = … is not allowed:", head)
    head = re.sub(r" \{.*\} rejected by", " {…} rejected by", head)
    head = re.sub(r"^" + _KEY + r" = (\{.*\}|\[.*\]|'[^']*'|[^:'{\[]*): ", r"\1 = …: ", head)
    return head if len(head) <= 150 else head[:147] + "…"


def _delete(raw: dict[str, Any], key: str) -> bool:
    *parents, last = key.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False


def blockers(raw: dict[str, Any]) -> tuple[list[str], str]:
    """Every key that keeps ``raw`` from reaching a built engine, found by deleting the keys
    each refusal names and trying again (loaders may stop at their first kind of problem).

    Returns:
        The keys in the order found, and how it ended: ``initializes``, ``crash: <type>``
        or ``stuck at: <message>`` (a refusal that names no key that could be deleted).
    """
    raw = json.loads(json.dumps(raw))
    found: list[str] = []
    for _ in range(25):
        try:
            load_config(raw)
            trial = {**raw, "device": "cpu", **batch_overrides({**raw, "device": "cpu"})[0]}
            torch.manual_seed(0)
            hybridtrain.initialize(build_gpt("gpt-tiny"), trial, loss_fn=causal_lm_loss)
            return found, "initializes"
        except ConfigError as exc:
            message = first_line(exc)
        except Exception as exc:  # noqa: BLE001
            return found, f"crash: {type(exc).__name__}"
        progress = False
        for key in named_keys(message):
            if key not in found:
                found.append(key)
            progress = _delete(raw, key) or progress
        if not progress:
            return found, f"stuck at: {message_shape(message)}"
    return found, "stuck (25 rounds)"


# ---------------------------------------------------------------------------------- features
def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf ``(dotted.key, value)`` pairs; lists and empty dicts are leaves."""
    if isinstance(value, dict) and value:
        for key, child in value.items():
            yield from flatten(child, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def schema_status(key: str) -> str:
    """Where a flattened key falls in ``hybridtrain.config.Config``: ``schema`` (a field),
    ``free-form`` (inside a dict field such as ``optimizer.params``) or ``not in schema``
    (whatever the loader then does with it: see the outcomes)."""
    from pydantic import BaseModel

    from hybridtrain.config import Config

    model: type[BaseModel] = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return "not in schema"
        args = [info.annotation, *getattr(info.annotation, "__args__", ())]
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            model = nested[0]
            continue
        return "schema" if i == len(parts) - 1 else "free-form"
    return "schema"


# ---------------------------------------------------------------------------------- report
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--verbose", action="store_true", help="one line per file")
    parser.add_argument("--all-keys", action="store_true", help="list keys used by one file too")
    parser.add_argument("--json", type=Path, help="write per-file results here")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    files = sorted(p for p in args.corpus.glob("*.json"))
    if not files:
        print(f"no *.json files in {args.corpus}", file=sys.stderr)
        return 1
    began = time.perf_counter()
    results: list[Result] = []
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
        warnings.simplefilter("ignore")
        for path in files:
            results.append(run_file(path))
    elapsed = time.perf_counter() - began
    raws = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in files}
    repos = {name.split("__")[0] + "/" + name.split("__")[1] for name in raws}

    out: list[str] = []
    say = out.append
    say(f"DeepSpeed config corpus: {len(files)} files from {len(repos)} repositories ({args.corpus})")
    say(f"hybridtrain {hybridtrain.__version__} from {Path(hybridtrain.__file__).parent}")
    say(f"torch {torch.__version__}; one CPU process "
        f"(world size 1), gpt-tiny, {STEPS} train_batch steps of {SEQ_LEN}-token random samples; "
        f"{elapsed:.1f} s")
    say("Every file that loads runs with device: cpu; batch sizes overridden as listed below.")

    say("")
    say("== Outcomes")
    counts = Counter(r.outcome for r in results)
    for outcome in ("trains", "refused", "crashed"):
        phases = Counter(r.phase for r in results if r.outcome == outcome and r.phase)
        detail = ", ".join(f"{n} at {ph}" for ph, n in phases.most_common())
        say(f"  {outcome:8} {counts[outcome]:4}" + (f"   ({detail})" if detail else ""))

    refused = [r for r in results if r.outcome == "refused"]
    say("")
    say(f"== Refusals by the first key the message names ({len(refused)} files)")
    by_key: dict[str, list[Result]] = defaultdict(list)
    for r in refused:
        by_key[named_keys(r.message)[0]].append(r)
    for key, group in sorted(by_key.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        say(f"  {len(group):4}  {key}")
        for shape, n in Counter(message_shape(r.message) for r in group).most_common():
            say(f"          {n:3} × {shape}")

    say("")
    say(f"== All blockers of the {len(refused)} refused files (the keys each refusal names are deleted "
        "and the file loaded and initialized again, until it initializes; files per key)")
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
        warnings.simplefilter("ignore")
        blocked = {r.file: blockers(raws[r.file]) for r in refused}
    for key, n in Counter(k for ks, _ in blocked.values() for k in ks).most_common():
        say(f"  {n:4}  {key}")
    say("  how that ended:")
    for end, n in Counter(end for _, end in blocked.values()).most_common():
        say(f"  {n:4}  {end}")
    sole = Counter(ks[0] for ks, end in blocked.values() if len(ks) == 1 and end == "initializes")
    say(f"  files that initialize once one key goes: {sum(sole.values())} ("
        + ", ".join(f"{k} ×{n}" for k, n in sole.most_common()) + ")")
    auto_only = [f for f, (ks, end) in blocked.items() if end == "initializes"
                 and set(ks) <= {k for k, v in flatten(raws[f]) if v == "auto"}]
    say(f"  files whose only blockers are \"auto\" values: {len(auto_only)}")

    crashed = [r for r in results if r.outcome == "crashed"]
    say("")
    say(f"== Crashes ({len(crashed)} files)")
    for (phase, kind, msg), n in Counter((r.phase, r.error_type, r.message[:150])
                                         for r in crashed).most_common():
        say(f"  {n:4}  [{phase}] {kind}: {msg}")
        if args.verbose:
            for r in crashed:
                if (r.phase, r.error_type, r.message[:150]) == (phase, kind, msg):
                    say(f"          {r.file}")

    trains = [r for r in results if r.outcome == "trains"]
    say("")
    say(f"== Trains ({len(trains)} files)")
    for r in trains:
        say(f"  {r.file}  {r.optimizer} losses={r.losses}"
            + (f"  [{'; '.join(r.overrides)}]" if r.overrides else ""))

    overridden = [r for r in results if r.overrides]
    say("")
    say(f"== Batch-size overrides (files that loaded: {sum(r.phase != 'load' for r in results)}; "
        f"overridden: {len(overridden)})")
    for reason, n in Counter(o.split(":")[0] for r in overridden for o in r.overrides).most_common():
        say(f"  {n:4}  {reason}")
    if args.verbose:
        for r in overridden:
            say(f"          {r.file}: {'; '.join(r.overrides)}")

    say("")
    say("== Top-level sections/keys (files using each; schema status)")
    top = Counter(k for raw in raws.values() for k in raw)
    for key, n in top.most_common():
        say(f"  {n:4}  {key:45} {schema_status(key)}")

    say("")
    def shown_key(key: str) -> str:
        # Without --all-keys, the subtree of a top-level section outside the schema is one line.
        top = key.split(".")[0]
        if args.all_keys or "." not in key or schema_status(top) != "not in schema":
            return key
        return top + ".*"

    leaf = Counter(k for raw in raws.values() for k in dict.fromkeys(k for k, _ in flatten(raw)))
    grouped = Counter(k for raw in raws.values()
                      for k in dict.fromkeys(shown_key(k) for k, _ in flatten(raw)))
    distinct = Counter(shown_key(k) for k in leaf)
    shown = [(k, n) for k, n in grouped.items() if n > 1 or args.all_keys]
    say(f"== Flattened keys ({len(leaf)} distinct; "
        f"{'all' if args.all_keys else 'those in 2+ files; a section outside the schema as one line'}; "
        "files using each; schema status)")
    for key, n in sorted(shown, key=lambda kv: (-kv[1], kv[0])):
        extra = f" ({distinct[key]} keys)" if key.endswith(".*") else ""
        say(f"  {n:4}  {key + extra:60} {schema_status(key.removesuffix('.*'))}")
    if not args.all_keys:
        say(f"  ({sum(1 for n in grouped.values() if n == 1)} more keys appear in one file only; "
            "--all-keys lists them)")

    say("")
    autos = Counter(k for raw in raws.values() for k in dict.fromkeys(
        k for k, v in flatten(raw) if v == "auto"))
    say(f"== \"auto\" values ({sum(any(v == 'auto' for _, v in flatten(raw)) for raw in raws.values())}"
        f" files hold at least one; files per key)")
    for key, n in sorted(autos.items(), key=lambda kv: (-kv[1], kv[0])):
        say(f"  {n:4}  {key:60} {schema_status(key)}")

    say("")
    say("== Values of a few keys (files)")
    for key in ("zero_optimization.stage", "optimizer.type", "scheduler.type",
                "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
                "fp16.enabled", "bf16.enabled"):
        values = Counter(json.dumps(v) for raw in raws.values() for k, v in flatten(raw) if k == key)
        say(f"  {key}: " + ", ".join(f"{v} ×{n}" for v, n in values.most_common()))

    if args.verbose:
        say("")
        say("== Per file")
        for r in results:
            say(f"  {r.outcome:8} {r.phase:10} {r.file}: {r.error_type} {r.message}".rstrip())
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
