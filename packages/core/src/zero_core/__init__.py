"""zero-core: interfaces, plugin system and runtime of the zero sharded data-parallel trainer.

The one verb is :func:`shard`; everything else here configures, saves or inspects what it
returns. What plugins (strategies, comm backends, placement policies) need lives in
:mod:`zero_core.plugin`.
"""

from zero_core import plugin  # noqa: F401 - `zero_core.plugin` is reachable as an attribute, as before
from zero_core._clip import clip_grad_norm_
from zero_core._deepspeed import DeepSpeedConversion, config_from_deepspeed, convert_deepspeed_config
from zero_core._estimate import Estimate, estimate
from zero_core._lazy import lazy_init
from zero_core._module import ZeroModule
from zero_core._persist import load_checkpoint, save_checkpoint, save_full_state_dict
from zero_core._shard import Sharded, shard
from zero_core._version import __version__
from zero_core.api import ChunkPolicy, LossScale, Precision, ZeroConfig
from zero_core.comm import CommStats
from zero_core.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    DeepSpeedConfigWarning,
    GradientLostError,
    PluginNotFoundError,
    RanksDisagreeError,
    RanksOutOfStepError,
    ZeroError,
    ZeroSetupError,
)

__all__ = [
    "CheckpointError",
    "ChunkPolicy",
    "CollectiveTimeoutError",
    "CommStats",
    "ConfigError",
    "DeepSpeedConfigWarning",
    "DeepSpeedConversion",
    "Estimate",
    "GradientLostError",
    "LossScale",
    "PluginNotFoundError",
    "Precision",
    "RanksDisagreeError",
    "RanksOutOfStepError",
    "Sharded",
    "ZeroConfig",
    "ZeroError",
    "ZeroModule",
    "ZeroSetupError",
    "__version__",
    "clip_grad_norm_",
    "config_from_deepspeed",
    "convert_deepspeed_config",
    "estimate",
    "lazy_init",
    "load_checkpoint",
    "save_checkpoint",
    "save_full_state_dict",
    "shard",
]
