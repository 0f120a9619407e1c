"""Run Accelerate's and Lightning's own DeepSpeed tests against hybridtrain's drop-in and
against the real DeepSpeed on this CPU, and print pass / fail / skip counts per suite.

    python scripts/frameworks_deepspeed_tests.py ACCELERATE_GIT_DIR LIGHTNING_GIT_DIR [--only ours|real]

The arguments are git directories (a clone or a bare mirror) of huggingface/accelerate and
Lightning-AI/pytorch-lightning; the tests are read at the revisions matching the installed
packages (``--accelerate-rev``, ``--lightning-rev``). What is changed to run them on a CPU
with no network, for both runs alike:

- Accelerate: ``require_non_cpu`` is lifted (both DeepSpeeds run on the CPU); the Hub
  checkpoints ``sshleifer/tiny-gpt2`` and ``hf-internal-testing/tiny-random-gpt2`` are local
  GPT-2s of their published shapes (random weights); tests needing other Hub models fail
  for both, and are counted as "no network".
- Lightning: nothing; tests that need a GPU skip themselves.

Accelerate's tests import ``parameterized`` (``pip install parameterized``). The real
DeepSpeed runs with its op table emptied (no JIT build of the shared-memory
all-reduce, as tests/deepspeed/scripts/real_deepspeed.py).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ACCELERATE_FILES = ["tests/deepspeed"]
LIGHTNING_SUITES = [
    "tests/tests_pytorch/strategies/test_deepspeed.py",
    "tests/tests_pytorch/plugins/precision/test_deepspeed_precision.py",
    "tests/tests_fabric/strategies/test_deepspeed.py",
    "tests/tests_fabric/plugins/precision/test_deepspeed.py",
]
LIGHTNING_FILES = ["tests/tests_pytorch/conftest.py", "tests/tests_pytorch/helpers", "tests/tests_pytorch/__init__.py",
                   "tests/tests_fabric/conftest.py", "tests/tests_fabric/helpers", "tests/tests_fabric/__init__.py",
                   *LIGHTNING_SUITES]

ACCELERATE_CONFTEST = '''
import os
import tempfile

import accelerate.test_utils.testing as testing

testing.require_non_cpu = lambda test_case: test_case  # both DeepSpeeds run on the CPU here

SHAPES = {"sshleifer/tiny-gpt2": dict(n_embd=2, n_layer=2, n_head=2),
          "hf-internal-testing/tiny-random-gpt2": dict(n_embd=32, n_layer=5, n_head=4, vocab_size=1000,
                                                       n_positions=512)}


def _local(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = os.path.join(tempfile.gettempdir(), "standin-" + name.replace("/", "--"))
    if not os.path.exists(os.path.join(path, "config.json")):
        GPT2LMHeadModel(GPT2Config(**SHAPES[name])).save_pretrained(path)
    return path


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        name = getattr(item.module, "GPT2_TINY", None)
        if name in SHAPES:
            item.module.GPT2_TINY = _local(name)
'''

REAL_RUNNER = '''
import runpy, sys
import deepspeed.ops
deepspeed.ops.__compatible_ops__ = {}  # no JIT op build on the CPU
sys.argv = ["pytest", *sys.argv[1:]]
runpy.run_module("pytest", run_name="__main__")
'''

NO_NETWORK = re.compile(r"couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError")


def extract(git_dir: str, rev: str, paths: list[str], target: Path) -> None:
    for path in paths:
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", rev, path], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(target, filter="data")


def run(suite: list[str], cwd: Path, ours: bool, env: dict[str, str], log: Path) -> Counter[str]:
    runner = [sys.executable, "-m", "hybridtrain.deepspeed", "-m", "pytest"] if ours else \
        [sys.executable, str(cwd / "real_runner.py")]
    command = [*runner, "-p", "no:cacheprovider", "-rA", "--timeout", "300", *suite]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    counts: Counter[str] = Counter()
    failures = {}
    for line in result.stdout.splitlines():
        if line.startswith(("PASSED", "FAILED", "ERROR")):
            counts[line.split()[0].lower()] += 1
        match = re.match(r"SKIPPED \[(\d+)\]", line)
        if match:
            counts["skipped"] += int(match.group(1))
    # A failure whose traceback is a Hub download needs the network, for both runs.
    for block in re.split(r"\n_{3,} (\S+) _{3,}\n", result.stdout)[1:]:
        failures[len(failures)] = block
    counts["no network"] = sum(1 for text in failures.values() if NO_NETWORK.search(text))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("accelerate_git")
    parser.add_argument("lightning_git")
    parser.add_argument("--accelerate-rev", default="HEAD", help="revision (default HEAD; 1.15.0.dev0 here)")
    parser.add_argument("--lightning-rev", default="2.6.5", help="revision (default 2.6.5)")
    parser.add_argument("--only", choices=("ours", "real"), default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="framework-ds-tests-"))
    extract(args.accelerate_git, args.accelerate_rev, ACCELERATE_FILES, work / "accelerate")
    (work / "accelerate" / "conftest.py").write_text(ACCELERATE_CONFTEST)
    extract(args.lightning_git, args.lightning_rev, LIGHTNING_FILES, work / "lightning")
    for folder in (work / "accelerate", work / "lightning" / "tests"):
        (folder / "real_runner.py").write_text(REAL_RUNNER)
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    accelerate_env = {**base, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29677"}
    lightning_env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(work / "lightning" / "tests")])}
    suites = [("accelerate tests/deepspeed", ["tests/deepspeed"], work / "accelerate", accelerate_env)]
    # Lightning's two test_deepspeed.py files share a basename: one pytest run each.
    suites += [(f"lightning {path.removeprefix('tests/')}", [path.removeprefix("tests/")], work / "lightning" / "tests",
                lightning_env) for path in LIGHTNING_SUITES]
    print("| suite | run | passed | failed | errors | skipped | failures needing the network |\n"
          "|---|---|---|---|---|---|---|")
    for name, suite, cwd, env in suites:
        for ours in (True, False):
            if args.only and args.only != ("ours" if ours else "real"):
                continue
            label = "hybridtrain" if ours else "real DeepSpeed"
            counts = run(suite, cwd, ours, env, work / f"{name.replace('/', '_').replace(' ', '_')}-{label}.log")
            print(f"| {name} | {label} | {counts['passed']} | {counts['failed']} | {counts['error']} | "
                  f"{counts['skipped']} | {counts['no network']} |", flush=True)
    print(f"logs: {work}")


if __name__ == "__main__":
    main()
