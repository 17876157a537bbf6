"""Stand-in packages for CUDA-only imports SGLang's CPU path makes but never calls.

`make_package(module)` turns a package's module into one whose every attribute, and every
submodule under it, resolves to a placeholder: importing names from it succeeds, calling one
raises `NotImplementedError` naming it. A call reaching a stand-in is a path this CPU install
does not support, and says so rather than doing anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn


class Missing:
    """A name of a stand-in package: attribute access gives deeper names, a call raises."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{self._name} is a stand-in of OwnerServe's SGLang CPU install (workers/sglang_cpu):"
            " the CUDA-only package it belongs to is not installed"
        )

    def __getattr__(self, attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _module_getattr(name: str) -> Any:
    def getattr_(attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{name}.{attr}")

    return getattr_


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `<root>.<anything>` as another stand-in package."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def make_package(name: str) -> None:
    """Make the already-imported package `name` a stand-in (see the module docstring)."""
    module = sys.modules[name]
    module.__getattr__ = _module_getattr(name)  # type: ignore[method-assign]
    module.__path__ = []
    sys.meta_path.insert(0, _SubmoduleFinder(name))
