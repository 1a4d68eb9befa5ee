"""A PyTorch Lightning strategy that trains the LightningModule sharded by zero.

``import zero_integrations.lightning`` registers it as ``Trainer(strategy="zero")``
(Lightning 2.6 has no entry-point discovery for strategies); ``ZeroStrategy(config=ZeroConfig(...))``
passes a configuration. See ``docs/integrations/lightning.md``.

The module is sharded in place (:func:`zero_core.shard`) once ``configure_optimizers`` has
made its optimizer, so it stays the LightningModule Lightning knows (no wrapper); steps run
as one zero forward each; accumulation uses ``model.no_sync()``; clipping and the precision
are zero's; checkpoints are zero's sharded directories, written by every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

import zero_core
from zero_core.base.errors import ConfigError, ZeroSetupError
from zero_integrations._lightning_module import allow_nested_calls
from zero_integrations._lightning_precision import ZeroPrecision, zero_precision_for

__all__ = ["ZeroPrecision", "ZeroStrategy"]

# Written into the Lightning part of a checkpoint, to tell a zero checkpoint from a plain one on load.
_MARK = "zero_integrations.lightning"


class ZeroStrategy(DDPStrategy):
    """Lightning strategy: ZeRO-sharded data parallelism with zero (one process per device).

    Args:
        config: The ``zero_core.ZeroConfig`` (stage, chunk policy, placement...). Leave its
            ``precision`` at the default and set ``Trainer(precision=...)``: ``"32-true"``,
            ``"bf16-mixed"`` or ``"16-mixed"`` (fp16 with zero's loss scaler).
        shard_kwargs: Further keyword arguments for :func:`zero_core.shard` (``plugins``,
            ``process_group``, ``example_inputs``...).
        async_checkpoints: Write checkpoints in the background
            (``zero_core.save_checkpoint(..., async_=True)``): a save blocks training only while
            each rank copies its shards into host memory. The next save, a checkpoint's
            removal and the end of ``fit`` wait for it, and a failure is raised there.
        **kwargs: What :class:`~lightning.pytorch.strategies.DDPStrategy` takes (``timeout``,
            ``process_group_backend``, ``start_method``, ``cluster_environment``...), except
            the DDP-wrapper options, which have no meaning here.
    """

    strategy_name = "zero"

    def __init__(self, *, config: zero_core.ZeroConfig | None = None,
                 shard_kwargs: Mapping[str, Any] | None = None, async_checkpoints: bool = False, **kwargs: Any) -> None:
        if not isinstance(async_checkpoints, bool):
            raise ConfigError(f"ZeroStrategy(async_checkpoints=...) must be True or False, got {async_checkpoints!r}")
        self._async_checkpoints = async_checkpoints
        self._pending_save: zero_core.AsyncSave | None = None
        if config is not None and not isinstance(config, zero_core.ZeroConfig):
            raise ConfigError(f"ZeroStrategy(config=...) takes a zero_core.ZeroConfig, got {type(config).__name__}")
        wrapper_options = sorted(set(kwargs) - _DDP_STRATEGY_OPTIONS)
        if wrapper_options:
            raise ConfigError(
                f"ZeroStrategy got {wrapper_options}, options of the DistributedDataParallel wrapper, which zero replaces; "
                f"it takes config=ZeroConfig(...), shard_kwargs={{...}} and {sorted(_DDP_STRATEGY_OPTIONS)}"
            )
        if shard_kwargs and {"model", "optimizer", "config"} & set(shard_kwargs):
            raise ConfigError("shard_kwargs must not hold model, optimizer or config: the strategy passes those")
        self._zero_config = config if config is not None else zero_core.ZeroConfig()
        self._shard_kwargs = dict(shard_kwargs or {})
        super().__init__(**kwargs)

    # -- precision: Lightning's flag, served by zero ------------------------------------------------
    @property
    def precision_plugin(self) -> LightningPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: LightningPrecision | None) -> None:
        # The Trainer sets the plugin its precision flag selects (MixedPrecision, HalfPrecision...): keep the
        # flag, replace the plugin (zero does the casting and the loss scaling), refuse what zero cannot do.
        if plugin is not None and not isinstance(plugin, ZeroPrecision):
            if type(plugin) not in _LIGHTNING_PLUGINS_FOR_FLAGS:
                raise ConfigError(
                    f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__}; pass "
                    "Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed') and no precision plugin"
                )
            plugin = ZeroPrecision(plugin.precision)
        self._precision_plugin = plugin

    @property
    def zero_config(self) -> zero_core.ZeroConfig:
        """The configuration the model is sharded with: ``config`` with the Trainer's precision."""
        wanted = zero_precision_for(self.precision_plugin.precision)
        if self._zero_config.precision not in (zero_core.Precision(), wanted):
            raise ConfigError(
                f"ZeroConfig(precision={self._zero_config.precision}) disagrees with "
                f"Trainer(precision={self.precision_plugin.precision!r}); set the precision with the Trainer's "
                "precision flag and leave ZeroConfig.precision at its default"
            )
        return dataclasses.replace(self._zero_config, precision=wanted)

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        if self._layer_sync is not None:
            raise ConfigError("ZeroStrategy does not support Trainer(sync_batchnorm=True); leave it False")
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not isinstance(module, zero_core.ZeroModule):
            self.model_to_device()
            # zero needs the optimizer to shard (it re-points it at the shards), so optimizers come first
            if fitting:
                self.setup_optimizers(trainer)
                if len(self.optimizers) != 1:
                    raise ConfigError(
                        f"ZeroStrategy trains with exactly one optimizer; configure_optimizers returned "
                        f"{len(self.optimizers)}. Put all parameter groups into one optimizer"
                    )
                optimizer = self.optimizers[0]
            else:
                # validate/test/predict before any fit: an SGD without momentum keeps no state, so this costs nothing
                optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
            _, sharded_optimizer = zero_core.shard(module, optimizer, config=self.zero_config, **self._shard_kwargs)
            if sharded_optimizer is not optimizer:  # zero re-points in place today; schedulers hold the original
                raise ZeroSetupError("zero_core.shard returned a new optimizer; ZeroStrategy expects it re-pointed in place")
            allow_nested_calls(module)
            self.model: Any = module  # DDPStrategy's property (lightning is read as Any)
        elif fitting:
            # the module was sharded by an earlier fit/validate: its optimizer was re-pointed then
            self.setup_optimizers(trainer)
            engine_optimizer = module.engine.optimizer
            if len(self.optimizers) != 1 or self.optimizers[0] is not engine_optimizer:
                raise ZeroSetupError(
                    "this LightningModule was already sharded by an earlier Trainer run, and configure_optimizers "
                    "built a new optimizer; zero shards a model once, so build a new LightningModule for a new fit "
                    "(or return the same optimizer object from configure_optimizers)"
                )
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        if not isinstance(self.lightning_module, zero_core.ZeroModule):  # zero places the shards itself
            self.lightning_module.to(self.root_device)

    def teardown(self) -> None:
        # Not Strategy.teardown: it moves the module to the CPU, which would replace the sharded parameters.
        # The module stays sharded and usable (trainer.validate, model.full_state_dict()).
        assert self.cluster_environment is not None and self.accelerator is not None
        self._finish_pending_save()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- steps: one zero forward each -------------------------------------------------------------
    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with context:
            if isinstance(self.lightning_module, zero_core.ZeroModule):
                # through the module's __call__, so the engine brackets the whole step as its root forward
                return self._forward_redirection(self.lightning_module, self.lightning_module, name, *args, **kwargs)
            return getattr(self.lightning_module, name)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the micro-batches before the stepping one skip the gradient reduction."""
        if isinstance(self.lightning_module, zero_core.ZeroModule):
            with self.lightning_module.no_sync():
                yield None
        else:
            yield None

    # -- checkpoints: zero's sharded directories ---------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights travel in zero's shard files; a plain copy is model.full_state_dict() (collective).
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # in zero's shard files, as the weights

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``filepath`` as a zero checkpoint directory. Collective: every rank writes its own shards.

        Rank 0 adds the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters)."""
        if storage_options is not None:
            raise ConfigError("ZeroStrategy.save_checkpoint takes no storage_options; pass None")
        module = self._sharded_module("save a checkpoint")
        extra = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        extra[_MARK] = {"optimizer": "optimizer_states" in checkpoint}
        optimizer = module.engine.optimizer if "optimizer_states" in checkpoint else None
        self._finish_pending_save()
        self._pending_save = zero_core.save_checkpoint(module, optimizer, filepath, extra=extra,
                                                       async_=self._async_checkpoints)

    def _finish_pending_save(self) -> None:
        """Wait for a checkpoint still being written in the background; raise its failure."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a directory :meth:`save_checkpoint` wrote into the sharded module (and optimizer, when fitting)."""
        module = self._sharded_module("load a checkpoint")
        trainer = module._trainer  # type: ignore[attr-defined]  # the LightningModule's; the property raises when no Trainer is attached
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizer = module.engine.optimizer if fitting else None
        extra = zero_core.load_checkpoint(module, optimizer, checkpoint_path)
        if not isinstance(extra, dict) or _MARK not in extra:
            raise zero_core.CheckpointError(
                f"{checkpoint_path} is a zero checkpoint without Lightning's training state; ZeroStrategy resumes "
                "from checkpoints written by Trainer.save_checkpoint or ModelCheckpoint under ZeroStrategy"
            )
        extra["state_dict"] = {}
        return extra

    def remove_checkpoint(self, filepath: Any) -> None:
        self._finish_pending_save()  # never remove a directory a background write may still be using
        self.barrier("ZeroStrategy.remove_checkpoint")  # rank 0 removes the directory the others wrote into too
        super().remove_checkpoint(filepath)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loading writes into the shards, which exist once setup has sharded the module

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint has loaded the shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint has loaded the optimizer's shards

    def _sharded_module(self, verb: str) -> zero_core.ZeroModule:
        module = self.lightning_module
        if not isinstance(module, zero_core.ZeroModule):
            raise ZeroSetupError(f"ZeroStrategy can only {verb} once the Trainer has set up (sharded) the module")
        return module

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # registered under "zero" below, at import; not under DDPStrategy's names


def _lightning_flag_plugins() -> tuple[type, ...]:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    # The plugins the Trainer builds from a precision flag: ZeroPrecision checks the flag itself, so that
    # Trainer(precision="16-true") names the flag in its error, not a plugin class.
    return (LightningPrecision, MixedPrecision, HalfPrecision, DoublePrecision)


_LIGHTNING_PLUGINS_FOR_FLAGS = _lightning_flag_plugins()
_DDP_STRATEGY_OPTIONS = frozenset({
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "start_method",
})

if "zero" not in StrategyRegistry:
    StrategyRegistry.register(
        "zero", ZeroStrategy,
        description="ZeRO sharded data parallelism with zero (zero_integrations.lightning.ZeroStrategy)",
    )
