"""Read an engine's source file and check every call it makes on `deep_ep`'s Buffer and Config against the drop-in's
signatures, without importing the engine: its positional arguments, its keywords, and the keys of its
`**dict(...)` arguments. Keywords of DeepEP forks pass when the drop-in refuses them by name
(`ep_layer.buffer._FORK_ONLY`, NotImplementedError); `elsewhere` names keywords an engine passes only on other
hardware. Used by tests/test_dropin_sglang.py and tests/test_dropin_vllm.py.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path

from ep_layer.buffer import _FORK_ONLY

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("deep_ep") is None:  # not installed (scripts/bootstrap.sh installs it): the checkout's
    sys.path.append(str(ROOT / "dropin"))
import deep_ep  # noqa: E402


def dict_keys(node: ast.AST, assigned: Mapping[str, set[str]], where: str) -> set[str]:
    """The keys a `**splat` may carry: those of dict(...) calls (and dict literals) in it, either branch of a
    conditional, or of a name assigned such a dict (plus its `name["key"] = ...` stores). A name assigned no
    such dict (SGLang's `--deepep-config` JSON, passed to Config) adds no key."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.IfExp):
        return dict_keys(node.body, assigned, where) | dict_keys(node.orelse, assigned, where)
    if isinstance(node, ast.Name):
        return assigned.get(node.id, set())
    raise AssertionError(f"{where}: a ** argument this check cannot read: {ast.unparse(node)}")


def dict_names(tree: ast.AST) -> dict[str, set[str]]:
    """Per name, the keys of the dicts assigned to it anywhere in the file."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    out.setdefault(target.id, set()).update(dict_keys(node.value, out, ""))
                except AssertionError:
                    continue  # not a dict
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and \
                    isinstance(target.slice, ast.Constant):
                out.setdefault(target.value.id, set()).add(target.slice.value)
    return out


def buffer_calls(tree: ast.AST, receivers: set[str], constructors: set[str]) -> list[tuple[str, ast.Call]]:
    """(name of the deep_ep callable, call) for every call of a method on one of `receivers` (the expressions the
    file names deep_ep's Buffer class or a Buffer by), and of `constructors` ("Buffer", "Config": where the file
    imports them from deep_ep by those names)."""
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in constructors:
            calls.append((node.func.id, node))
        elif isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in receivers:
            calls.append((node.func.attr, node))
    return calls


def drop_in_signature(name: str) -> inspect.Signature:
    """The signature the drop-in offers for `name`, as a call sees it: no self, and no **catch-all (the Buffer
    takes other keywords only to refuse them with a message)."""
    if name in ("Buffer", "Config"):
        sig = inspect.signature(getattr(deep_ep, name))
    else:
        sig = inspect.signature(getattr(deep_ep.Buffer, name))
        if not isinstance(inspect.getattr_static(deep_ep.Buffer, name), (staticmethod, classmethod)):
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD])


def check_calls(path: Path, label: str, receivers: set[str], constructors: set[str] = frozenset(),
                elsewhere: Mapping[str, str] = {}) -> set[str]:
    """Check every deep_ep call in the file at `path` (`label`: its name in messages); returns the names called."""
    tree = ast.parse(path.read_text(), filename=str(path))
    assigned = dict_names(tree)
    seen = set()
    for name, call in buffer_calls(tree, receivers, constructors):
        where = f"{label}:{call.lineno}: {ast.unparse(call)[:120]}"
        assert hasattr(deep_ep, name) or hasattr(deep_ep.Buffer, name), f"{where}: the drop-in has no {name}"
        sig = drop_in_signature(name)
        positional = [a for a in call.args if not isinstance(a, ast.Starred)]
        assert len(positional) == len(call.args), f"{where}: *args this check cannot read"
        keywords = {k.arg for k in call.keywords if k.arg}
        try:
            sig.bind(*range(len(positional)), **dict.fromkeys(keywords))
        except TypeError as exc:
            raise AssertionError(f"{where}: does not bind to deep_ep's {name}{sig}: {exc}") from exc
        for splat in (k.value for k in call.keywords if k.arg is None):
            for key in dict_keys(splat, assigned, where):
                assert key in sig.parameters or key in _FORK_ONLY.get(name, ()) or key in elsewhere, \
                    f"{where}: passes {key}=, which deep_ep's {name}{sig} does not take"
        seen.add(name)
    return seen
