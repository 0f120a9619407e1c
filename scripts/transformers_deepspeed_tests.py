"""Run transformers' own DeepSpeed tests (``tests/deepspeed/test_deepspeed.py``) against
hybridtrain's drop-in and against the real DeepSpeed on this CPU, and print pass / fail / skip
counts for each.

    python scripts/transformers_deepspeed_tests.py TRANSFORMERS_DIR [--only ours|real] [-k EXPRESSION]

``TRANSFORMERS_DIR`` holds transformers' test files at their repository paths (a checkout, or
only these): ``tests/deepspeed/test_deepspeed.py``, ``tests/deepspeed/ds_config_zero2.json``,
``tests/deepspeed/ds_config_zero3.json`` and the Trainer test helpers the suite imports from
``tests.trainer.test_trainer`` (``tests/trainer/test_trainer.py``, or
``tests/trainer/trainer_test_utils.py``, where newer trees keep ``get_regression_trainer``,
``RegressionPreTrainedModel`` and ``TrainerIntegrationCommon``; the suite then imports them through
a one-line ``test_trainer.py``). Nothing of transformers is kept in this repository. The files
are laid out in a temporary directory and run twice with ``pytest`` (``pip install parameterized
pytest-timeout``); ``transformers.testing_utils`` is the installed package's.

What is changed to run them on a CPU with no network, for both runs alike:

- ``require_torch_accelerator`` and ``require_torch_fp16`` are lifted: both DeepSpeeds run on the
  CPU (``TrainerIntegrationDeepSpeed`` would otherwise skip every test on a CPU); so is
  ``TrainingArguments``' check that a GPU supports bf16 (it asks for ``use_cpu``, which the tests
  do not pass).
- The Hub checkpoints ``patrickvonplaten/t5-tiny-random``, ``sshleifer/tiny-gpt2`` and
  ``hf-internal-testing/tiny-random-gptj`` are local models of those architectures built from a
  config (random weights); tests needing a tokenizer or the repository's fixtures fail for both
  and are counted as "needing the network or fixtures".
- The real DeepSpeed runs with every op reported incompatible (no JIT build of the shared-memory
  all-reduce) and its CPU accelerator told that fp16 is supported (DeepSpeed 0.19.8 refuses fp16
  on a CPU without mkldnn fp16: "Type fp16 is not supported on your device"; torch computes fp16
  on any CPU), as ``tests/deepspeed/scripts/real_deepspeed.py`` does.
- ``TestDeepSpeedWithLauncher`` stays ``@slow`` (it runs the ``deepspeed`` launcher on the
  repository's examples): skipped for both.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frameworks_deepspeed_tests import run  # noqa: E402  (a script beside this one)

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/deepspeed/test_deepspeed.py", "tests/deepspeed/ds_config_zero2.json",
         "tests/deepspeed/ds_config_zero3.json"]
HELPERS = ("tests/trainer/test_trainer.py", "tests/trainer/trainer_test_utils.py")
HELPER_NAMES = ("get_regression_trainer", "RegressionPreTrainedModel", "TrainerIntegrationCommon")

CONFTEST = '''
import os
import tempfile

import transformers.testing_utils as testing

testing.require_torch_accelerator = lambda test_case: test_case  # both DeepSpeeds run on the CPU here
testing.require_torch_fp16 = lambda test_case: test_case
import transformers.training_args as training_args

training_args.is_torch_bf16_gpu_available = lambda: True  # bf16 on the CPU without use_cpu, as on a GPU


def _t5():
    from transformers import T5Config, T5Model
    return T5Model(T5Config(vocab_size=1000, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4))


def _gpt2():
    from transformers import GPT2Config, GPT2Model
    return GPT2Model(GPT2Config(n_embd=2, n_layer=2, n_head=2))


def _gptj():
    from transformers import GPTJConfig, GPTJModel
    return GPTJModel(GPTJConfig(vocab_size=1000, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=512))


STAND_INS = {"T5_TINY": _t5, "GPT2_TINY": _gpt2, "GPTJ_TINY": _gptj}


def _local(name, build):
    path = os.path.join(tempfile.gettempdir(), "hf-standin-" + name)
    if not os.path.exists(os.path.join(path, "config.json")):
        build().save_pretrained(path)
    return path


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for name, build in STAND_INS.items():
            if isinstance(getattr(item.module, name, None), str) and "/" in getattr(item.module, name):
                setattr(item.module, name, _local(name, build))
'''

SHIM = '''from tests.trainer.trainer_test_utils import *  # noqa: F401,F403  (the helpers the suite imports from here)
from tests.trainer.trainer_test_utils import (  # noqa: F401
    RegressionModelConfig, RegressionPreTrainedModel, TrainerIntegrationCommon, get_regression_trainer)
'''

REAL_RUNNER = '''
import runpy, sys
import deepspeed.ops
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
ops = deepspeed.ops.__compatible_ops__
deepspeed.ops.__compatible_ops__ = {name: False for name in ops}  # no JIT op build on the CPU
CPU_Accelerator.is_fp16_supported = lambda self: True  # torch computes fp16 on any CPU
sys.argv = ["pytest", *sys.argv[1:]]
runpy.run_module("pytest", run_name="__main__")
'''

NEEDS_OUTSIDE = re.compile(r"couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError|"
                           r"fixtures/tests_samples|OfflineModeIsEnabled")


def lay_out(source: Path, work: Path) -> None:
    """The suite's files under ``work`` at their repository paths, plus the conftest, the real
    DeepSpeed's runner and (for newer trees) the ``test_trainer`` shim."""
    for path in SUITE:
        if not (source / path).is_file():
            raise SystemExit(f"{source / path} is missing: TRANSFORMERS_DIR must hold transformers' {path}")
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / path, work / path)
    helpers = [path for path in HELPERS if (source / path).is_file()]
    if not helpers:
        raise SystemExit(f"{source} has neither of {', '.join(HELPERS)}: the suite imports its Trainer helpers")
    for path in helpers:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / path, work / path)
    trainer = work / HELPERS[0]
    if not trainer.is_file() or not all(name in trainer.read_text() for name in HELPER_NAMES):
        trainer.write_text(SHIM)
    for package in ("tests", "tests/trainer", "tests/deepspeed"):
        (work / package / "__init__.py").touch()
    (work / "conftest.py").write_text(CONFTEST)
    (work / "real_runner.py").write_text(REAL_RUNNER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transformers_dir", type=Path)
    parser.add_argument("--only", choices=("ours", "real"), default=None)
    parser.add_argument("-k", dest="expression", default=None, help="pytest -k expression (a subset)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="transformers-ds-tests-"))
    lay_out(args.transformers_dir.resolve(), work)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(work), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    suite = [SUITE[0], *(["-k", args.expression] if args.expression else [])]
    print("| run | passed | failed | errors | skipped | failures needing the network or fixtures |\n"
          "|---|---|---|---|---|---|")
    for ours in (True, False):
        if args.only and args.only != ("ours" if ours else "real"):
            continue
        label = "hybridtrain" if ours else "real DeepSpeed"
        log = work / f"transformers-{label.replace(' ', '_')}.log"
        counts: Counter[str] = run(suite, work, ours, env, log)
        failures = re.split(r"\n_{3,} (\S+) _{3,}\n", log.read_text())[1:]
        counts["no network"] = sum(1 for block in failures if NEEDS_OUTSIDE.search(block))
        print(f"| {label} | {counts['passed']} | {counts['failed']} | {counts['error']} | {counts['skipped']} | "
              f"{counts['no network']} |", flush=True)
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
