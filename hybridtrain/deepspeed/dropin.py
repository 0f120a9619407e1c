"""Make ``import deepspeed`` mean hybridtrain's drop-in, in this process only.

A script written for DeepSpeed — or a framework that drives DeepSpeed for it (Hugging
Face's ``Trainer``, Accelerate, Lightning) — imports ``deepspeed`` and its submodules and
checks the installed distribution's version (``importlib.metadata.version("deepspeed")``,
``RequirementCache("deepspeed>=0.16.0")``). :func:`install` puts two finders at the front
of ``sys.meta_path``:

- a module finder: ``deepspeed`` and every ``deepspeed.X`` resolve to the same module
  objects as ``hybridtrain.deepspeed`` and ``hybridtrain.deepspeed.X`` (one object under
  two names, so ``isinstance`` checks agree); a submodule the drop-in lacks is a one-line
  ``ModuleNotFoundError`` naming it, never the real package's module;
- a distribution finder: the metadata of ``deepspeed`` is the drop-in's, at
  :data:`VERSION` (``0.19.8+hybridtrain``: the DeepSpeed release whose API and math it
  follows, marked as hybridtrain's).

Both win over a real DeepSpeed installed in the same environment, and neither needs one.
Nothing is written to disk and no environment variable is set, so other programs (and
this process before :func:`install`) see the environment as it is.
``python -m hybridtrain.deepspeed SCRIPT …`` and ``hybridtrain launch SCRIPT …`` install them
before the script runs (see :mod:`hybridtrain.deepspeed.__main__`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

NAME = "deepspeed"
OURS = "hybridtrain.deepspeed"
VERSION = "0.19.8+hybridtrain"
"""What ``deepspeed.__version__`` and the distribution's metadata say under the drop-in."""
LIGHTNING_STRATEGY_MODULES = ("lightning.pytorch.strategies.deepspeed", "lightning.fabric.strategies.deepspeed",
                              "pytorch_lightning.strategies.deepspeed", "lightning_fabric.strategies.deepspeed")
"""Lightning's and Fabric's DeepSpeed strategy modules, run on the CPU too once loaded
(:mod:`hybridtrain.deepspeed.lightning_cpu`)."""


def _ours(fullname: str) -> str | None:
    """``hybridtrain.deepspeed.X`` for ``deepspeed.X`` (None for other names)."""
    if fullname == NAME or fullname.startswith(NAME + "."):
        return OURS + fullname[len(NAME):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Gives ``deepspeed.X`` the already imported ``hybridtrain.deepspeed.X`` module."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        # The import system set __spec__ to the alias's; the module keeps its own (pickling,
        # reloading and relative imports read it).
        own = importlib.util.find_spec(self.target)
        if own is not None:
            module.__spec__ = own


class _PatchedAfterLoad(importlib.abc.Loader):
    """Loads a module with its own loader, then lets Lightning's DeepSpeed strategy run on
    the CPU (:func:`hybridtrain.deepspeed.lightning_cpu.allow_cpu`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        from hybridtrain.deepspeed.lightning_cpu import allow_cpu

        allow_cpu(module)


class DropInFinder(importlib.abc.MetaPathFinder):
    """``deepspeed`` and ``deepspeed.X`` → ``hybridtrain.deepspeed`` and ``hybridtrain.deepspeed.X``;
    Lightning's and Fabric's DeepSpeed strategy modules load as they are, then run on the CPU too."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in LIGHTNING_STRATEGY_MODULES:
            return self._patched_spec(fullname, path, target)
        ours = _ours(fullname)
        if ours is None:
            return None
        try:
            spec = importlib.util.find_spec(ours)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: hybridtrain's DeepSpeed drop-in does not provide it "
                f"(it provides {NAME!r} as {OURS!r}; see `hybridtrain.deepspeed` in the README)", name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(ours),
                                               is_package=spec.submodule_search_locations is not None)

    def _patched_spec(self, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
        """The module's own spec (from the finders after this one), loading through
        :class:`_PatchedAfterLoad`."""
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchedAfterLoad(spec.loader)
                return spec
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        """The drop-in's ``deepspeed`` distribution, for a search by that name (or for all)."""
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == NAME:
            yield DropInDistribution()


class DropInDistribution(importlib.metadata.Distribution):
    """``deepspeed``'s metadata as the drop-in presents it (version :data:`VERSION`)."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
                    "Summary: hybridtrain's DeepSpeed drop-in (hybridtrain.deepspeed)\n")
        if filename == "top_level.txt":
            return f"{NAME}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import hybridtrain.deepspeed as package

        return os.path.join(os.path.dirname(os.path.dirname(package.__file__ or "")), str(path))


_FINDER = DropInFinder()


def install() -> None:
    """Put the drop-in's finders first on ``sys.meta_path`` (idempotent).

    Raises:
        RuntimeError: the real ``deepspeed`` was already imported in this process; call
            :func:`install` before anything imports it.
    """
    loaded = sys.modules.get(NAME)
    if loaded is not None and not getattr(loaded, "__name__", "").startswith(OURS):
        raise RuntimeError("the real `deepspeed` package is already imported in this process; the drop-in must be "
                           "installed first (run the script with `python -m hybridtrain.deepspeed SCRIPT`)")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    importlib.invalidate_caches()


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _FINDER in sys.meta_path
