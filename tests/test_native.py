"""ep_layer.native: a build of the kernels whose shared constants differ from ep_layer.layout's (or whose
FP8 rule differs from ep_layer.quant's) is refused when it loads, naming the constant, and so is one
whose launchers take their pointers in another order than ep_layer.kernel_args names them."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import ep_layer
from ep_layer import kernel_args, layout, native, quant


def built_module(**overrides: float | None) -> types.ModuleType:
    """A stand-in for ep_layer._C exporting the shared constants as layout has them and the FP8 rule's as
    the kernels' float32 constants hold quant's, but for `overrides` (None: not exported, as by a build
    from before the constant existed)."""
    module = types.ModuleType("ep_layer._C")
    for name in native._SHARED_CONSTANTS + native._FP8_RULE:
        home = layout if name in native._SHARED_CONSTANTS else quant
        value = overrides.get(name, float(np.float32(getattr(home, name))) if home is quant else getattr(home, name))
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


@pytest.mark.parametrize("name", native._FP8_RULE)
def test_a_kernel_build_with_another_fp8_rule_is_refused_by_name(name: str) -> None:
    """The FP8 cast's constants (ep_layer.quant, their one home) against the kernels' float32 ones: one
    float32 ulp off is refused."""
    value = float(np.nextafter(np.float32(getattr(quant, name)), np.float32(np.inf)))
    with pytest.raises(ImportError, match=f"{name} = .*, but ep_layer.quant has {name} = "):
        native._check_constants(built_module(**{name: value}))


@pytest.mark.parametrize("name,fields", [("DISPATCH_POINTERS", kernel_args.DispatchPointers._fields),
                                         ("COMBINE_POINTERS", kernel_args.CombinePointers._fields),
                                         ("NORMAL_POINTERS", kernel_args.NormalPointers._fields)])
def test_launcher_pointer_orders_must_match_kernel_args(name: str, fields: tuple[str, ...]) -> None:
    """A build whose launchers take the pointers in another order (two swapped) or lack the names."""
    module = types.ModuleType("ep_layer._C")
    module.DISPATCH_POINTERS = kernel_args.DispatchPointers._fields
    module.COMBINE_POINTERS = kernel_args.CombinePointers._fields
    module.NORMAL_POINTERS = kernel_args.NormalPointers._fields
    native._check_pointer_orders(module)
    swapped = (fields[1], fields[0], *fields[2:])
    setattr(module, name, swapped)
    with pytest.raises(ImportError, match=f"{name} in the order {swapped!r}".replace("(", r"\(").replace(")", r"\)")):
        native._check_pointer_orders(module)
    delattr(module, name)
    with pytest.raises(ImportError, match=name):
        native._check_pointer_orders(module)


@pytest.mark.parametrize("pure", [False, True], ids=["kernels", "EP_LAYER_NO_CUDA=1"])
def test_a_pure_python_install_loads_no_kernels_even_when_some_are_built(monkeypatch, pure: bool) -> None:
    """A build of the kernels (here a stand-in ep_layer._C) is loaded, unless EP_LAYER_NO_CUDA=1, which a
    pure-Python .venv sets for its Python (scripts/bootstrap.sh): a build landing in the source tree later
    does not switch it to the kernels."""
    module = built_module()
    module.DISPATCH_POINTERS = kernel_args.DispatchPointers._fields
    module.COMBINE_POINTERS = kernel_args.CombinePointers._fields
    module.NORMAL_POINTERS = kernel_args.NormalPointers._fields
    monkeypatch.setitem(sys.modules, "ep_layer._C", module)
    monkeypatch.setattr(ep_layer, "_C", module, raising=False)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    if pure:
        monkeypatch.setenv("EP_LAYER_NO_CUDA", "1")
    else:
        monkeypatch.delenv("EP_LAYER_NO_CUDA", raising=False)
    assert native.available() is not pure


def test_the_projects_venv_runs_as_it_was_bootstrapped() -> None:
    """scripts/bootstrap.sh records whether .venv has the kernels; a pure-Python one runs with EP_LAYER_NO_CUDA=1."""
    marker = Path(__file__).resolve().parent.parent / ".venv" / ".ep-layer-bootstrap"
    if not marker.exists() or Path(sys.prefix).resolve() != marker.parent.resolve():
        pytest.skip("not running in the project's .venv")
    pure = "no_cuda=1" in marker.read_text().splitlines()
    assert (os.environ.get("EP_LAYER_NO_CUDA") == "1") == pure
