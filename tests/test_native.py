"""ep_layer.native: a build of the kernels whose shared constants differ from ep_layer.layout's is
refused when it loads, naming the constant."""

from __future__ import annotations

import types

import pytest

from ep_layer import layout, native


def built_module(**overrides: int | None) -> types.ModuleType:
    """A stand-in for ep_layer._C exporting the shared constants as layout has them, but for `overrides`
    (None: not exported, as by a build from before the constant existed)."""
    module = types.ModuleType("ep_layer._C")
    for name in native._SHARED_CONSTANTS:
        value = overrides.get(name, getattr(layout, name))
        if value is not None:
            setattr(module, name, value)
    return module


def test_matching_constants_load() -> None:
    native._check_constants(built_module())


@pytest.mark.parametrize("name", native._SHARED_CONSTANTS)
@pytest.mark.parametrize("built", ["off by one", "missing"])
def test_a_differing_constant_is_refused_by_name(name: str, built: str) -> None:
    value = None if built == "missing" else getattr(layout, name) + 1
    with pytest.raises(ImportError, match=f"{name} = {value}, but ep_layer.layout has {name} = "):
        native._check_constants(built_module(**{name: value}))
