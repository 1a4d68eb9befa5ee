"""HuggingFace ``Trainer`` under zero: :class:`ZeroTrainer`.

``ZeroTrainer(model, args, ..., zero_config=ZeroConfig(...))`` trains with the Trainer's own
loop. The model is sharded in place when training starts (it stays the ``PreTrainedModel``
it was, ``config`` and all), so the loop's own calls are plain PyTorch on sharded
parameters: ``model.zero_grad()``, ``loss.backward()``, Accelerate's ``no_sync(model)``
(the model's own :meth:`~zero_core.ZeroModule.no_sync`). What the Trainer does on rank 0
alone, or with a local norm, is overridden:

* clipping: :func:`zero_core.clip_grad_norm_` over every rank's shards; the returned and
  logged ``grad_norm`` is the global pre-clip norm, as in one process;
* ``save_model`` (and the model part of every ``save_steps`` checkpoint): every rank takes
  part in :func:`zero_core.save_full_state_dict`, which writes ``config.json`` and sharded
  safetensors with their index, loadable by ``from_pretrained`` without zero;
* optimizer state: a sharded zero checkpoint in ``checkpoint-N/zero/`` (every rank writes
  its shards); ``resume_from_checkpoint`` loads it after sharding, at any world size. With
  ``async_checkpoints=True`` it is written in the background (see [Note: background saves
  under the Trainer]).

The overridden methods are the Trainer's private ones, so this module is bound to the
transformers versions the tests ran (the ``[hf]`` extra's range).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any, cast

import torch

import zero_core
from zero_core import LossScale, ZeroConfig, ZeroModule
from zero_core.base.errors import CheckpointError, ConfigError
from zero_core.plugin import get_logger

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - the [hf] extra installs it
    from zero_core.base._install import install_command

    raise ImportError(f"zero_integrations.hf needs transformers: {install_command('zero-integrations', extra='[hf]')}"
                      ) from exc

__all__ = ["ZERO_CHECKPOINT_DIR", "ZeroTrainer", "checkpoint_problems", "last_complete_checkpoint"]

_logger = get_logger("integrations")

#: The sub-directory of a Trainer checkpoint (``checkpoint-N/``) holding zero's sharded checkpoint.
ZERO_CHECKPOINT_DIR = "zero"
_SCHEDULER_NAME = "scheduler.pt"
_TRAINING_ARGS_NAME = "training_args.bin"


class ZeroTrainer(Trainer):
    """A ``transformers.Trainer`` whose model trains sharded by zero.

    It takes every argument ``Trainer`` takes, and these keyword-only ones:

    Args:
        zero_config: What :func:`zero_core.shard` builds (stage, precision, strategy, ...).
            Default: ``ZeroConfig()``, chunked ZeRO-3.
        max_shard_size: The largest safetensors file ``save_model`` writes (``"5GB"`` as
            ``save_pretrained``, or bytes).
        save_dtype: Write the exported weights in this dtype (e.g. ``torch.bfloat16``);
            default: the master dtype. Checkpoints for resuming always keep fp32 masters.

        async_checkpoints: Write each ``save_steps`` checkpoint's ``zero/`` directory in the
            background (``zero_core.save_checkpoint(..., async_=True)``): the step blocks only
            while this rank's shards are copied into host staging buffers. The next save, the
            end of ``train()`` and a resume wait for it and raise its failure. Under
            ``save_total_limit`` one checkpoint more is kept while a write is pending.
        deepspeed: A DeepSpeed config (a dict or the path of its file) to train by instead of
            ``zero_config``, imported by :func:`zero_core.convert_deepspeed_config` with its
            ``"auto"`` values filled from the training arguments as HF's DeepSpeed integration
            fills them. Its ``scheduler`` section (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
            ``OneCycle``, ``LRRangeTest``) is the run's schedule, each step at DeepSpeed's learning
            rate (:func:`zero_core.deepspeed_lr_scheduler`), as under HF's DeepSpeed integration.
            ``TrainingArguments(deepspeed=...)`` (which needs DeepSpeed installed, for HF's own check)
            trains the same.

    The HF arguments map to zero's config (see [Note: HF arguments under zero]):

    * ``bf16=True``: ``Precision(compute="bf16")``; ``fp16=True``: ``Precision(compute="fp16",
      loss_scale=LossScale())``, the loss scaled by zero's scaler. Accelerate's own autocast
      and scaler stay off: zero casts the gathered parameters itself.
    * ``gradient_checkpointing=True``: non-reentrant checkpointing (``use_reentrant=False``),
      the kind zero's gathers follow; an explicit ``use_reentrant=True`` is refused.
    * ``torch_compile=True`` compiles each transformer block (the classes in the model's
      ``_no_split_modules``) instead of the whole model, which zero refuses.

    A setting given twice with different values (``bf16=True`` with a fp32 ``zero_config``, a
    DeepSpeed config whose ``fp16`` differs from the arguments') is refused naming both.

    A checkpoint that a stopped run left incomplete (with or without ``async_checkpoints``: a
    rank killed anywhere in the Trainer's save) is never resumed from:
    ``resume_from_checkpoint=True`` skips it, logging what it lacks, for the last complete one,
    and an explicit path to it raises :class:`~zero_core.CheckpointError` naming what is
    missing (see :func:`checkpoint_problems`).
    """

    # The Trainer's attributes this class reads and sets (transformers is untyped here). The model is the plain one
    # until _wrap_model shards it: then the sharded one, a subclass of both its own class and ZeroModule.
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None

    def __init__(self, *args: Any, zero_config: ZeroConfig | None = None, max_shard_size: int | str = "5GB",
                 save_dtype: torch.dtype | None = None, deepspeed: Any = None, async_checkpoints: bool = False,
                 **kwargs: Any) -> None:
        if zero_config is not None and not isinstance(zero_config, ZeroConfig):
            raise ConfigError(f"zero_config must be a zero_core.ZeroConfig, got {type(zero_config).__name__}")
        if not isinstance(async_checkpoints, bool):
            raise ConfigError(f"ZeroTrainer(async_checkpoints=...) must be True or False, got {async_checkpoints!r}")
        self.zero_async_checkpoints = async_checkpoints
        self._pending_save: Any = None
        self._rotate_after: str | None = None  # the run directory to rotate once the pending save completed
        positional = len(args) > 1
        training_args = args[1] if positional else kwargs.get("args")
        model = args[0] if args else kwargs.get("model")
        self.zero_config, training_args, self.zero_deepspeed_scheduler = _map_arguments(
            training_args, zero_config, deepspeed, model)
        if positional:
            args = (args[0], training_args, *args[2:])
        elif training_args is not None:
            kwargs["args"] = training_args
        self.zero_max_shard_size = max_shard_size
        self.zero_save_dtype = save_dtype
        super().__init__(*args, **kwargs)

    # -- the DeepSpeed config's scheduler -------------------------------------------------

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """A DeepSpeed config's ``scheduler`` section is the schedule, as under HF's DeepSpeed integration (see
        [Note: a DeepSpeed scheduler under ZeroTrainer]); otherwise the Trainer's own from the arguments."""
        section = self.zero_deepspeed_scheduler
        if section is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = _deepspeed_scheduler(section, self.args, num_training_steps,
                                                 self.optimizer if optimizer is None else optimizer,
                                                 self._zero_step_skipped)
        self._created_lr_scheduler = True  # what Trainer.create_scheduler records
        return self.lr_scheduler

    def _zero_step_skipped(self) -> bool:
        """Whether zero's fp16 loss scaler skipped the last step (an overflow): DeepSpeed's schedule then holds."""
        model = self.zero_model
        return bool(model is not None and model.loss_scaler is not None and model.loss_scaler.last_step_skipped)

    # -- sharding ------------------------------------------------------------------------

    @property
    def zero_model(self) -> ZeroModule | None:
        """The sharded model, once training has started (``None`` before)."""
        return self.model if isinstance(self.model, ZeroModule) else None

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        # The Trainer creates the optimizer just before this call; zero re-points it at the shards in
        # place. Evaluation before training runs the plain model on every rank, as DDP's would.
        if not training or isinstance(self.model, ZeroModule):
            return self.model if isinstance(self.model, ZeroModule) else model
        if self.optimizer is None:
            raise ConfigError("ZeroTrainer needs the optimizer before sharding; the Trainer did not create one")
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # an already prepared one: its inner one
        if self.args.torch_compile:
            _compile_blocks(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
        sharded, optimizer = zero_core.shard(self.model, optimizer, config=self.zero_config)
        self.model = cast(torch.nn.Module, sharded)  # the model's own class too (see the attributes above)
        self.optimizer = optimizer
        # Accelerate would wrap the model in DDP; ≥1.14 leaves a model marked prepared as it is.
        self.model._is_accelerate_prepared = True  # type: ignore[assignment]  # Module.__setattr__ takes any value
        if sharded.loss_scaler is not None:
            # fp16: the loss must be scaled by zero's scaler; Accelerate's backward is a plain loss.backward()
            self.accelerator.backward = self._scaled_backward
        return self.model

    def _scaled_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        cast(ZeroModule, self.model).backward(loss, **kwargs)  # installed by _wrap_model once it sharded the model

    # -- clipping and the logged norm -----------------------------------------------------

    def _clip_grad_norm(self, model: torch.nn.Module) -> float:
        return zero_core.clip_grad_norm_(self._sharded("clip gradients"), self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float:
        if grad_norm is None:  # no clipping configured: the global norm, measured without scaling
            grad_norm = zero_core.clip_grad_norm_(self._sharded("measure the gradient norm"), float("inf"))
        return float(grad_norm)

    # -- saving ---------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write ``output_dir`` as ``save_pretrained`` would. Collective once training started: call on every rank."""
        model = self.zero_model
        if model is None:  # not sharded yet: the plain model, saved by the Trainer as usual
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        zero_core.save_full_state_dict(model, output_dir, max_shard_size=self.zero_max_shard_size,
                                       dtype=self.zero_save_dtype)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model = self._sharded("save the optimizer")
        self._wait_pending_save()  # no rotation here: this save's folder exists already, and is not complete
        self._pending_save = zero_core.save_checkpoint(model, model.engine.optimizer,
                                                       os.path.join(output_dir, ZERO_CHECKPOINT_DIR),
                                                       async_=self.zero_async_checkpoints)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        limit = self.args.save_total_limit
        if not self.zero_async_checkpoints or limit is None or limit <= 0:
            super()._save_checkpoint(model, trial)
            return
        # The Trainer rotates while this checkpoint's zero/ is still being written: keep one more, so that the
        # newest complete checkpoint survives until the new one is (see [Note: background saves under the Trainer])
        self.args.save_total_limit = limit + 1
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self._rotate_after = self._get_output_dir(trial=trial)

    def finish_pending_save(self) -> None:
        """Wait for a checkpoint still being written in the background; raise its failure (no-op without one). Then,
        under ``save_total_limit``, remove the checkpoints beyond it: the Trainer's rotation kept one more while the
        write was pending."""
        self._wait_pending_save()
        run_dir, self._rotate_after = self._rotate_after, None
        if run_dir is not None and self.args.should_save:  # every checkpoint complete: the Trainer's own limit
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _wait_pending_save(self) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        # Only a complete checkpoint is resumed from: see [Note: a complete Trainer checkpoint under zero]
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _last_complete_or_raise(self.args.output_dir)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            problems = checkpoint_problems(os.fspath(resume_from_checkpoint))
            if problems:
                raise CheckpointError(f"cannot resume from {os.fspath(resume_from_checkpoint)}: it is not a complete "
                                      f"checkpoint ({'; '.join(problems)}). Resume from an earlier checkpoint, or "
                                      "pass resume_from_checkpoint=True for the last complete one")
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self._pending_save = None  # the training failure is the one to report; close() still waits for the write
            raise
        self.finish_pending_save()
        return result

    # -- resuming -------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # Called before sharding, on the plain model: a zero checkpoint is loaded after sharding instead
        # (by _load_optimizer_and_scheduler), each rank reading only its shards.
        if _zero_dir(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        directory = None if checkpoint is None else _zero_dir(checkpoint)
        if checkpoint is None or directory is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        model = self._sharded("resume from a checkpoint")
        # RNG states are the Trainer's to restore (rng_state_<rank>.pth), after this call
        zero_core.load_checkpoint(model, model.engine.optimizer, directory, load_rng=False)
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        directory = None if best is None else _zero_dir(best)
        model = self.zero_model
        if directory is None or model is None:
            super()._load_best_model()
            return
        zero_core.load_checkpoint(model, None, directory, load_rng=False)

    def _sharded(self, what: str) -> ZeroModule:
        model = self.zero_model
        if model is None:
            raise ConfigError(f"ZeroTrainer cannot {what} before training has sharded the model; call train() first")
        return model


def _compile_blocks(model: torch.nn.Module, backend: str | None, mode: str | None) -> None:
    """``TrainingArguments(torch_compile=True)``: compile each block, not the model (see zero's torch.compile page).

    Accelerate would compile the whole model, which zero refuses; the blocks are the modules
    whose classes the model names in ``_no_split_modules`` (``GPT2Block``, ``LlamaDecoderLayer``...),
    the same units FSDP wraps."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ConfigError(
            f"TrainingArguments(torch_compile=True): ZeroTrainer compiles each block named in the model's "
            f"_no_split_modules, and {type(model).__name__} names none; leave torch_compile False and call "
            "block.compile() on each block of the model before trainer.train()"
        )
    for block in blocks:
        block.compile(backend=backend or "inductor", mode=mode)


# [Note: background saves under the Trainer]
# With async_checkpoints=True the Trainer's _save_checkpoint goes on while zero/ is still written: it writes
# trainer_state.json, the RNG files and rotates old checkpoints. Those are complete (each save first waits for the
# previous one), but the newest of them is the one a resume needs until the new one completes: under save_total_limit
# the Trainer's rotation keeps one checkpoint more, and the checkpoints beyond the limit go once the write completed
# (finish_pending_save, at the end of train()). zero's metadata file is renamed into place last (see [Note: sharded
# checkpoint format]), so a run that stops during the write leaves checkpoint-N with a zero/ directory that has no
# zero_checkpoint.json: load_checkpoint refuses it by name, and resume_from_checkpoint=True skips it for the last
# complete checkpoint (see the Note below).

# [Note: a complete Trainer checkpoint under zero]
# ZeroTrainer's save of checkpoint-N (Trainer._save_checkpoint, transformers 5.x) writes, in this order:
#   1. save_model: config.json, generation_config.json, the safetensors (and index), training_args.bin (rank 0);
#   2. _save_optimizer_and_scheduler: zero/ (made by rank 0 once every rank arrived; each rank's shard file; rank 0's
#      zero_checkpoint.json, renamed into place last, after every rank reported its file), then scheduler.pt (rank 0);
#      with async_checkpoints the shard files and the metadata are written in the background, so the metadata can land
#      anywhere in what follows, or never;
#   3. rng_state_<rank>.pth (rng_state.pth in one process), each rank its own, with no barrier between ranks;
#   4. trainer_state.json (rank 0), then the Trainer's rotation of older checkpoints.
# A rank can stop anywhere in this, and only the zero files and the model files are written atomically
# (torch.save and the Trainer's JSON are not). A checkpoint with zero/ is complete when everything a resume reads is
# there whole: zero/'s metadata as load_checkpoint reads it (read_metadata: the same check, the same message) with
# every shard file it names at its recorded size (load_checkpoint also checks their sha256; that reads every byte, so
# it is left to the load), trainer_state.json that parses, scheduler.pt, and the RNG file of every rank of the saved
# world size (a complete torch.save archive each: its zip directory, written last, is there). The model files are not
# read by a resume (zero's shards hold the fp32 masters) and precede zero/ anyway. A checkpoint without zero/ is a plain
# Trainer's (or save_only_model's) when its trainer_state.json, the Trainer's last file, parses; without it, it is a
# ZeroTrainer save that stopped before zero/ was begun. resume_from_checkpoint=True takes the newest complete one,
# logging each newer one it skips with what it lacks; with only torn ones it raises CheckpointError listing them
# (with none at all, the Trainer's own ValueError); an explicit path that is not complete raises CheckpointError naming
# what is missing, before anything is loaded.
_TRAINER_STATE_NAME = "trainer_state.json"


def checkpoint_problems(checkpoint: str) -> list[str]:
    """What keeps the Trainer checkpoint ``checkpoint`` (a ``checkpoint-N`` folder) from being resumed by
    :class:`ZeroTrainer`; an empty list for a complete one. See [Note: a complete Trainer checkpoint under zero]."""
    import json
    import zipfile

    from zero_core.checkpoint._checkpoint import read_metadata

    if not os.path.isdir(checkpoint):
        return ["the folder does not exist"]
    problems = []
    state = os.path.join(checkpoint, _TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        problems.append(f"no {_TRAINER_STATE_NAME}, which the Trainer writes last")
    else:
        try:
            with open(state) as f:
                json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"{_TRAINER_STATE_NAME} is cut short or damaged ({exc})")
    zero_dir = os.path.join(checkpoint, ZERO_CHECKPOINT_DIR)
    if not os.path.isdir(zero_dir):
        if problems:  # a ZeroTrainer save that stopped before zero/ was begun
            problems.insert(0, f"no {ZERO_CHECKPOINT_DIR}/ (the save stopped before zero's shards were written)")
        return problems  # else a plain Trainer's checkpoint (or a save_only_model one)
    world = None
    try:
        metadata = read_metadata(zero_dir)
    except CheckpointError as exc:
        problems.insert(0, f"{ZERO_CHECKPOINT_DIR}/: {exc}")
    else:
        world = metadata["world_size"]
        entries = [*metadata["files"], *([metadata["extra"]] if metadata.get("extra") else [])]
        for entry in entries:
            path = os.path.join(zero_dir, entry["name"])
            if not os.path.isfile(path) or os.path.getsize(path) != entry["bytes"]:
                problems.append(f"{ZERO_CHECKPOINT_DIR}/{entry['name']} is missing or not the size its metadata "
                                f"records ({entry['bytes']} bytes)")
    torch_files = [_SCHEDULER_NAME]
    if world is not None:
        torch_files += ["rng_state.pth"] if world == 1 else [f"rng_state_{rank}.pth" for rank in range(world)]
    for name in torch_files:
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            problems.append(f"no {name}")
        elif not zipfile.is_zipfile(path):
            problems.append(f"{name} is cut short (not a complete torch.save archive)")
    return problems


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` that can be resumed (see :func:`checkpoint_problems`); ``None``
    when there is none. Each newer one skipped is logged (logger ``zero.integrations``) with what it lacks."""
    return _scan(output_dir)[0]


def _scan(output_dir: str) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """The newest complete checkpoint in ``output_dir`` and the newer torn ones, each with its problems."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(output_dir):
        return None, []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        step = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and step.isdigit() and os.path.isdir(path):
            found.append((int(step), path))
    torn: list[tuple[str, list[str]]] = []
    for _, path in sorted(found, reverse=True):
        problems = checkpoint_problems(path)
        if not problems:
            return path, torn
        _logger.warning("resume_from_checkpoint=True skips %s, an incomplete checkpoint: %s", path,
                        "; ".join(problems))
        torn.append((path, problems))
    return None, torn


def _last_complete_or_raise(output_dir: str) -> str:
    found, torn = _scan(output_dir)
    if found is not None:
        return found
    if not torn:  # the Trainer's own error for an output directory without checkpoints
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    listed = "; ".join(f"{os.path.basename(path)}: {', '.join(problems)}" for path, problems in torn)
    raise CheckpointError(f"resume_from_checkpoint=True found no complete checkpoint in {output_dir}, only incomplete "
                          f"ones ({listed}). Start without resume_from_checkpoint, or restore a complete checkpoint")


def _zero_dir(checkpoint: str) -> str | None:
    directory = os.path.join(checkpoint, ZERO_CHECKPOINT_DIR)
    return directory if os.path.isdir(directory) else None


# [Note: HF arguments under zero]
# TrainingArguments describe what a plain Trainer does; under zero the same intent is zero's config. bf16/fp16 become
# zero's precision, and the Trainer is handed a copy of the arguments with them off: Accelerate's autocast would cast
# again what zero already computes in 16 bits, and its GradScaler would scale a loss zero's scaler must scale (the
# optimizer zero re-points is not Accelerate's). The user's TrainingArguments object is never changed. A DeepSpeed
# config (ZeroTrainer(deepspeed=...) or TrainingArguments(deepspeed=...)) is imported with its "auto" values filled
# from the arguments; the keys the Trainer itself acts on (optimizer, batch sizes, accumulation, clipping) are the
# Trainer's, from the arguments (an optimizer section asking for another optimizer or other settings is refused, as
# are a clipping or precision that differ), and the scheduler section is the schedule (see
# [Note: a DeepSpeed scheduler under ZeroTrainer]). TrainingArguments(deepspeed=...) has also built Accelerate's
# DeepSpeedPlugin and registered the config with transformers: the copy handed to the Trainer drops the plugin (else
# Accelerate would start DeepSpeed's engine, and transformers check the config against the arguments) and the
# registration is undone, so both spellings train the same.
_TRAINER_KEYS = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "gradient_clipping")


def _map_arguments(args: Any, zero_config: ZeroConfig | None, deepspeed: Any,
                   model: Any) -> tuple[ZeroConfig, Any, dict[str, Any] | None]:
    """The ZeroConfig the arguments ask for, the arguments to hand the Trainer (see the Note above), and the DeepSpeed
    config's scheduler section (None: the Trainer's own schedule)."""
    if getattr(args, "fsdp", None):
        raise ConfigError("ZeroTrainer shards the model itself; remove fsdp from TrainingArguments")
    given_ds = getattr(args, "deepspeed", None)
    if deepspeed is not None and given_ds is not None:
        raise ConfigError("a DeepSpeed config was given twice (ZeroTrainer(deepspeed=...) and "
                          "TrainingArguments(deepspeed=...)); pass one")
    deepspeed = deepspeed if deepspeed is not None else given_ds
    if deepspeed is not None and zero_config is not None:
        raise ConfigError("ZeroTrainer got both zero_config and a DeepSpeed config; pass one (zero_core."
                          "convert_deepspeed_config(ds).config is the zero_config the DeepSpeed config maps to)")
    config = ZeroConfig() if zero_config is None else zero_config
    scheduler = None
    if deepspeed is not None:
        _refuse_deepspeed_partitioned(model)
        config, scheduler = _from_deepspeed(deepspeed, args, model)
    bf16, fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))
    wanted = "bf16" if bf16 else "fp16" if fp16 else None
    compute = cast("torch.dtype | None", config.precision.compute)  # Precision made a name a dtype
    have = None if compute is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute, str(compute))
    if wanted is not None and have is None:  # a config that left the compute dtype unset takes the arguments'
        precision = config.precision
        loss_scale = precision.loss_scale if precision.loss_scale is not None or wanted == "bf16" else LossScale()
        config = config.replace(precision=dataclasses.replace(precision, compute=wanted, loss_scale=loss_scale))
    elif wanted is not None and have != wanted:
        raise ConfigError(f"TrainingArguments({wanted}=True) but the zero config computes in {have}; set one of them "
                          "to match the other")
    kwargs = dict(getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if getattr(args, "gradient_checkpointing", False) and kwargs.get("use_reentrant", False):
        raise ConfigError("gradient_checkpointing_kwargs={'use_reentrant': True}: zero gathers parameters for the "
                          "recomputation only with non-reentrant checkpointing; drop the key (ZeroTrainer sets False)")
    if args is None:
        return config, args, scheduler
    handed = copy.copy(args)  # the user's object stays as it was
    handed.bf16 = handed.fp16 = False
    handed.mixed_precision = "no"  # what the Trainer hands Accelerate (TrainingArguments derives it from bf16/fp16)
    if given_ds is not None:
        handed.deepspeed = None
        handed.hf_deepspeed_config = None
        handed.deepspeed_plugin = None  # what the Trainer hands Accelerate, which would run DeepSpeed's engine
        _forget_hf_deepspeed_config(args)
    if getattr(args, "gradient_checkpointing", False):
        handed.gradient_checkpointing_kwargs = {**kwargs, "use_reentrant": False}
    return config, handed, scheduler


def _forget_hf_deepspeed_config(args: Any) -> None:
    """TrainingArguments(deepspeed=...) registered its DeepSpeed config globally for transformers' modeling code
    (``is_deepspeed_zero3_enabled()``: from_pretrained would build later models under DeepSpeed's zero.Init, and
    resize_token_embeddings would gather with DeepSpeed); under zero it is not DeepSpeed's run."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover - a transformers without the module
        return
    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    if ref is not None and ref() is getattr(args, "hf_deepspeed_config", None):
        hf_deepspeed.unset_hf_deepspeed_config()


def _refuse_deepspeed_partitioned(model: Any) -> None:
    """A model built by from_pretrained while TrainingArguments(deepspeed=<a stage 3 config>) existed is partitioned
    by DeepSpeed's zero.Init (its parameters are empty, ``ds_id`` set); zero cannot shard that."""
    parameters = getattr(model, "parameters", None)
    if callable(parameters) and any(hasattr(p, "ds_id") for p in parameters()):
        raise ConfigError(
            "the model's parameters were partitioned by DeepSpeed's zero.Init: from_pretrained ran while a "
            "TrainingArguments(deepspeed=<a ZeRO-3 config>) existed. Build the model first (or leave deepspeed out "
            "of TrainingArguments and pass ZeroTrainer(deepspeed=...)), then create the arguments")


# [Note: a DeepSpeed scheduler under ZeroTrainer]
# HF's DeepSpeed integration hands a config's scheduler section to DeepSpeed, which builds it on the optimizer and steps
# it after every optimizer step; lr_scheduler_type and the warmup arguments are then unused. ZeroTrainer does the same
# with zero_core.deepspeed_lr_scheduler (every step at DeepSpeed's learning rate, see [Note: DeepSpeed's schedules]),
# on the Trainer's optimizer, which zero re-points in place when it shards. "auto" values are filled as HF fills them
# (warmup_min_lr 0, warmup_max_lr learning_rate, total_num_steps the run's training steps, warmup_num_steps
# max(1, args.get_warmup_steps(n))), and a warmup_max_lr, total_num_steps or warmup_num_steps written in the config
# that differs from the value HF would fill is refused naming both, as HF's trainer_config_process/finalize refuse it.


def _deepspeed_scheduler(section: dict[str, Any], args: Any, num_training_steps: int, optimizer: Any,
                         skip_step: Any) -> Any:
    from zero_core.tools._deepspeed_lr import scheduler_section

    kind, params = scheduler_section({"scheduler": section})
    hf = {"warmup_max_lr": (args.learning_rate, f"TrainingArguments.learning_rate={args.learning_rate}"),
          "total_num_steps": (num_training_steps, f"the run's {num_training_steps} training steps"),
          "warmup_num_steps": (max(1, args.get_warmup_steps(num_training_steps)),
                               f"TrainingArguments' warmup (max(1, get_warmup_steps)) = "
                               f"{max(1, args.get_warmup_steps(num_training_steps))}")}
    for name, value in params.items():
        if name in hf and not _is_auto(value) and value is not None and value != hf[name][0]:
            raise ConfigError(f"the DeepSpeed config's scheduler.params.{name} is {value!r} and HF fills it with "
                              f"{hf[name][1]}; make them agree (or write \"auto\"), as HF's DeepSpeed integration asks")
    return zero_core.deepspeed_lr_scheduler(optimizer, {"scheduler": section}, total_num_steps=num_training_steps,
                                            warmup_num_steps=hf["warmup_num_steps"][0],
                                            learning_rate=args.learning_rate, skip_step=skip_step)


def _check_optimizer(section: dict[str, Any], args: Any) -> None:
    """The optimizer section: the Trainer builds the optimizer from the arguments (AdamW by default), so a section
    asking for another optimizer, or settings other than the arguments', would change training silently; refused
    naming both (HF's own integration refuses the same mismatches in trainer_config_process)."""
    kind = str(section.get("type", "")).lower()
    params = section.get("params") or {}
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")))
    decoupled = kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True) is not False
                                     and not params.get("torch_adam", False))
    if not (decoupled and optim.startswith("adamw")):
        raise ConfigError(f"the DeepSpeed config's optimizer is {section.get('type')!r}"
                          f"{' (adam_w_mode false: Adam with L2 decay)' if kind == 'adam' else ''} and the Trainer "
                          f"builds TrainingArguments.optim={optim!r}: ZeroTrainer trains with the Trainer's optimizer. "
                          "Remove the optimizer section and set optim=..., or keep an Adam/AdamW section with an "
                          "adamw optim")
    betas = (getattr(args, "adam_beta1", None), getattr(args, "adam_beta2", None))
    for name, hf_value, hf_name in (("lr", args.learning_rate, "learning_rate"), ("eps", args.adam_epsilon,
                                    "adam_epsilon"), ("weight_decay", args.weight_decay, "weight_decay"),
                                    ("betas", list(betas), "adam_beta1, adam_beta2")):
        value = params.get(name)
        if value is None or _is_auto(value):
            continue
        if (list(value) if isinstance(value, (list, tuple)) else value) != hf_value:
            raise ConfigError(f"the DeepSpeed config's optimizer.params.{name} is {value!r} and TrainingArguments."
                              f"{hf_name} is {hf_value!r}; the Trainer's optimizer uses the arguments: make them "
                              'agree (or write "auto"), as HF\'s DeepSpeed integration asks')


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _from_deepspeed(deepspeed: Any, args: Any, model: Any) -> tuple[ZeroConfig, dict[str, Any] | None]:
    from zero_core.tools._deepspeed import _load

    deepspeed = _load(deepspeed)  # a path is read once, here
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    conversion = zero_core.convert_deepspeed_config(deepspeed, training_args=args,
                                                    hidden_size=hidden if isinstance(hidden, int) else None)
    if args is not None and isinstance(deepspeed.get("optimizer"), dict):
        _check_optimizer(deepspeed["optimizer"], args)
    clipping, max_norm = conversion.gradient_clipping, getattr(args, "max_grad_norm", None)
    if clipping is not None and max_norm is not None and abs(clipping - max_norm) > 1e-12:
        raise ConfigError(f"the DeepSpeed config's gradient_clipping is {clipping} and TrainingArguments.max_grad_norm "
                          f"is {max_norm}; the Trainer clips by the arguments: make them equal")
    for flag in ("bf16", "fp16"):
        enabled = conversion.config.precision.compute == {"bf16": torch.bfloat16, "fp16": torch.float16}[flag]
        if args is not None and enabled != bool(getattr(args, flag, False)) and \
                f"{flag}.enabled" in conversion.mapped and "[auto" not in conversion.mapped[f"{flag}.enabled"]:
            raise ConfigError(f"the DeepSpeed config sets {flag}.enabled={enabled} and TrainingArguments({flag}="
                              f"{getattr(args, flag, False)}); make them agree (or write \"auto\" in the config)")
    left = {k: v for k, v in conversion.unmapped.items() if k.split(".")[0] not in _TRAINER_KEYS}
    if left:
        listing = "\n".join(f"  {key}: {reason}" for key, reason in left.items())
        warnings.warn(f"{len(left)} DeepSpeed config key(s) change training under zero unless you act on them:\n"
                      f"{listing}", zero_core.DeepSpeedConfigWarning, stacklevel=4)
    scheduler = deepspeed.get("scheduler")
    if scheduler is not None:
        from zero_core.tools._deepspeed_lr import scheduler_section

        scheduler_section({"scheduler": scheduler})  # an unknown type or parameter is refused now, not at train()
        scheduler = copy.deepcopy(dict(scheduler))
    return conversion.config, scheduler