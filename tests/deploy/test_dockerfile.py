"""deploy/Dockerfile: a CUDA base image, torch pinned to the version the README installs
(and pyproject allows), hybridtrain installed with extras that exist, a non-root user, and
only files that exist (and the build context keeps) copied in. Static checks: building
the image needs Docker and the network."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in _instructions() if op == "ARG" and "=" in rest)


def test_cuda_base_image_and_pinned_torch() -> None:
    args = _args()
    (base,) = [rest for op, rest in _instructions() if op == "FROM"]
    base = base.replace("${CUDA_VERSION}", args["CUDA_VERSION"])
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d\d\.04", base), base
    cuda_major = args["CUDA_VERSION"].split(".")[0]
    assert args["TORCH_CUDA"] == "cu" + cuda_major + args["CUDA_VERSION"].split(".")[1]

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"torch=={args['TORCH_VERSION']}" in readme  # the version the project is tested with
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (torch_req,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch")]
    assert torch_req.specifier.contains(args["TORCH_VERSION"])
    runs = " ".join(rest for op, rest in _instructions() if op == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and "--constraint" in runs


def test_extras_exist_and_user_is_not_root() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(_args()["EXTRAS"].split(","))
    assert extras <= set(pyproject["project"]["optional-dependencies"])
    assert "hpo" in extras  # the HPO service image runs `hybridtrain hpo serve` and optuna-dashboard
    users = [rest for op, rest in _instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(op == "ENTRYPOINT" for op, _ in _instructions())


def test_copied_files_exist_and_the_context_keeps_them() -> None:
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]

    def kept(path: str) -> bool:
        keep = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    for op, rest in _instructions():
        if op == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert kept(source), f"{source} is excluded by Dockerfile.dockerignore"
    assert kept("hybridtrain/commands/cli.py") and not kept("tests/commands/test_cli.py") and not kept(".venv")
