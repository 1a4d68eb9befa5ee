"""Registries of plugin-provided classes, looked up by name."""

from __future__ import annotations

from typing import Generic, TypeVar

from zero_core._install import install_command
from zero_core.errors import PluginNotFoundError, ZeroSetupError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to implementations of one kind (strategies, comm backends or placement policies).

    ``get`` of an unknown name raises :class:`~zero_core.PluginNotFoundError` listing the
    names that are registered, and which distribution usually provides a missing one.
    """

    def __init__(self, kind: str, *, install_hint: dict[str, str] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._install_hint = install_hint or {}

    def add(self, name: str, item: T) -> None:
        if not isinstance(name, str) or not name:
            raise ZeroSetupError(f"a {self.kind} must be registered under a non-empty name, got {name!r}")
        if name in self._items and self._items[name] is not item:
            raise ZeroSetupError(
                f"two plugins register a {self.kind} named {name!r}: {self._items[name]!r} and {item!r}; "
                "uninstall one or block it with ZERO_BLOCKED_PLUGINS"
            )
        self._items[name] = item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            available = ", ".join(sorted(self._items)) or "none"
            hint = self._install_hint.get(name)
            extra = f" It is provided by {hint}: {install_command(hint)}." if hint else ""
            raise PluginNotFoundError(
                f"no {self.kind} named {name!r} is registered (available: {available}).{extra}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)
