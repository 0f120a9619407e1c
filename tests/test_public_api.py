"""The package's face: ``hybridtrain.initialize`` is the one public way to an engine; the road beneath it
(``prepare``, ``resolve``, ``build``, ``planned_config``) is internal and exported by no package face."""

from __future__ import annotations

import importlib

import hybridtrain


def test_every_public_name_resolves_and_initialize_is_the_way_to_an_engine() -> None:
    assert "initialize" in hybridtrain.__all__
    for name in hybridtrain.__all__:
        assert getattr(hybridtrain, name) is not None, name
    import inspect

    from hybridtrain.compose import initialize

    # The face picks the math (precision_math) and takes compose's road for autocast, with its arguments.
    def arguments(function: object) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]

    assert arguments(hybridtrain.initialize) == arguments(initialize)


def test_the_internal_road_is_exported_by_no_package_face() -> None:
    internal = {"prepare", "resolve", "build", "planned_config", "build_engine"}
    for package in ("hybridtrain", "hybridtrain.planner", "hybridtrain.config"):
        exported = set(getattr(importlib.import_module(package), "__all__", ()))
        assert exported & internal == set(), package
