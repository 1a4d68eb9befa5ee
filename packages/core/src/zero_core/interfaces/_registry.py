"""Registries of plugin-provided classes, looked up by name."""

from __future__ import annotations

from typing import Generic, TypeVar

from zero_core.base._install import install_command
from zero_core.base.errors import PluginContractError, PluginNotFoundError, ZeroSetupError
from zero_core.config._config_io import did_you_mean

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to implementations of one kind (strategies, comm backends or placement policies).

    ``get`` of an unknown name raises :class:`~zero_core.PluginNotFoundError` with the closest
    registered name, the names that are registered, and which distribution usually provides a
    missing one; ``get`` of a class that leaves an abstract method unimplemented raises
    :class:`~zero_core.PluginContractError` naming the methods.
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
            item = self._items[name]
        except KeyError:
            available = ", ".join(sorted(self._items)) or "none"
            hint = self._install_hint.get(name)
            extra = f" It is provided by {hint}: {install_command(hint)}." if hint else ""
            # a name that is not installed but known (its distribution's hint) is no typo: no suggestion then
            close = "." if hint else did_you_mean(name, self._items)
            raise PluginNotFoundError(
                f"no {self.kind} named {name!r} is registered (available: {available}){close}{extra}"
            ) from None
        missing = sorted(getattr(item, "__abstractmethods__", ()))
        if missing:  # a plugin class that cannot be built: say which methods, not Python's "Can't instantiate"
            raise PluginContractError(
                f"the {self.kind} {name!r} ({getattr(item, '__module__', '?')}.{getattr(item, '__qualname__', item)}) "
                f"does not implement {', '.join(missing)}: a {self.kind} must override every abstract method of its "
                "base class (see the plugin guide, docs/plugins.md)"
            )
        return item

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)
