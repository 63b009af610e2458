"""A package's public names loaded on first use (PEP 562): a package whose submodules are
heavy (JAX, reasoning-gym) lets the light ones be imported without them."""

import importlib
from collections.abc import Callable
from typing import Any


def module_attributes(
    package: str, home: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose name N lives in its submodule
    `home[N]`; a name once loaded is kept in the package's `namespace` (its globals)."""

    def getattr_(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *home])

    return getattr_, dir_
