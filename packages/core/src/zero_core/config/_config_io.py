"""Frozen config dataclasses as plain data and as JSON, TOML or YAML files.

A codec that knows no config class: ``zero_core.config.api`` passes its classes in (``nested`` names
the fields that hold another dataclass), so the config objects stay a leaf that imports nothing
of zero's but this and the errors.

[Note: the config file schema]
A config is written as nested tables that mirror the dataclasses: ``precision``,
``precision.loss_scale`` and ``chunk`` are tables of their fields, every other field is a
scalar. Three rules make every format read back exactly what was written:

- dtypes are written as ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``Precision`` accepts them);
- a field whose value is ``None`` is left out, because TOML has no null: every field that
  may be ``None`` (``comm_backend``, ``device``, ``precision.compute``, ``precision.loss_scale``,
  ``chunk.chunk_size``) defaults to ``None``, so a missing key reads back as the same ``None``;
- ``placement_options`` is a table of the placement policy's keyword arguments. A policy's
  config object (``zero_offload.StaticConfig(...)``) is written as the fields that differ
  from its defaults and reads back as that mapping, which the policy turns into an equal
  config object (``TierConfig.from_options``); a mapping is written as it is (TOML refuses
  a ``None`` inside it: leave the key out instead).

Every other field is written, defaults included, so a file records what ran even if a later
release changes a default. Reading checks every key: an unknown one fails with the closest
valid name, and a value the dataclasses refuse fails with its full key path
(``precision.compute``) in front of their message.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import tomllib
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Self, TypeVar

import torch

from zero_core.base.errors import ConfigError

T = TypeVar("T")

__all__ = ["FORMATS", "KeywordsChecked", "Nested", "dataclass_from_dict", "dataclass_to_dict", "did_you_mean", "keep_old_keywords",
           "read_file", "renamed_fields", "write_file"]

#: File suffix -> format name.
FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: Per dataclass, the fields that hold another dataclass (by field name): they become nested tables.
Nested = Mapping[type, Mapping[str, type]]
_OPTIONS = "placement_options"


# ---------------------------------------------------------------------------------------- to plain data

def dataclass_to_dict(obj: Any, nested: Nested) -> dict[str, Any]:
    """``obj`` as nested dicts of str, int, float and bool, see [Note: the config file schema]."""
    inner = nested.get(type(obj), {})
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if f.name in inner:
            value = dataclass_to_dict(value, nested)
        elif isinstance(value, torch.dtype):
            value = _DTYPE_NAMES[value]
        elif f.name == _OPTIONS:
            value = _options_to_dict(value)
        out[f.name] = value
    return out


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _options_to_dict(options: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        # The fields that differ from the defaults: what the user chose, and never a None default (TOML has no null).
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                   if getattr(options, f.name) != _field_default(f)}
    return _plain(options, _OPTIONS)


def _plain(value: Any, path: str) -> Any:
    """A copy of ``value`` made of dicts, lists and scalars, or a ConfigError naming the first thing that is not."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{path} has the key {key!r}; config files hold string keys only: use its name as a string.")
            out[key] = _plain(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{path}[{n}]") for n, item in enumerate(value)]
    raise ConfigError(
        f"{path} is a {type(value).__name__} ({value!r}), which a config file cannot hold; "
        "use strings, numbers, booleans, lists and tables."
    )


# ---------------------------------------------------------------------------------------- from plain data

def dataclass_from_dict(cls: type, data: Any, nested: Nested, prefix: str = "") -> Any:
    """Build ``cls`` from nested mappings, see [Note: the config file schema]."""
    where = prefix.rstrip(".") or "the config"
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} must be a table of {cls.__name__} fields (a dict, JSON object or TOML table), "
            f"got {type(data).__name__} {data!r}."
        )
    names = [f.name for f in dataclasses.fields(cls)]
    inner = nested.get(cls, {})
    renamed = renamed_fields(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in renamed:  # a file written before the rename: read as the new key, with a warning
            if renamed[key] in data:
                raise ConfigError(f"{prefix}{key} and {prefix}{renamed[key]} are both set; {key} is the deprecated "
                                  f"name of {renamed[key]}: keep {prefix}{renamed[key]} only.")
            key = new_name(cls, key, renamed[key], instead=f"write the key {prefix}{renamed[key]} instead", stacklevel=4)
        if key not in names:
            raise _unknown_key(key, names, prefix)
        if key in inner:
            value = dataclass_from_dict(inner[key], value, nested, f"{prefix}{key}.")
        elif key == _OPTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{prefix}{key} must be a table of the placement policy's options, for example "
                    f"{{\"offload_optim_frac\": 1.0}}, got {type(value).__name__} {value!r}."
                )
            value = _plain(value, f"{prefix}{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError as err:  # the dataclass's own check, told which key it was about
        raise ConfigError(f"{_blame(cls, str(err), prefix, names)}: {err}") from err


def _unknown_key(key: object, names: list[str], prefix: str) -> ConfigError:
    where = f"in {prefix.rstrip('.')}" if prefix else "at the top level"
    return ConfigError(f"unknown config key '{prefix}{key}'{did_you_mean(key, names, prefix)} "
                       f"Valid keys {where}: {', '.join(names)}.")


def did_you_mean(key: object, names: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the name in ``names`` closest to a mistyped ``key`` (``prefix`` before it), else
    ``"."``: the suggestion of every unknown-name message (config keys and keywords, plugin names)."""
    close = difflib.get_close_matches(str(key), list(names), n=1)
    return f"; did you mean '{prefix}{close[0]}'?" if close else "."


class KeywordsChecked:
    """Base of the config dataclasses (frozen, keyword-only): an unknown keyword argument to the constructor
    (or to ``dataclasses.replace``) raises :class:`~zero_core.ConfigError` with the closest field, as the file and
    dict loaders do, instead of Python's bare ``TypeError``. It checks in ``__new__``, before the dataclass's own
    ``__init__`` runs, so that ``__init__`` stays the generated one (type checkers, ``replace`` and pickling, which
    calls ``__new__`` without arguments, see the plain dataclass)."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        if kwargs:  # (positional arguments are left to __init__'s TypeError: keyword-only is Python's own rule)
            names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
            renamed = renamed_fields(cls)
            for key in kwargs:
                if key not in names and key not in renamed:
                    raise ConfigError(f"{cls.__name__} has no field {key!r}{did_you_mean(key, names)} "
                                      f"Its fields: {', '.join(names)}.")
        return super().__new__(cls)


def renamed_fields(cls: type) -> Mapping[str, str]:
    """The old names of ``cls``'s renamed fields -> their new names (see :func:`keep_old_keywords`)."""
    renamed: Mapping[str, str] = getattr(cls, "_renamed_fields", {})
    return renamed


def new_name(cls: type, old: str, new: str, *, instead: str, stacklevel: int = 3) -> str:
    """Warn that ``old`` (a keyword or a file key of ``cls``) is the deprecated name of ``new``; return ``new``."""
    warnings.warn(f"{cls.__name__}.{old} is deprecated: it was renamed {new}; {instead}. The old name will be "
                  "removed in a later release.", DeprecationWarning, stacklevel=stacklevel)
    return new


def keep_old_keywords(**renamed: str) -> Callable[[type[T]], type[T]]:
    """Class decorator (outside ``@dataclass``): each ``old=new`` keeps a renamed field's old keyword working as
    a deprecated alias of the new one. The constructor (and ``dataclasses.replace``) takes ``old=`` with a
    ``DeprecationWarning`` and refuses ``old=`` together with a ``new=`` that is not None (``replace`` passes
    every field, so ``new=None`` is no choice of the caller's); the dataclass's own ``__init__`` runs underneath,
    unchanged. Reading ``obj.old`` is the class's own business (a property)."""

    def wrap(cls: type[T]) -> type[T]:
        generated = cls.__init__

        @functools.wraps(generated)
        def __init__(self: Any, **kwargs: Any) -> None:
            for old, new in renamed.items():
                if old in kwargs:
                    if kwargs.get(new) is not None:
                        raise ConfigError(f"{cls.__name__} got both {old}= and {new}=; {old} is the deprecated name "
                                          f"of {new}: pass {new}= only.")
                    kwargs[new_name(cls, old, new, instead=f"pass {new}= instead")] = kwargs.pop(old)
            generated(self, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        cls._renamed_fields = dict(renamed)  # type: ignore[attr-defined]
        return cls

    return wrap


def _blame(cls: type, message: str, prefix: str, names: list[str]) -> str:
    """The key path a dataclass's message is about: the field it names (``Precision.compute``), else its table."""
    for match in re.finditer(rf"\b{cls.__name__}\.(\w+)", message):
        if match.group(1) in names:
            return prefix + match.group(1)
    return prefix.rstrip(".") or "the config"


# ---------------------------------------------------------------------------------------- files

def _format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"cannot tell the format of config file {str(path)!r} from its suffix {path.suffix!r}; "
            f"name it with one of {', '.join(FORMATS)}."
        )
    return fmt


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError("YAML config files need PyYAML: pip install pyyaml (or use a .json or .toml file).") from None
    return yaml


def read_file(path: str | os.PathLike[str], build: Callable[[Any], Any]) -> Any:
    """``build`` applied to the plain data of a .json, .toml, .yaml or .yml file; its errors name the file."""
    path = Path(path)
    fmt = _format(path)
    text = path.read_text(encoding="utf-8")
    parsers: dict[str, Callable[[str], Any]] = {
        "json": json.loads,
        "toml": tomllib.loads,
        "yaml": lambda s: _yaml().safe_load(s),
    }
    try:
        data = parsers[fmt](text)
    except ConfigError:
        raise
    except Exception as err:  # each parser has its own error class; all say where the syntax broke
        raise ConfigError(f"{path} is not valid {fmt.upper()}: {err}") from err
    if data is None and fmt == "yaml":  # an empty YAML document, like an empty TOML file: every default
        data = {}
    try:
        return build(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err


def write_file(data: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write plain ``data`` to a .json, .toml, .yaml or .yml file (the format follows the suffix)."""
    path = Path(path)
    fmt = _format(path)
    if fmt == "json":
        text = json.dumps(data, indent=2) + "\n"
    elif fmt == "toml":
        text = _toml_table(data, ())
    else:
        text = _yaml().safe_dump(data, sort_keys=False)
    path.write_text(text, encoding="utf-8")


# A small TOML writer: the standard library reads TOML but does not write it, and a config is
# only tables, scalars and lists.
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _toml_table(table: Mapping[str, Any], path: tuple[str, ...]) -> str:
    lines = [f"{_toml_key(k)} = {_toml_value(v, path + (k,))}" for k, v in table.items() if not isinstance(v, Mapping)]
    text = "".join(line + "\n" for line in lines)
    for key, sub in table.items():
        if isinstance(sub, Mapping):
            header = ".".join(_toml_key(k) for k in path + (key,))
            text += f"\n[{header}]\n" + _toml_table(sub, path + (key,))
    return text


def _toml_value(value: Any, path: tuple[str, ...]) -> str:
    if value is None:
        raise ConfigError(
            f"{'.'.join(path)} is None, which TOML cannot hold (it has no null); leave the key out "
            "(the option's default applies) or write a .json or .yaml file."
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")) if not math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):  # only inside a list; a table elsewhere gets its own [header]
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v, path + (k,))}" for k, v in value.items()) + "}"
    return "[" + ", ".join(_toml_value(v, path) for v in value) + "]"
