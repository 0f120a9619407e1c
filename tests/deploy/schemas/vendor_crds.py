"""Re-create the vendored CRD schemas in this directory from the upstream repositories.

    python tests/deploy/schemas/vendor_crds.py TRAINING_OPERATOR_GIT_DIR PROMETHEUS_OPERATOR_GIT_DIR

Each argument is a clone (or bare git directory) of github.com/kubeflow/training-operator and
github.com/prometheus-operator/prometheus-operator. Only the served version's
``openAPIV3Schema`` is kept, with ``description`` texts removed (they are most of the
size and play no part in validation); a header names the source file and commit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCES = [
    # (output, repository, ref, path, version)
    ("kubeflow.org_pytorchjobs.v1.yaml", "kubeflow/training-operator", "v1.9.0",
     "manifests/base/crds/kubeflow.org_pytorchjobs.yaml", "v1"),
    ("monitoring.coreos.com_podmonitors.v1.yaml", "prometheus-operator/prometheus-operator", "HEAD",
     "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml", "v1"),
]


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def main(training_operator: str, prometheus_operator: str) -> None:
    dirs = {"kubeflow/training-operator": training_operator,
            "prometheus-operator/prometheus-operator": prometheus_operator}
    for out, repo, ref, path, version in SOURCES:
        git = ["git", "--git-dir", dirs[repo]] if not Path(dirs[repo], ".git").exists() else \
              ["git", "-C", dirs[repo]]
        commit = subprocess.check_output([*git, "rev-parse", f"{ref}^{{commit}}"], text=True).strip()
        crd = yaml.safe_load(subprocess.check_output([*git, "show", f"{commit}:{path}"], text=True))
        (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        schema = _strip(served["schema"]["openAPIV3Schema"])
        header = (f"# Vendored from https://github.com/{repo}/blob/{commit}/{path}\n"
                  f"# ({crd['spec']['names']['kind']} {crd['spec']['group']}/{version}, ref {ref}, commit {commit}):\n"
                  "# the version's openAPIV3Schema with description texts removed.\n"
                  "# Re-create with tests/deploy/schemas/vendor_crds.py.\n")
        body = yaml.safe_dump({"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
                               "version": version, "openAPIV3Schema": schema}, sort_keys=False, width=120)
        (HERE / out).write_text(header + body, encoding="utf-8")
        print(f"wrote {out} from {repo}@{commit[:12]}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
