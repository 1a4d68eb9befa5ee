"""zero-core: interfaces, plugin system and runtime of the zero sharded data-parallel trainer.

The one verb is :func:`shard`; everything else here configures, saves or inspects what it
returns. What plugins (strategies, comm backends, placement policies) need lives in
:mod:`zero_core.plugin`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_core.base._version import __version__

# [Note: a lazy package]
# ``import zero_core`` imports no torch: each public name is imported from its module on first use (PEP 562), so
# ``zero --help`` and ``zero --version`` answer in a fraction of a second while ``from zero_core import shard``
# and ``zero_core.ZeroConfig`` work exactly as eager imports did (tests/test_cli.py checks the first by
# sys.modules, packages/core/tests check the names).
_HOME = {
    # the public submodules themselves: reachable as attributes after `import zero_core`, as before
    **{name: None for name in ("api", "chunk", "comm", "errors", "hookspecs", "mesh", "placement", "plugin", "strategy")},
    "AsyncSave": "zero_core.checkpoint._async_save",
    "clip_grad_norm_": "zero_core._clip",
    "DeepSpeedConversion": "zero_core.tools._deepspeed",
    "environment_report": "zero_core.tools._environment",
    "config_from_deepspeed": "zero_core.tools._deepspeed",
    "convert_deepspeed_config": "zero_core.tools._deepspeed",
    "DeepSpeedLRScheduler": "zero_core.tools._deepspeed_lr",
    "deepspeed_lr_scheduler": "zero_core.tools._deepspeed_lr",
    "Estimate": "zero_core.tools._estimate",
    "estimate": "zero_core.tools._estimate",
    "lazy_init": "zero_core.setup._lazy",
    "ZeroModule": "zero_core._module",
    "load_checkpoint": "zero_core._persist",
    "save_checkpoint": "zero_core._persist",
    "save_full_state_dict": "zero_core._persist",
    "ZeroStorageReader": "zero_core.checkpoint._dcp",
    "Sharded": "zero_core._shard",
    "shard": "zero_core._shard",
    "ChunkPolicy": "zero_core.config.api",
    "LossScale": "zero_core.config.api",
    "Precision": "zero_core.config.api",
    "ZeroConfig": "zero_core.config.api",
    "CommStats": "zero_core.comm.backend",
    **{name: "zero_core.base.errors" for name in (
        "CheckpointError", "CollectiveTimeoutError", "ConfigError", "DeepSpeedConfigWarning", "GradientLostError",
        "PluginContractError", "PluginNotFoundError", "RanksDisagreeError", "RanksOutOfStepError", "ZeroError",
        "ZeroSetupError")},
}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from zero_core import plugin  # noqa: F401 - the submodule, as an attribute
    from zero_core._clip import clip_grad_norm_
    from zero_core._module import ZeroModule
    from zero_core._persist import load_checkpoint, save_checkpoint, save_full_state_dict
    from zero_core._shard import Sharded, shard
    from zero_core.base.errors import (
        CheckpointError,
        CollectiveTimeoutError,
        ConfigError,
        DeepSpeedConfigWarning,
        GradientLostError,
        PluginContractError,
        PluginNotFoundError,
        RanksDisagreeError,
        RanksOutOfStepError,
        ZeroError,
        ZeroSetupError,
    )
    from zero_core.checkpoint._async_save import AsyncSave
    from zero_core.checkpoint._dcp import ZeroStorageReader
    from zero_core.comm.backend import CommStats
    from zero_core.config.api import ChunkPolicy, LossScale, Precision, ZeroConfig
    from zero_core.setup._lazy import lazy_init
    from zero_core.tools._deepspeed import DeepSpeedConversion, config_from_deepspeed, convert_deepspeed_config
    from zero_core.tools._deepspeed_lr import DeepSpeedLRScheduler, deepspeed_lr_scheduler
    from zero_core.tools._environment import environment_report
    from zero_core.tools._estimate import Estimate, estimate


_SUBMODULE_HOMES = {  # public submodules that moved into a room: their homes (the old paths warn)
    "api": "zero_core.config.api",
    "chunk": "zero_core.chunks.chunk",
    "errors": "zero_core.base.errors",
    "hookspecs": "zero_core.interfaces.hookspecs",
    "mesh": "zero_core.interfaces.mesh",
    "placement": "zero_core.interfaces.placement",
    "strategy": "zero_core.interfaces.strategy",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'zero_core' has no attribute {name!r}")
    home = _HOME[name]
    value = importlib.import_module(_SUBMODULE_HOMES.get(name, f"zero_core.{name}")) if home is None else getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = [
    "AsyncSave",
    "CheckpointError",
    "ChunkPolicy",
    "CollectiveTimeoutError",
    "CommStats",
    "ConfigError",
    "DeepSpeedConfigWarning",
    "DeepSpeedConversion",
    "DeepSpeedLRScheduler",
    "Estimate",
    "GradientLostError",
    "LossScale",
    "PluginContractError",
    "PluginNotFoundError",
    "Precision",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "Sharded",
    "ZeroConfig",
    "ZeroError",
    "ZeroModule",
    "ZeroSetupError",
    "ZeroStorageReader",
    "__version__",
    "clip_grad_norm_",
    "config_from_deepspeed",
    "convert_deepspeed_config",
    "deepspeed_lr_scheduler",
    "environment_report",
    "estimate",
    "lazy_init",
    "load_checkpoint",
    "save_checkpoint",
    "save_full_state_dict",
    "shard",
]
