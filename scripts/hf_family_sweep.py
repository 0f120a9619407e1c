"""Every Hugging Face architecture transformers ships for causal LM, masked LM and seq2seq
LM, trained 2 steps through hybridtrain in each single-process technique and compared with
a plain PyTorch loop.

The architectures are the values of transformers' public auto mappings
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``MODEL_FOR_MASKED_LM_MAPPING_NAMES`` and
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` (one row per distinct config class ×
model class). Each is built from a tiny random config derived from its config class's
defaults (``tests/models/hf_tiny.py``); nothing is downloaded.

For each model, in a forked child process with a time limit (a hang or a crash costs one
row, not the sweep):

1. the plain loop (``tests/equivalence.py``'s ``plain_run``: ``model(**batch).loss`` and
   AdamW) in fp32, twice — if the two runs differ, the model is non-deterministic and its
   mismatches are not ours — and once under bf16 autocast;
2. ``engine_run`` (``hybridtrain.initialize`` + ``train_batch``) in each mode of
   :data:`MODES` (the equivalence suite's modes of the same names), compared at the suite's
   tolerances: fp32 rtol 1e-5 / atol 1e-6, bf16 ``reduced_precision_tolerance`` for 2 steps.

Cells: ``ok``; ``refused`` (a one-line ``ConfigError`` before any work); ``mismatch(e)``
(``e`` = largest relative error of a loss or parameter); ``error`` (another exception with
a one-line message raised by hybridtrain itself); ``TRACEBACK`` (an exception from deep in
torch / transformers); ``timeout``; ``≈ok(e; why)``: a mismatch that a documented
difference accounts for — the plain loop making the engine's choice (``use_cache=False``,
autocast weight-cast cache off, fused CPU AdamW) matches, or both sides in float64 agree
(fp32 rounding amplified by AdamW), or the model's forward updates buffers (running
statistics). A model the plain loop itself cannot train with the generic batch, that needs
a download / extra package, or that stays over ``MAX_PARAMS`` is counted apart with the
reason. ``--summarize a.jsonl,b.jsonl`` rebuilds the table from earlier runs.

Run (from the repository root)::

    nice -n 19 .venv/bin/python scripts/hf_family_sweep.py [--only llama,bert] [--timeout 240] \
        [--out /tmp/hf_family_sweep]

Writes ``OUT/results.jsonl`` (one record per model, tracebacks included) and
``OUT/table.md`` (the table and the totals), and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
    os.environ.pop(_name, None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import hybridtrain as ht  # noqa: E402
from tests.equivalence import MODES as SUITE_MODES  # noqa: E402
from tests.equivalence import SEED, ModelCase, engine_run, plain_run, reduced_precision_tolerance  # noqa: E402
from tests.models.hf_tiny import SPECIAL_IDS, tiny_config  # noqa: E402

STEPS = 2
BATCH = 4
SEQ = 16
MASKED_PER_ROW = 4
MAX_PARAMS = 20_000_000
"""Larger models are not trained: on shared CPUs they take minutes and gigabytes per mode
(an unshrunk speech tokenizer of 686M parameters used 24 GB in bf16)."""
MODES = {name: SUITE_MODES[name] for name in ("plain", "accum2", "checkpoint", "swap", "stream", "offload_opt", "bf16")}
FP32_TOL = (1e-5, 1e-6)
BF16_TOL = reduced_precision_tolerance(torch.bfloat16, steps=STEPS)
_KIND_ORDER = {"seq2seq": 0, "masked": 1, "causal": 2}


@dataclass(frozen=True)
class Arch:
    """One architecture: ``model_type``, its config and model classes, the batch kind."""

    model_type: str
    config_class: str
    model_class: str
    kind: str


def architectures() -> list[Arch]:
    """Every distinct (config class, model class) of the three auto mappings."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = {"seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                "causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    found: dict[tuple[str, str], Arch] = {}
    for kind, mapping in mappings.items():  # seq2seq, then masked, then causal: the first kind wins
        for model_type, model_class in mapping.items():
            config_class = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type, "")
            key = (config_class, model_class)
            if key not in found:
                found[key] = Arch(model_type, config_class, model_class, kind)
    return sorted(found.values(), key=lambda a: (_KIND_ORDER[a.kind], a.model_type))


# ------------------------------------------------------------------------------ one model
_AUTO = {"causal": "AutoModelForCausalLM", "masked": "AutoModelForMaskedLM", "seq2seq": "AutoModelForSeq2SeqLM"}


def build(arch: Arch) -> torch.nn.Module:
    """The architecture's model from its tiny config, as a user builds it: through the auto
    class of its mapping (which hands a multimodal config's ``text_config`` to a text-only
    model class)."""
    import transformers

    config = tiny_config(getattr(transformers, arch.config_class))
    if arch.kind == "causal" and getattr(config, "is_decoder", None) is False:
        config.is_decoder = True  # BERT-style LM heads used as causal LMs, as their docs say
    model: torch.nn.Module = getattr(transformers, _AUTO[arch.kind]).from_config(config)
    set_language = getattr(model, "set_default_language", None)
    if callable(set_language):  # X-MOD: one adapter per language
        set_language(config.languages[0])
    return model


def batch_kind(arch: Arch, config: Any) -> str:
    """The batch shape: a seq2seq-mapped model without an encoder–decoder (speech LMs with
    text only) takes causal batches."""
    return "causal" if arch.kind == "seq2seq" and not getattr(config, "is_encoder_decoder", False) else arch.kind


_EQUAL_LENGTHS = {"fsmt"}
"""Encoder–decoders that derive decoder inputs from ``input_ids``: targets as long as sources."""


def batches(arch: Arch, kind: str, vocab: int, mask_id: int) -> Any:
    """The batch maker for ``arch``: every row holds the same number of labelled tokens, so
    gradient accumulation is exactly the full batch's mean (see tests/models/hf_families.py)."""
    def make(steps: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(SEED)
        out = []
        for _ in range(steps):
            ids = torch.randint(SPECIAL_IDS, vocab, (BATCH, SEQ), generator=gen)
            if kind == "causal":
                out.append({"input_ids": ids, "labels": ids.clone()})
            elif kind == "masked":
                masked = torch.rand(BATCH, SEQ, generator=gen).argsort(dim=1)[:, :MASKED_PER_ROW]
                labels = torch.full_like(ids, -100).scatter(1, masked, ids.gather(1, masked))
                out.append({"input_ids": ids.scatter(1, masked, mask_id), "labels": labels})
            else:
                length = SEQ if arch.model_type in _EQUAL_LENGTHS else SEQ // 2
                target = torch.randint(SPECIAL_IDS, vocab, (BATCH, length), generator=gen)
                out.append({"input_ids": ids, "labels": target})
        return out
    return make


def _plain_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def max_rel_err(expected: tuple[list[float], dict[str, torch.Tensor]],
                actual: tuple[list[float], dict[str, torch.Tensor]], rtol: float,
                atol: float) -> tuple[bool, float, str]:
    """``(within tolerance, largest relative error, where)``; the relative error of an element
    is ``|a - e| / max(|e|, atol / rtol)`` (elements near zero are judged by ``atol``)."""
    pairs = [("loss", torch.tensor(actual[0]), torch.tensor(expected[0]))]
    if actual[1].keys() != expected[1].keys():
        missing = sorted(set(expected[1]) ^ set(actual[1]))
        return False, math.inf, f"state-dict keys differ: {missing[:4]}"
    pairs += [(name, actual[1][name], value) for name, value in expected[1].items()]
    worst, where, close = 0.0, "", True
    for name, a, e in pairs:
        if not e.is_floating_point():
            if not torch.equal(a, e):
                return False, math.inf, name
            continue
        a, e = a.double(), e.double()
        if a.shape != e.shape:
            return False, math.inf, f"{name} shape {tuple(a.shape)} != {tuple(e.shape)}"
        close = close and bool(torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True).all())
        err = float(((a - e).abs() / e.abs().clamp_min(atol / rtol)).nan_to_num(math.inf).max()) if e.numel() else 0.0
        if err > worst:
            worst, where = err, name
    return close, worst, where


def _classify(exc: BaseException) -> dict[str, Any]:
    text = " ".join(str(exc).split())
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, ht.ConfigError):
        return {"cell": "refused", "message": text, "traceback": tb}
    ours = "/hybridtrain/" in raised_in and isinstance(exc, ValueError | RuntimeError | NotImplementedError)
    if ours and "\n" not in str(exc).strip():
        return {"cell": "error", "message": f"{type(exc).__name__}: {text}", "traceback": tb}
    where = f"{Path(raised_in).name}:{frames[-1].lineno}" if frames else "?"
    return {"cell": "TRACEBACK", "message": f"{type(exc).__name__} at {where}: {text[:300]}", "traceback": tb}


def _unavailable(exc: BaseException) -> str | None:
    """Why a model cannot be built here (download, extra package), else None."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ImportError) or "requires the" in text or "pip install" in text:
        return f"extra package: {text[:200]}"
    if isinstance(exc, OSError) and ("huggingface" in text or "offline" in text.lower() or "connect" in text):
        return f"download: {text[:200]}"
    return None


def run_model(arch: Arch, modes: list[str], out_path: str) -> None:
    """Child process: every step of one model, one JSON line appended per finished stage
    (so a hang still leaves the finished cells)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")

    def emit(**record: Any) -> None:
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    started = time.perf_counter()
    try:
        torch.manual_seed(SEED)
        model = build(arch)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        reason = _unavailable(exc)
        emit(stage="build", cell="skipped" if reason else "unbuildable",
             message=reason or f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
             traceback="".join(traceback.format_exception(exc)))
        return
    config: Any = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or getattr(config, "vocab_size", 0))
    mask_id = getattr(config, "mask_token_id", None)
    mask_id = mask_id if isinstance(mask_id, int) and 0 <= mask_id < vocab else SPECIAL_IDS - 1
    params = sum(p.numel() for p in model.parameters())
    del model
    if params > MAX_PARAMS:
        emit(stage="build", cell="unbuildable", params=params,
             message=f"{params / 1e6:.0f}M parameters after the generic shrink (a sub-config it does not reach); "
                     f"limit {MAX_PARAMS / 1e6:.0f}M: add an entry to tests/models/hf_tiny.py OVERRIDES")
        return
    kind = batch_kind(arch, config)
    case = ModelCase(arch.model_type, lambda: build(arch), batches(arch, kind, vocab, mask_id), None, _plain_loss)
    try:
        reference = plain_run(case, MODES["plain"], steps=STEPS)
        again = plain_run(case, MODES["plain"], steps=STEPS)
    except Exception as exc:  # noqa: BLE001
        emit(stage="reference", cell="undrivable", params=params,
             message=f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
             traceback="".join(traceback.format_exception(exc)))
        return
    torch.manual_seed(SEED)
    fresh = build(arch)
    names = {n for n, _ in fresh.named_parameters(remove_duplicate=False)}
    # Buffers the forward changes (running statistics): accumulation and recomputation change them too.
    stateful = [k for k, v in fresh.state_dict().items() if k not in names and v.is_floating_point()
                and k in reference[1] and not torch.equal(v, reference[1][k])]
    del fresh
    deterministic = reference[0] == again[0] and all(torch.equal(v, again[1][k]) for k, v in reference[1].items())
    _, nd_err, nd_where = max_rel_err(reference, again, *FP32_TOL)
    if not all(math.isfinite(x) for x in reference[0]):
        emit(stage="reference", cell="undrivable", params=params, message=f"non-finite plain loss {reference[0]}")
        return
    emit(stage="reference", cell="ok", params=params, seconds=time.perf_counter() - started,
         deterministic=deterministic, stateful=stateful,
         nondeterminism=None if deterministic else f"{nd_err:.2e} at {nd_where}",
         loss=reference[0])
    for name in modes:
        mode = MODES[name]
        t0 = time.perf_counter()
        try:
            expected = reference if mode.autocast_dtype is None else plain_run(case, mode, steps=STEPS)
        except Exception as exc:  # noqa: BLE001
            emit(stage=name, cell="undrivable", message=f"plain {name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        try:
            actual = engine_run(case, mode, steps=STEPS)
        except Exception as exc:  # noqa: BLE001
            emit(stage=name, seconds=time.perf_counter() - t0, **_classify(exc))
            continue
        rtol, atol = BF16_TOL if mode.autocast_dtype is not None else FP32_TOL
        close, err, where = max_rel_err(expected, actual, rtol, atol)
        explained = None if close else explain_mismatch(case, mode, actual, rtol, atol, stateful)
        emit(stage=name, cell="ok" if close else "explained" if explained else "mismatch", err=err, where=where,
             explanation=explained, seconds=time.perf_counter() - t0)


# Documented differences between the engine and the plain loop: a mismatch that vanishes
# once the plain loop makes the same choice is explained by it (and reported as such).
_VARIANTS = {
    "use_cache=False": "the engine turns Hugging Face KV caches off in recomputed (checkpointed / streamed) "
                       "models (plan/build.py disable_caches); the model's forward rounds differently without one",
    "autocast cache off": "the engine's autocast has the weight-cast cache off "
                          "(runtime/precision/scaling.py); a weight "
                          "used twice in one forward then gets its two gradients summed in fp32, not in bf16",
}


def explain_mismatch(case: ModelCase, mode: Any, actual: Any, rtol: float, atol: float,
                     stateful: list[str]) -> str | None:
    """The documented difference that accounts for a mismatch, if one does: a variant of the
    plain loop making the engine's choice that the engine's result matches, or both sides in
    float64 agreeing (the fp32 difference is rounding, amplified by AdamW)."""
    def no_caches() -> torch.nn.Module:
        model = case.build()
        for module in model.modules():
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", None):
                config.use_cache = False  # type: ignore[union-attr]
        return model

    no_cache_case = ModelCase(case.name, no_caches, case.batches, None, _plain_loss)
    patches: list[tuple[str, ModelCase, dict[str, Any]]] = [("use_cache=False", no_cache_case, {})]
    if mode.autocast_dtype is not None:
        patches += [("autocast cache off", case, {"autocast": {"cache_enabled": False}}),
                    ("use_cache=False + autocast cache off", no_cache_case, {"autocast": {"cache_enabled": False}})]
    if "zero_optimization" in mode.config or "layer_streaming" in mode.config:
        patches += [("fused CPU AdamW", case, {"AdamW": {"fused": True}})]
    for label, variant, patch in patches:
        try:
            with _patched(patch):
                reference = plain_run(variant, mode, steps=STEPS)
        except Exception:  # noqa: BLE001 - no explanation then
            continue
        if max_rel_err(reference, actual, rtol, atol)[0]:
            return label
    if mode.autocast_dtype is None and "zero_optimization" not in mode.config and "layer_streaming" not in mode.config:
        double = ModelCase(case.name, lambda: case.build().double(), case.batches, None, _plain_loss)
        try:
            # Parameters only: the engine reports an fp64 model's loss rounded to fp32.
            expected, got = plain_run(double, mode, steps=STEPS), engine_run(double, mode, steps=STEPS)
            # Far below fp32 rounding amplified by AdamW (1e-5), far above nothing: some
            # models compute parts in fp32 whatever the parameters' dtype (Gemma 4).
            close, err, _ = max_rel_err(([], expected[1]), ([], got[1]), 1e-7, 1e-10)
            if close:
                return f"fp32 rounding: float64 runs agree to {err:.0e}"
        except Exception:  # noqa: BLE001
            pass
    if stateful:
        return f"forward updates buffers ({', '.join(stateful[:2])})"
    return None


@contextlib.contextmanager
def _patched(patch: dict[str, dict[str, Any]]) -> Iterator[None]:
    """``torch.autocast`` / ``torch.optim.AdamW`` called with extra keyword arguments (the
    plain loop calls them by those names)."""
    owners = {"autocast": torch, "AdamW": torch.optim}
    originals = {name: getattr(owner, name) for name, owner in owners.items()}
    try:
        for name, kwargs in patch.items():
            setattr(owners[name], name, functools.partial(originals[name], **kwargs))
        yield
    finally:
        for name, owner in owners.items():
            setattr(owner, name, originals[name])


# ---------------------------------------------------------------------------- the sweep
def sweep_one(arch: Arch, modes: list[str], timeout: float, scratch: Path) -> dict[str, Any]:
    """Run one model in a forked child; its record (stages by name)."""
    out_path = scratch / f"{arch.model_type}-{arch.model_class}.jsonl"
    out_path.unlink(missing_ok=True)
    child = mp.get_context("fork").Process(target=run_model, args=(arch, modes, str(out_path)), daemon=True)
    started = time.perf_counter()
    child.start()
    child.join(timeout)
    timed_out = child.is_alive()
    if timed_out:
        child.kill()
        child.join()
    stages = {}
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            stage = json.loads(line)
            stages[stage.pop("stage")] = stage
    record: dict[str, Any] = {"arch": arch.__dict__, "seconds": time.perf_counter() - started, "stages": stages}
    if timed_out or child.exitcode not in (0, None):
        why = f"timeout after {timeout:g} s" if timed_out else f"child died (exit code {child.exitcode})"
        pending = next((s for s in ["reference", *modes] if s not in stages), None)
        if pending:
            stages[pending] = {"cell": "timeout" if timed_out else "TRACEBACK", "message": why}
    return record


def cell_text(stage: dict[str, Any] | None) -> str:
    """One table cell."""
    if stage is None:
        return "-"
    cell = stage["cell"]
    if cell == "mismatch":
        return f"mismatch({stage['err']:.1e})"
    if cell == "explained":
        return f"≈ok({stage['err']:.1e}; {stage['explanation']})"
    return {"undrivable": "plain fails"}.get(cell, str(cell))


_APART = ("skipped", "unbuildable", "undrivable", "timeout", "TRACEBACK")


def summarize(records: list[dict[str, Any]], modes: list[str]) -> str:
    """The markdown table, the details of every cell that is not ``ok``, the models counted
    apart, and the totals."""
    lines = ["| family | class | params | " + " | ".join(modes) + " |",
             "|---|---|---|" + "---|" * len(modes)]
    apart: list[str] = []
    details: list[str] = []
    totals: Counter[str] = Counter()
    for rec in records:
        arch, stages = rec["arch"], rec["stages"]
        head = stages.get("build") or stages.get("reference") or {}
        if head.get("cell") in _APART and not any(m in stages for m in modes):
            why = head.get("message", "")
            apart.append(f"- {arch['model_type']} ({arch['model_class']}): **{head['cell']}** — {why}")
            totals[f"model {head['cell']}"] += 1
            continue
        reference = stages.get("reference", {})
        nd = "" if reference.get("deterministic", True) else f" (non-deterministic: {reference['nondeterminism']})"
        for m in modes:
            stage = stages.get(m)
            if stage is None:
                continue
            totals[stage["cell"]] += 1
            if stage["cell"] != "ok":
                what = stage.get("message") or f"max rel err {stage.get('err', 0):.2e} at {stage.get('where')}"
                details.append(f"- {arch['model_type']} × {m}: **{cell_text(stage)}** — {what}")
        lines.append(f"| {arch['model_type']}{nd} | {arch['model_class']} | {reference.get('params', '?')} | "
                     + " | ".join(cell_text(stages.get(m)) for m in modes) + " |")
    broken = totals["mismatch"] + totals["TRACEBACK"] + totals["error"] + totals["timeout"]
    summary = (f"**Totals** (families × modes): ok {totals['ok']} / refused in one line {totals['refused']} / "
               f"broken {broken} (mismatch {totals['mismatch']}, traceback {totals['TRACEBACK']}, "
               f"error {totals['error']}, timeout {totals['timeout']}); explained differences "
               f"{totals['explained']}; plain loop fails {totals['undrivable']}; models counted apart: "
               + ", ".join(f"{k[6:]} {v}" for k, v in sorted(totals.items()) if k.startswith("model ")))
    return "\n".join([*lines, "", "Cells that are not ok:", *details, "", "Counted apart:", *apart, "", summary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    parser.add_argument("--out", default="/tmp/hf_family_sweep", help="output directory")
    parser.add_argument("--summarize", metavar="RESULTS", help="only print the table of results.jsonl files "
                        "(comma-separated; a later file's rows replace an earlier one's)")
    args = parser.parse_args(argv)
    import transformers

    if args.summarize:  # several files: a later one's record of a model replaces an earlier one's
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for path in args.summarize.split(","):
            for line in Path(path).read_text().splitlines():
                rec = json.loads(line)
                merged[rec["arch"]["model_type"], rec["arch"]["model_class"]] = rec
        print(f"transformers {transformers.__version__}, torch {torch.__version__}\n")
        print(summarize(list(merged.values()), [m for m in args.modes.split(",") if m]))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {unknown}: allowed {list(MODES)}")
    wanted = {t for t in args.only.split(",") if t}
    archs = [a for a in architectures() if not wanted or a.model_type in wanted]
    out = Path(args.out)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {len(archs)} architectures", flush=True)
    records = []
    for i, arch in enumerate(archs, 1):
        rec = sweep_one(arch, modes, args.timeout, out / "stages")
        records.append(rec)
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        cells = " ".join(f"{m}={cell_text(rec['stages'].get(m))}" for m in ["build", "reference", *modes]
                         if m in rec["stages"])
        print(f"[{i}/{len(archs)}] {arch.model_type} {arch.model_class} {rec['seconds']:.0f}s {cells}", flush=True)
    table = f"transformers {transformers.__version__}, torch {torch.__version__}\n\n" + summarize(records, modes)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
