"""Convert a DeepSpeed config (``ds_config.json``) to a ZeroConfig, reporting every key it cannot map.

[Note: the DeepSpeed mapping]
Every key of the DeepSpeed config ends up in exactly one of three reports:

- ``mapped``: it set a ZeroConfig field (``zero_optimization.stage`` -> ``stage``);
- ``no_ops``: what it asks for is what zero always does, or it is switched off, so there is
  nothing to set (``overlap_comm``: zero always overlaps reductions with the backward; any
  feature section whose ``enabled`` values are all false, ``zero_force_ds_cpu_optimizer: false``;
  a disabled ``fp16``/``bf16`` section says what the converted config computes in);
- ``unmapped``: zero's config cannot hold it; the reason says what to do instead
  (``gradient_clipping``: call ``zero_core.clip_grad_norm_`` in the loop; ``optimizer``:
  build the torch optimizer yourself; ``scheduler``: ``zero_core.deepspeed_lr_scheduler``
  builds DeepSpeed's schedule on the optimizer ``shard`` returns, see [Note: DeepSpeed's
  schedules]). ``"auto"`` values, which only the HuggingFace
  integrations fill in, land here too.

More reports sort what remains for the reader: ``quiet`` takes the keys whose values
change nothing a run trains (logging, profiling, timers, an accumulation of 1, the batch
sizes the data loader sets) and ``tuning`` the memory and speed knobs zero sizes its own way
(bucket and prefetch sizes, NVMe buffers), so that ``unmapped`` (printed first, as "changes
training") holds only what the user must act on; ``defaults`` lists the DeepSpeed defaults
applied for keys the config leaves out.

[Note: DeepSpeed's defaults]
The config describes a DeepSpeed run, so a key it leaves out means DeepSpeed's default, not
zero's: an fp16 run gets DeepSpeed's loss-scale window (1000 clean steps, zero's own default
is 2000) and hysteresis refilled only when the scale grows (``consecutive_hysteresis``
false); a 16-bit run reduces gradients in its compute dtype, as DeepSpeed does when
``communication_data_type`` is absent (zero's own default reduces in fp32). Each is listed in
``defaults``. DeepSpeed's 5e8-element ``reduce_bucket_size`` is not applied: it sizes a
bucketing backend's buffers, not the result. Files are parsed with hjson, as DeepSpeed does,
so trailing commas and comments load. ``"auto"`` values are filled from a given
``TrainingArguments`` with the HF integration's rules, else reported. Offload maps to
zero-offload's ``static`` placement policy, whose fractions express DeepSpeed's
all-or-``ratio`` offload exactly. The mapping table with every key is on the "Config files"
page of the documentation.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import textwrap
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zero_core.base.errors import ConfigError, DeepSpeedConfigWarning
from zero_core.config._config_io import _DTYPE_NAMES
from zero_core.config.api import _DTYPES, LossScale, Precision, ZeroConfig

__all__ = ["DeepSpeedConversion", "config_from_deepspeed", "convert_deepspeed_config"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_AUTO = ("'auto' is a placeholder that only the HuggingFace Trainer/Accelerate DeepSpeed integration fills in; "
         "write a value (zero's default is used)")
_LOOP = "belongs to the training loop, not to zero's config: "

# Top-level keys zero has no field for, with what to do instead.
_TOP_UNMAPPED = {
    "train_batch_size": _LOOP + "zero shards whatever batch each rank computes; set batch sizes in the data loader",
    "train_micro_batch_size_per_gpu": _LOOP + "set the per-rank batch size in the data loader",
    "gradient_accumulation_steps": _LOOP + "run all but the last micro-batch inside `with model.no_sync():`, "
                                   "dividing each loss by the number of micro-batches",
    "optimizer": "build the torch optimizer yourself (torch.optim.AdamW(model.parameters(), ...)) "
                 "and pass it to zero_core.shard",
    "scheduler": "build it with zero_core.deepspeed_lr_scheduler(optimizer, ds_config) on the optimizer "
                 "zero_core.shard returns and call scheduler.step() after each optimizer.step(): the same learning "
                 "rate at every step as DeepSpeed's (ZeroTrainer builds it itself)",
    "steps_per_print": _LOOP + "print from the training loop",
    "wall_clock_breakdown": _LOOP + "time the step there; model.comm_stats counts each collective",
    "comms_logger": "read model.comm_stats: calls and bytes per collective kind and step",
    "activation_checkpointing": "use torch.utils.checkpoint in the model (non-reentrant); zero gathers the "
                                "parameters again for the recomputation",
    "checkpoint": "save and load with zero_core.save_checkpoint / load_checkpoint (any world size)",
    "amp": "use precision.compute ('bf16' or 'fp16' with a loss scale) instead of apex AMP",
    "data_types": "zero accumulates gradients in precision.compute and reduces in precision.reduce",
    "aio": "zero's disk tier writes each chunk part as one file; it has no async-I/O settings",
    "zero_force_ds_cpu_optimizer": "zero steps the torch optimizer you pass, wherever the states are",
    "seq_parallel_communication_data_type": "zero has no sequence parallelism",
    "bfloat16": "DeepSpeed's old name of the bf16 section, which is also present and wins",
}
_MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "monitor_config")
# Top-level keys that change nothing a run trains whatever their value: logging, profiling, timers, and the batch
# sizes a zero run's data loader sets (see the quiet report in [Note: the DeepSpeed mapping]).
_QUIET_ALWAYS = frozenset({"steps_per_print", "wall_clock_breakdown", "comms_logger", "memory_breakdown", "dump_state",
                           "timers", "train_batch_size", "train_micro_batch_size_per_gpu"})
_TOP_NO_OPS = {
    "zero_allow_untested_optimizer": "zero accepts any torch optimizer",
}

# zero_optimization keys that need nothing from zero whatever their value.
_ZERO_NO_OPS = {
    "overlap_comm": "zero always overlaps: reduce-scatters run asynchronously on their own process group, and "
                    "the next chunk group's all-gather starts while the current one computes",
    "contiguous_gradients": "zero's gradients accumulate in each chunk's flat buffer, contiguous by construction",
    "round_robin_gradients": "a stage 1/2 CPU-offload copy schedule; zero moves each reduced gradient shard whole",
    "allgather_partitions": "zero always all-gathers the updated shards",
    "reduce_scatter": "zero always reduce-scatters gradients",
    "use_multi_rank_bucket_allreduce": "zero reduce-scatters; it has no all-reduce of buckets to combine",
    "load_from_fp32_weights": "zero's checkpoints hold the fp32 master shards, and loading restores them",
    "elastic_checkpoint": "zero's checkpoints load at any world size",
    "ignore_unused_parameters": "zero handles parameters a step does not use without a setting",
    "legacy_stage1": "zero has one stage 1",
    "cpu_offload_use_pin_memory": "zero pins host-resident shards whenever CUDA is present",
}
# zero_optimization keys zero cannot express, with what to do instead.
_GATHER_SIZE = "zero gathers one chunk group per all-gather; chunk.chunk_size (elements) sets its size"
_PERSIST = ("zero shards small parameters inside chunks with their neighbours, with no per-parameter threshold; "
            "to keep a share of the model gathered use placement='static' with placement_options.shard_param_frac")
_LIVE = "zero releases each chunk as soon as the modules using it have run; there is no cap to set"
_SAVE_16 = ("a save-time call in zero: model.full_state_dict() or zero_core.save_full_state_dict(...) "
            "gathers the weights")
_QUANT = ("quantized collectives are a distribution of their own, not converted: install zero-comm-quantized and "
          "set comm_backend='quantized-params' (int8 weight all-gathers, qwZ), 'quantized-int4-grads' (4-bit "
          "gradient reduce-scatters, qgZ) or 'quantized' (both, int8); precision.reduce='bf16' halves the gradient "
          "traffic without it (docs/comm/quantized.md)")
_ZERO_UNMAPPED = {
    "allgather_bucket_size": _GATHER_SIZE,
    "stage3_prefetch_bucket_size": _GATHER_SIZE,
    "prefetch_bucket_size": _GATHER_SIZE,
    "stage3_param_persistence_threshold": _PERSIST,
    "param_persistence_threshold": _PERSIST,
    "stage3_model_persistence_threshold": _PERSIST,
    "model_persistence_threshold": _PERSIST,
    "stage3_max_live_parameters": _LIVE,
    "max_live_parameters": _LIVE,
    "stage3_max_reuse_distance": _LIVE,
    "max_reuse_distance": _LIVE,
    "stage3_gather_16bit_weights_on_model_save": _SAVE_16,
    "gather_16bit_weights_on_model_save": _SAVE_16,
    "stage3_gather_fp16_weights_on_model_save": _SAVE_16,
    "stage3_module_granularity_threshold": "zero gathers by chunk group, never per module: nothing matches it",
    "module_granularity_threshold": "zero gathers by chunk group, never per module: nothing matches it",
    "sub_group_size": "zero steps the optimizer on the chunks' shards; chunk.chunk_size sets their size",
    "zero_quantized_weights": _QUANT,
    "zero_quantized_gradients": _QUANT,
    "zero_quantized_nontrainable_weights": _QUANT,
    "zeropp_loco_param": _QUANT,
    "mics_shard_size": "MiCS shards inside groups of k ranks: pass a 2-D mesh to zero_core.shard, "
                       "mesh=init_device_mesh(device, (world_size // k, k), mesh_dim_names=('replicate', 'shard'))",
    "mics_hierarchical_params_gather": "zero gathers inside the mesh's shard groups; see mics_shard_size",
    "override_module_apply": "to re-initialise a ZeRO-3 model, call model.apply(...) inside "
                             "`with model.gathered_parameters(writable=True):`",
    "memory_efficient_linear": "a DeepSpeed replacement of F.linear; zero has none",
}
# A falsy value of these switches a feature off, which is zero's state too.
_OFF_IS_NO_OP = {
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "mics_hierarchical_params_gather", "zeropp_loco_param",
    "memory_efficient_linear", "override_module_apply",
}
_OFFLOAD_TUNING = ("NVMe swap-buffer tuning: zero's disk tier reads and writes each chunk part as one file; bound host "
                   "memory with placement_options.host_budget_mb instead")
_CPU_ADAM = "DeepSpeed's CPU Adam tuning: zero steps the torch optimizer you pass (fused or foreach on the host)"
_OFFLOAD_UNMAPPED = {
    "buffer_count": _OFFLOAD_TUNING, "buffer_size": _OFFLOAD_TUNING, "max_in_cpu": _OFFLOAD_TUNING,
    "pipeline_read": _OFFLOAD_TUNING, "pipeline_write": _OFFLOAD_TUNING, "pipeline": _OFFLOAD_TUNING,
    "fast_init": _OFFLOAD_TUNING, "super_offload": _CPU_ADAM, "convert_grad_on_cpu": _CPU_ADAM,
    "cpuadam_cores_perc": _CPU_ADAM,
}
_OFFLOAD_DEVICES = ("cpu", "nvme", "none")
# Reasons of keys that size memory and speed, never what is trained: reported apart from what changes training.
_TUNING = frozenset({_GATHER_SIZE, _PERSIST, _LIVE, _OFFLOAD_TUNING, _CPU_ADAM, _ZERO_UNMAPPED["sub_group_size"],
                     _ZERO_UNMAPPED["memory_efficient_linear"], _ZERO_UNMAPPED["stage3_module_granularity_threshold"],
                     _TOP_UNMAPPED["aio"], _TOP_UNMAPPED["activation_checkpointing"]})
# DeepSpeed features zero does not have, each with what the run loses.
_NOT_DATA_PARALLEL = "zero shards data-parallel training only; "
_TOP_OTHER = {
    "tensor_parallel": _NOT_DATA_PARALLEL + "DeepSpeed's AutoTP (tensor parallelism) has no equivalent, so this run "
                       "would hold whole layers on every rank: drop it and fit the model with zero's stage 3 or offload",
    "pipeline": _NOT_DATA_PARALLEL + "pipeline parallelism has no equivalent",
    "sequence_parallel_size": _NOT_DATA_PARALLEL + "sequence parallelism (Ulysses) has no equivalent",
    "moe": _NOT_DATA_PARALLEL + "expert parallelism has no equivalent; shard experts over their own mesh with "
           "zero_core.shard(module_meshes={'experts': mesh})",
    "compression_training": "DeepSpeed's compression (quantisation-aware training, pruning) has no zero equivalent",
    "sparse_attention": "DeepSpeed's sparse attention kernels have no zero equivalent",
    "curriculum_learning": "DeepSpeed's curriculum learning belongs to the data pipeline; zero has none",
    "data_efficiency": "DeepSpeed's data efficiency library belongs to the data pipeline; zero has none",
    "progressive_layer_drop": "DeepSpeed's progressive layer drop has no zero equivalent",
    "elasticity": "DeepSpeed's elastic batch sizes have no zero equivalent; zero's checkpoints load at any world size",
    "autotuning": "DeepSpeed's autotuner has no zero equivalent; compare configurations with `zero bench`",
    "compile": "call torch.compile on the model's blocks after zero_core.shard (see the torch.compile page)",
    "hybrid_engine": "DeepSpeed-Chat's hybrid engine has no zero equivalent",
    "sparse_gradients": "zero reduces dense gradients",
    "nebula": "DeepSpeed's Nebula checkpoint service has no zero equivalent; use zero_core.save_checkpoint",
    "torch_autocast": "zero casts to precision.compute; use bf16 or fp16 compute instead of autocast",
    "disable_allgather": "zero always all-gathers the updated shards",
}
# Top-level switches whose false (or trivial) value is zero's state: reported as no effect, not as a change.
_OFF_WHEN_FALSE = frozenset({"zero_force_ds_cpu_optimizer", "sparse_gradients", "disable_allgather"})
_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states")


@dataclass(frozen=True, kw_only=True)
class _Offload:
    """What one offload section (or its deprecated flag) asks for."""

    device: str
    path: str  # the DeepSpeed key that turned it on
    nvme_path: str | None = None
    ratio: float | None = None

    @property
    def nvme_path_key(self) -> str:
        return self.path.rpartition(".")[0] + ".nvme_path"

    @property
    def ratio_path(self) -> str:
        return self.path.rpartition(".")[0] + ".ratio"


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConversion:
    """What :func:`convert_deepspeed_config` made of a DeepSpeed config.

    Every key of the DeepSpeed config (as a dotted path, ``zero_optimization.stage``) is in
    exactly one of ``mapped``, ``no_ops`` and ``unmapped``.

    Attributes:
        config: The equivalent :class:`~zero_core.ZeroConfig`.
        gradient_clipping: DeepSpeed's ``gradient_clipping`` (the max norm), or ``None`` when
            it is absent, 0 or ``"auto"``. zero clips in the training loop: call
            ``zero_core.clip_grad_norm_(model, conversion.gradient_clipping)`` after the
            backward, before ``optimizer.step()``.
        mapped: Key path to the ZeroConfig field and value it set.
        no_ops: Key path to why zero needs no setting for it.
        unmapped: Key path to why zero's config cannot hold it and what to do instead: each changes
            what is trained unless the user acts (the first section of ``report()``).
        quiet: Keys whose values change nothing zero trains (logging, profiling, the batch
            sizes the data loader sets, an accumulation of 1).
        tuning: Memory and speed knobs zero sizes its own way (bucket and prefetch sizes,
            NVMe buffers): the results do not depend on them.
        defaults: The DeepSpeed defaults applied for keys the config leaves out (see
            [Note: DeepSpeed's defaults]).
    """

    config: ZeroConfig
    gradient_clipping: float | None
    mapped: dict[str, str]
    no_ops: dict[str, str]
    unmapped: dict[str, str]
    quiet: dict[str, str] = dataclasses.field(default_factory=dict)
    tuning: dict[str, str] = dataclasses.field(default_factory=dict)
    defaults: dict[str, str] = dataclasses.field(default_factory=dict)

    def report(self) -> str:
        """The reports as text, one key per line, for a log or a terminal: what changes training first, the quiet
        keys last, on one line."""
        sections = [("changes training: zero cannot hold these, do this instead", self.unmapped),
                    ("DeepSpeed defaults applied (keys the config leaves out)", self.defaults),
                    ("mapped", self.mapped),
                    ("memory and speed: zero sizes these its own way (results unchanged)", self.tuning),
                    ("no effect: zero does this anyway, or it is off", self.no_ops)]
        lines = ["DeepSpeed config -> zero_core.ZeroConfig"]
        for title, entries in sections:
            lines.append(f"{title} ({len(entries)}):")
            lines += [textwrap.fill(f"{key}: {text}", width=100, initial_indent="  ", subsequent_indent="      ",
                                    break_on_hyphens=False, break_long_words=False) for key, text in entries.items()]
        if self.quiet:
            lines.append(textwrap.fill(f"quiet ({len(self.quiet)}, logging, profiling and the training loop's own "
                                       f"settings: nothing to do): {', '.join(self.quiet)}", width=100,
                                       subsequent_indent="  ", break_on_hyphens=False, break_long_words=False))
        return "\n".join(lines)


def convert_deepspeed_config(ds_config: Mapping[str, Any] | str | os.PathLike[str], *, training_args: Any = None,
                             hidden_size: int | None = None) -> DeepSpeedConversion:
    """Map a DeepSpeed config to a :class:`~zero_core.ZeroConfig` and report what could not be mapped.

    ``zero_optimization`` gives the stage, the offload placement (zero-offload's ``static``
    policy), the hpZ group (``reshard_after_forward``) and the bucket size; ``bf16`` /
    ``fp16`` give the compute dtype and loss scaling; ``communication_data_type`` and
    ``gradient_predivide_factor`` the reduction. Keys the config leaves out take zero's
    defaults. The "Config files" page of the documentation has the table of every key.

    Args:
        ds_config: The DeepSpeed config, as a dict or the path of its file (JSON, or hjson as
            DeepSpeed reads it: trailing commas and comments are fine).
        training_args: A HuggingFace ``TrainingArguments`` (or any object with its attribute
            names): ``"auto"`` values are filled from it as HF's DeepSpeed integration fills
            them (``bf16``, ``fp16``, ``max_grad_norm``, batch sizes, optimizer settings).
        hidden_size: The model's hidden size, for the ``"auto"`` bucket sizes HF derives from it.

    Returns:
        The config, the gradient clipping norm, and every key sorted into exactly one of
            ``unmapped`` (changes training: what to do instead), ``mapped``, ``no_ops`` and
            ``quiet``, with the DeepSpeed defaults applied in ``defaults``; ``report()`` prints them.

    Raises:
        ConfigError: No ``zero_optimization`` section or stage 0 (plain data parallelism: use
            ``torch.nn.parallel.DistributedDataParallel``), both ``bf16`` and ``fp16`` enabled,
            or an invalid value; the message names the DeepSpeed key path.
    """
    ds, filled = _fill_auto(_load(ds_config), training_args, hidden_size)
    return _Converter(ds, filled).convert()


def config_from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike[str], *, strict: bool = False,
                          stacklevel: int = 2, training_args: Any = None, hidden_size: int | None = None) -> ZeroConfig:
    """Convert a DeepSpeed config (a dict, or the path of a ``ds_config.json``) to a :class:`~zero_core.ZeroConfig`.

    Maps ``zero_optimization`` (stage, offload, hpZ, bucket size), ``bf16``/``fp16``
    (loss scaling), ``communication_data_type`` and ``gradient_predivide_factor``; see
    :func:`zero_core.convert_deepspeed_config` for the full result (including
    ``gradient_clipping``, which zero applies in the training loop) and the "Config
    files" page of the documentation for the mapping table.

    Args:
        ds_config: The DeepSpeed config.
        strict: Raise instead of warning when a key cannot be mapped.
        stacklevel: Where the warning points, as for :func:`warnings.warn`.
        training_args: Fills ``"auto"`` values, see :func:`zero_core.convert_deepspeed_config`.
        hidden_size: The model's hidden size, for ``"auto"`` bucket sizes.

    Returns:
        The equivalent config. Every key that could not be mapped is listed, with what
            to do instead, in one :class:`~zero_core.DeepSpeedConfigWarning`.

    Raises:
        ConfigError: Stage 0 or a missing ``zero_optimization`` (plain data parallelism:
            use DDP), an invalid value (named by its DeepSpeed key path), or, with
            ``strict=True``, any key that could not be mapped.
    """
    conversion = convert_deepspeed_config(ds_config, training_args=training_args, hidden_size=hidden_size)
    if conversion.unmapped:
        listing = "\n".join(f"  {key}: {reason}" for key, reason in conversion.unmapped.items())
        if strict:
            raise ConfigError(
                f"{len(conversion.unmapped)} DeepSpeed config key(s) cannot be mapped to ZeroConfig, and strict=True:\n"
                f"{listing}\nRemove them from the DeepSpeed config, or pass strict=False to get a warning instead."
            )
        warnings.warn(
            f"{len(conversion.unmapped)} DeepSpeed config key(s) change training unless you act on them:\n{listing}\n"
            "zero_core.convert_deepspeed_config(ds_config).report() shows the whole mapping "
            "(and carries gradient_clipping); strict=True makes this an error.",
            DeepSpeedConfigWarning, stacklevel=stacklevel,
        )
    return conversion.config


def _load(ds_config: Any) -> Mapping[str, Any]:
    if isinstance(ds_config, (str, os.PathLike)):
        import hjson  # DeepSpeed's own parser: JSON plus trailing commas, comments and unquoted keys

        path = Path(ds_config)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"DeepSpeed config {path} cannot be read: {err}") from err
        try:
            data = json.loads(json.dumps(hjson.loads(text)))  # plain dicts, in the document's order
        except hjson.HjsonDecodeError as err:
            raise ConfigError(f"DeepSpeed config {path} is neither JSON nor hjson (what DeepSpeed reads): {err}") from err
        ds_config = data
    if not isinstance(ds_config, Mapping):
        raise ConfigError(
            f"a DeepSpeed config must be a dict (the contents of ds_config.json) or the path of that file, "
            f"got {type(ds_config).__name__}."
        )
    return ds_config


# HF's rules for "auto" (transformers' HfTrainerDeepSpeedConfig): key path -> (what it reads, how).
def _hf_auto_rules(args: Any, hidden_size: int | None) -> dict[str, tuple[str, Any]]:
    def arg(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    rules: dict[str, tuple[str, Any]] = {}
    if args is not None:
        micro, accum = arg("per_device_train_batch_size"), arg("gradient_accumulation_steps")
        world = arg("world_size", 1) or 1
        rules.update({
            "train_micro_batch_size_per_gpu": ("TrainingArguments.per_device_train_batch_size", micro),
            "gradient_accumulation_steps": ("TrainingArguments.gradient_accumulation_steps", accum),
            "train_batch_size": ("world_size x per_device_train_batch_size x gradient_accumulation_steps",
                                 None if micro is None or accum is None else world * micro * accum),
            "gradient_clipping": ("TrainingArguments.max_grad_norm", arg("max_grad_norm")),
            "fp16.enabled": ("TrainingArguments.fp16 or fp16_full_eval", bool(arg("fp16") or arg("fp16_full_eval"))),
            "bf16.enabled": ("TrainingArguments.bf16 or bf16_full_eval", bool(arg("bf16") or arg("bf16_full_eval"))),
            "bfloat16.enabled": ("TrainingArguments.bf16 or bf16_full_eval",
                                 bool(arg("bf16") or arg("bf16_full_eval"))),
            "optimizer.params.lr": ("TrainingArguments.learning_rate", arg("learning_rate")),
            "optimizer.params.betas": ("TrainingArguments.adam_beta1, adam_beta2",
                                       None if arg("adam_beta1") is None else [arg("adam_beta1"), arg("adam_beta2")]),
            "optimizer.params.eps": ("TrainingArguments.adam_epsilon", arg("adam_epsilon")),
            "optimizer.params.weight_decay": ("TrainingArguments.weight_decay", arg("weight_decay")),
            "scheduler.params.warmup_min_lr": ("0, as HF sets it", 0),
            "scheduler.params.warmup_max_lr": ("TrainingArguments.learning_rate", arg("learning_rate")),
        })
    if hidden_size is not None:
        rules.update({
            "zero_optimization.reduce_bucket_size": ("hidden_size x hidden_size", hidden_size * hidden_size),
            "zero_optimization.stage3_prefetch_bucket_size": ("0.9 x hidden_size x hidden_size",
                                                              int(0.9 * hidden_size * hidden_size)),
            "zero_optimization.stage3_param_persistence_threshold": ("10 x hidden_size", 10 * hidden_size),
        })
    return {path: rule for path, rule in rules.items() if rule[1] is not None}


def _fill_auto(ds: Mapping[str, Any], args: Any, hidden_size: int | None) -> tuple[Mapping[str, Any], dict[str, str]]:
    """``ds`` with the ``"auto"`` values HF's rules fill from ``args``, and where each came from (by key path)."""
    rules = _hf_auto_rules(args, hidden_size)
    if not rules:
        return ds, {}
    filled: dict[str, str] = {}
    out = copy.deepcopy(dict(ds))
    for path, (source, value) in rules.items():
        *parents, name = path.split(".")
        section: Any = out
        for parent in parents:
            section = section.get(parent) if isinstance(section, Mapping) else None
        if isinstance(section, dict) and _is_auto(section.get(name)):
            section[name] = value
            filled[path] = source
    return out, filled


def _source_order(ds: Mapping[str, Any]) -> dict[str, int]:
    """Every key path of ``ds`` (nested sections walked) to its position in the document."""
    order: dict[str, int] = {}

    def walk(section: Mapping[str, Any], prefix: str) -> None:
        for key, value in section.items():
            order.setdefault(prefix + str(key), len(order))
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")

    walk(ds, "")
    return order


def _switched_off(key: str, value: object) -> str | None:
    """Why a top-level feature key is off (so it has no effect), or None when it is on or cannot be told."""
    if value is None:
        return "null: off"
    if key in _OFF_WHEN_FALSE and value is False:
        return "false: off, which is what zero does"
    if key == "sequence_parallel_size" and isinstance(value, int) and not isinstance(value, bool) and value <= 1:
        return f"{value}: no sequence parallelism"
    if key == "tensor_parallel" and isinstance(value, Mapping):
        sizes = [value[k] for k in ("autotp_size", "tp_size") if k in value]
        if sizes and all(isinstance(v, int) and not isinstance(v, bool) and v <= 1 for v in sizes):
            return "a tensor-parallel size of 1 or less: no tensor parallelism"
    switches = _enabled_values(value)
    if switches and not any(v is True or _is_auto(v) for v in switches) and all(v is False for v in switches):
        return "enabled: false: the feature is off" if len(switches) == 1 else "every part is enabled: false: off"
    return None


def _enabled_values(value: object) -> list[object]:
    """Every ``enabled`` value in a section, nested sections included (``compression_training`` nests them)."""
    if not isinstance(value, Mapping):
        return []
    found = [value["enabled"]] if "enabled" in value else []
    for key, sub in value.items():
        if key != "enabled":
            found += _enabled_values(sub)
    return found


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _bool(path: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed key {path} must be true or false, got {value!r}.")
    return value


def _number(path: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ConfigError(f"DeepSpeed key {path} must be a number >= {minimum:g}, got {value!r}.")
    return value


def _int(path: str, value: object, *, minimum: int = 0) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value >= minimum
            or value != int(value)):
        raise ConfigError(f"DeepSpeed key {path} must be a whole number >= {minimum}, got {value!r}.")
    return int(value)


_ZERO_KEYS = ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_params",
              "reduce_bucket_size", "zero_hpz_partition_size", *_ZERO_NO_OPS, *_ZERO_UNMAPPED)
_TOP_KEYS = ("zero_optimization", "bf16", "bfloat16", "fp16", "communication_data_type", "gradient_clipping",
             "gradient_predivide_factor", "prescale_gradients", *_TOP_NO_OPS, *_TOP_UNMAPPED, *_MONITORS, *_TOP_OTHER,
             *_QUIET_ALWAYS)


class _Converter:
    """One conversion: walks the DeepSpeed dict once, filling the three reports and the config's fields."""

    def __init__(self, ds: Mapping[str, Any], filled: dict[str, str] | None = None) -> None:
        self.ds = ds
        self.filled = filled or {}  # "auto" key paths filled from TrainingArguments -> what from
        self.defaults: dict[str, str] = {}  # see [Note: DeepSpeed's defaults]
        self.mapped: dict[str, str] = {}
        self.no_ops: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}
        self.fields: dict[str, Any] = {}  # ZeroConfig keyword arguments
        self.precision: dict[str, Any] = {}
        self.loss_scale: dict[str, Any] | None = None
        self.options: dict[str, Any] = {}  # placement_options of the static policy
        self.origin: dict[str, str] = {}  # zero field path ("precision.loss_scale.min_scale") -> DeepSpeed key path
        self.gradient_clipping: float | None = None
        self.bucket_elements: tuple[str, float] | None = None
        self.bf16_key = "bf16"  # or DeepSpeed's old name, "bfloat16"

    def set(self, field: str, value: Any, ds_path: str, text: str | None = None) -> None:
        """Record one mapped key: ``field`` is the zero field path it set (``precision.compute``)."""
        target, _, name = field.rpartition(".")
        tables = {"": self.fields, "precision": self.precision, "precision.loss_scale": self.loss_scale,
                  "placement_options": self.options}
        table = tables[target]
        assert table is not None, field  # _fp16 makes the loss_scale table before it sets any of its fields
        table[name] = value
        self.origin[field] = ds_path
        self.mapped[ds_path] = text or f"{field}={value!r}"

    def convert(self) -> DeepSpeedConversion:
        ds = self.ds
        zero = ds.get("zero_optimization")
        if zero is None:
            raise ConfigError(
                "the DeepSpeed config has no zero_optimization section, which means stage 0: plain data parallelism, "
                "which zero does not do. Use torch.nn.parallel.DistributedDataParallel, or add "
                '"zero_optimization": {"stage": 1, 2 or 3}.'
            )
        if not isinstance(zero, Mapping):
            raise ConfigError(f'DeepSpeed key zero_optimization must be an object such as {{"stage": 3}}, got {zero!r}.')
        self.precision_sections()
        self.zero_section(zero)
        for key, value in ds.items():
            if key not in ("zero_optimization", self.bf16_key, "fp16", "communication_data_type"):
                self.top_level(key, value)
        if self.bucket_elements is not None:  # last: its MiB are counted in the reduce dtype
            self.bucket_size()
        quiet = {path: self.unmapped.pop(path) for path in list(self.unmapped) if self.harmless(path)}
        tuning = {path: self.unmapped.pop(path) for path in list(self.unmapped) if self.unmapped[path] in _TUNING}
        for report in (self.mapped, self.no_ops, self.unmapped, quiet, tuning):
            for path, source in self.filled.items():
                if path in report:
                    report[path] += f" [auto: {source}]"
        order = _source_order(ds)  # the reports list keys in the order the DeepSpeed config has them
        mapped, no_ops, unmapped, quiet, tuning = (
            dict(sorted(d.items(), key=lambda item: order.get(item[0], len(order))))
            for d in (self.mapped, self.no_ops, self.unmapped, quiet, tuning))
        return DeepSpeedConversion(config=self.build(), gradient_clipping=self.gradient_clipping,
                                   mapped=mapped, no_ops=no_ops, unmapped=unmapped, quiet=quiet, tuning=tuning,
                                   defaults=dict(self.defaults))

    def value(self, path: str) -> Any:
        section: Any = self.ds
        for name in path.split("."):
            section = section.get(name) if isinstance(section, Mapping) else None
        return section

    def harmless(self, path: str) -> bool:
        """A key whose value changes nothing a run trains: logging, profiling, the loop's own batch settings."""
        top = path.split(".")[0]
        value = self.value(path)
        if _is_auto(value):
            return top in _QUIET_ALWAYS
        if top in _QUIET_ALWAYS or top in _MONITORS:
            return True
        return top == "gradient_accumulation_steps" and value == 1

    # ------------------------------------------------------------------ precision

    def precision_sections(self) -> None:
        ds = self.ds
        bf16_key = self.bf16_key = "bf16" if "bf16" in ds else "bfloat16"
        bf16 = self.section(bf16_key)
        fp16 = self.section("fp16")
        bf16_on = self.enabled(bf16_key, bf16)
        fp16_on = self.enabled("fp16", fp16)
        if bf16_on and fp16_on:
            raise ConfigError(f"DeepSpeed keys {bf16_key}.enabled and fp16.enabled are both true; enable one of them.")
        if bf16 is not None:
            self.bf16_section(bf16_key, bf16, bf16_on)
        if fp16 is not None:
            self.fp16_section(fp16, fp16_on)
        self.compute_text(bf16_key)
        compute = self.precision.get("compute")
        if compute in ("bf16", "fp16") and ds.get("communication_data_type") is None:  # see [Note: DeepSpeed's defaults]
            self.precision["reduce"] = compute
            self.defaults["communication_data_type"] = (
                f"precision.reduce={compute!r} (DeepSpeed reduces 16-bit gradients in their own dtype when the key is "
                "absent; zero's own default reduces in fp32: write communication_data_type 'fp32' for that)")
        if "communication_data_type" in ds:
            value, path = ds["communication_data_type"], "communication_data_type"
            if value is None:
                self.no_ops[path] = "null: the default"
            elif _is_auto(value):
                self.unmapped[path] = _AUTO
            elif isinstance(value, str) and value.lower() in _DTYPES:
                self.set("precision.reduce", _DTYPE_NAMES[_DTYPES[value.lower()]], path)
            elif isinstance(value, str) and value.lower() == "bfp16":  # DeepSpeed's (and Megatron-DeepSpeed's) alias
                self.set("precision.reduce", "bf16", path, "precision.reduce='bf16' ('bfp16' is DeepSpeed's alias)")
            else:
                raise ConfigError(f"DeepSpeed key communication_data_type must be one of 'fp32', 'bf16', 'fp16', got {value!r}.")

    def compute_text(self, bf16_key: str) -> None:
        """What a switched-off (or "auto") precision section means: the dtype the converted config computes in."""
        compute = self.precision.get("compute")
        if compute == "bf16":
            now = f"the converted config computes in bf16 ({bf16_key}.enabled is true)"
        elif compute == "fp16":
            now = "the converted config computes in fp16 (fp16.enabled is true)"
        else:
            now = ("precision.compute stays None: forward and backward run in the parameters' own dtype, fp32 for an "
                   "fp32 model, as DeepSpeed trains with neither fp16 nor bf16 enabled")
        for path in (f"{bf16_key}.enabled", "fp16.enabled"):
            if self.no_ops.get(path) == "false":
                self.no_ops[path] = f"false: {now}"
            elif path in self.unmapped and self.unmapped[path].startswith(_AUTO):
                self.unmapped[path] = self.unmapped[path].replace("(read as false)", f"(read as false: {now})")

    def section(self, key: str) -> Mapping[str, Any] | None:
        value = self.ds.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f'DeepSpeed key {key} must be an object such as {{"enabled": true}}, got {value!r}.')
        return value

    def enabled(self, key: str, section: Mapping[str, Any] | None) -> bool:
        if section is None or "enabled" not in section:
            return False
        value = section["enabled"]
        return False if _is_auto(value) else _bool(f"{key}.enabled", value)

    def bf16_section(self, key: str, section: Mapping[str, Any], on: bool) -> None:
        for name, value in section.items():
            path = f"{key}.{name}"
            if name == "enabled":
                if _is_auto(value):
                    self.unmapped[path] = _AUTO + " (read as false)"
                elif on:
                    self.set("precision.compute", "bf16", path, "precision.compute='bf16' (gradients are reduced in "
                             "precision.reduce, which communication_data_type sets: bf16 when it is absent)")
                else:
                    self.no_ops[path] = "false"  # completed by compute_text() once both sections are read
            elif not on and name in _BF16_KEYS:
                self.no_ops[path] = f"{key} is not enabled"
            elif not on:
                self.unmapped[path] = self.unknown(key, name, _BF16_KEYS)
            elif name in ("bf16_master_weights_and_grads", "bf16_optimizer_states") and value:
                self.unmapped[path] = ("zero keeps master shards and optimizer states in the parameters' own dtype: "
                                       "build the model in bf16 to get bf16 masters")
            elif name in ("immediate_grad_update", "check_grad_overflow") and value:
                self.unmapped[path] = ("zero reduces each chunk's gradients as soon as they are complete and checks "
                                       "for overflow only with an fp16 loss scale")
            elif name in ("bf16_master_weights_and_grads", "bf16_optimizer_states", "immediate_grad_update",
                          "check_grad_overflow"):
                self.no_ops[path] = "false: zero's behaviour"
            else:
                self.unmapped[path] = self.unknown(key, name, _BF16_KEYS)

    def fp16_section(self, section: Mapping[str, Any], on: bool) -> None:
        auto = "enabled" in section and _is_auto(section["enabled"])
        if auto:
            self.unmapped["fp16.enabled"] = (_AUTO + " (read as false); or pass training_args= to fill it as HF does")
        elif "enabled" in section and not on:
            self.no_ops["fp16.enabled"] = "false"  # completed by compute_text() once both sections are read
        if not on:
            for name in section:
                if name == "enabled":
                    continue
                if auto:  # they apply if the placeholder turns fp16 on
                    self.unmapped[f"fp16.{name}"] = ("applies only if fp16.enabled, which is 'auto' here, is true: "
                                                     "write true or false, or pass training_args=")
                elif name in _FP16_KEYS:
                    self.no_ops[f"fp16.{name}"] = "fp16 is not enabled"
                else:
                    self.unmapped[f"fp16.{name}"] = self.unknown("fp16", name, _FP16_KEYS)
            return
        self.loss_scale = {}
        self.set("precision.compute", "fp16", "fp16.enabled",
                 "precision.compute='fp16' with precision.loss_scale=LossScale(...); call model.backward(loss)")
        static = section.get("loss_scale", 0)
        if _is_auto(static):
            self.unmapped["fp16.loss_scale"] = _AUTO + " (dynamic scaling)"
            static = 0
        elif _number("fp16.loss_scale", static) > 0:
            self.set("precision.loss_scale.init_scale", float(static), "fp16.loss_scale",
                     f"precision.loss_scale: init_scale={float(static)!r}, dynamic=False (a static scale)")
            self.loss_scale["dynamic"] = False
        elif "loss_scale" in section:
            self.mapped["fp16.loss_scale"] = "precision.loss_scale.dynamic=True (0 is dynamic scaling)"
        for name, value in section.items():
            path = f"fp16.{name}"
            if name in ("enabled", "loss_scale") or path in self.unmapped:
                continue
            if _is_auto(value):
                self.unmapped[path] = _AUTO
            elif name == "initial_scale_power":
                if static > 0:
                    self.no_ops[path] = "a static loss_scale is set; the power applies to dynamic scaling only"
                else:
                    power = _int(path, value)
                    self.set("precision.loss_scale.init_scale", float(2**power), path,
                             f"precision.loss_scale.init_scale={float(2**power)!r} (2**{power})")
            elif name == "loss_scale_window":
                self.set("precision.loss_scale.growth_interval", _int(path, value, minimum=1), path)
            elif name == "hysteresis":
                hysteresis = _int(path, value, minimum=1)
                self.set("precision.loss_scale.hysteresis", hysteresis, path,
                         f"precision.loss_scale.hysteresis={hysteresis} (refilled as consecutive_hysteresis says)")
            elif name == "min_loss_scale":
                self.set("precision.loss_scale.min_scale", float(_number(path, value)), path)
            elif name == "consecutive_hysteresis":
                refill = _bool(path, value)
                self.set("precision.loss_scale.consecutive_hysteresis", refill, path,
                         f"precision.loss_scale.consecutive_hysteresis={refill} (the hysteresis is refilled "
                         + ("after every clean step)" if refill else "only when the scale grows)"))
            elif name == "auto_cast":
                self.no_ops[path] = "zero always casts floating inputs to precision.compute"
            elif name == "fp16_master_weights_and_grads" and value:
                self.unmapped[path] = "zero keeps master shards in the parameters' own dtype (fp32 for an fp32 model)"
            elif name == "fp16_master_weights_and_grads":
                self.no_ops[path] = "false: zero's behaviour"
            else:
                self.unmapped[path] = self.unknown("fp16", name, _FP16_KEYS)
        if static == 0:  # see [Note: DeepSpeed's defaults]
            scale = self.loss_scale
            if "growth_interval" not in scale:
                scale["growth_interval"] = 1000
                self.defaults["fp16.loss_scale_window"] = ("precision.loss_scale.growth_interval=1000 (DeepSpeed's "
                                                           "default; zero's own is 2000)")
            if "consecutive_hysteresis" not in scale:
                scale["consecutive_hysteresis"] = False
                self.defaults["fp16.consecutive_hysteresis"] = (
                    "precision.loss_scale.consecutive_hysteresis=False (DeepSpeed's default: the hysteresis is "
                    "refilled only when the scale grows; zero's own refills it after every clean step)")

    def unknown(self, where: str, name: str, known: Any) -> str:
        """The report of a key DeepSpeed does not have at this level: a misspelling, with the likely intent."""
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
        at = f" in {where}" if where else ""
        if close:
            return f"not a DeepSpeed key{at}; did you mean {close[0]!r}? As written it sets nothing"
        return f"not a DeepSpeed key{at} zero knows; it sets nothing (check the spelling against DeepSpeed's docs)"

    # ------------------------------------------------------------------ zero_optimization

    def zero_section(self, zero: Mapping[str, Any]) -> None:
        stage = zero.get("stage", 0)
        if isinstance(stage, bool) or not isinstance(stage, (int, float)) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeed key zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
        if stage == 0:
            given = "is 0" if "stage" in zero else "is not set, which DeepSpeed reads as 0"
            raise ConfigError(
                f"DeepSpeed key zero_optimization.stage {given}: plain data parallelism (every rank holds every "
                "state), which zero does not do. Use torch.nn.parallel.DistributedDataParallel, or set stage 1, 2 or 3."
            )
        stage = int(stage)
        if "stage" in zero:
            self.set("stage", stage, "zero_optimization.stage")
        self.offload(zero, stage)
        for name, value in zero.items():
            path = f"zero_optimization.{name}"
            if name in ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
                        "cpu_offload_params") or self.reported(path):
                continue
            if name == "reduce_bucket_size":
                if _is_auto(value):
                    self.unmapped[path] = _AUTO
                else:
                    self.bucket_elements = (path, _number(path, value))
            elif name == "zero_hpz_partition_size":
                self.hpz(path, value, stage)
            elif name in _ZERO_NO_OPS:
                self.no_ops[path] = _ZERO_NO_OPS[name]
            elif name in _OFF_IS_NO_OP and not value:
                self.no_ops[path] = "off, as in zero"
            elif name == "mics_shard_size" and isinstance(value, (int, float)) and value <= 0:
                self.no_ops[path] = "MiCS is off"
            elif name in _ZERO_UNMAPPED:
                self.unmapped[path] = _ZERO_UNMAPPED[name]
            else:
                self.unmapped[path] = self.unknown("zero_optimization", name, _ZERO_KEYS)

    def reported(self, path: str) -> bool:
        return path in self.mapped or path in self.no_ops or path in self.unmapped

    def hpz(self, path: str, value: object, stage: int) -> None:
        size = _int(path, value)
        if size <= 1:
            self.no_ops[path] = f"{size}: hpZ is off"
        elif stage < 3:
            self.unmapped[path] = "hpZ applies to stage 3 only, as in DeepSpeed"
        else:
            self.set("reshard_after_forward", size, path,
                     f"reshard_after_forward={size} (after forward, keep a copy sharded over groups of {size} ranks)")

    def offload(self, zero: Mapping[str, Any], stage: int) -> None:
        optim = self.deprecated_flag(zero, "cpu_offload", self.offload_section(zero, "offload_optimizer"))
        param = self.deprecated_flag(zero, "cpu_offload_param", self.offload_section(zero, "offload_param"))
        param = self.deprecated_flag(zero, "cpu_offload_params", param)  # gpt-neox's spelling
        if param is not None and stage < 3:
            self.unmapped[param.path] = "DeepSpeed offloads parameters only at stage 3; set zero_optimization.stage to 3"
            param = None
        if optim is None and param is None:
            return
        self.fields["placement"] = "static"
        self.origin["placement"] = (optim or param).path  # type: ignore[union-attr]
        optim_frac = 1.0
        if optim is not None:
            if optim.ratio is not None:
                optim_frac = optim.ratio
                self.mapped[optim.ratio_path] = (f"placement_options.offload_optim_frac={optim_frac!r} "
                                                 "(that share of the chunks steps on the host)")
            self.options["offload_optim_frac"] = optim_frac
            self.origin["placement_options.offload_optim_frac"] = optim.ratio_path if optim.ratio is not None else optim.path
            where = "host memory" if optim.device == "cpu" else "host memory, spilling to disk_dir past host_budget_mb"
            self.mapped[optim.path] = (f"placement='static' (zero-offload), placement_options.offload_optim_frac="
                                       f"{optim_frac!r}: gradients, optimizer states and master shards step in {where}")
        if param is not None:
            # zero keeps a chunk's shard on the host only where its optimizer states are too: it steps there
            frac = optim_frac if optim is not None else 1.0
            self.options["offload_param_frac"] = frac
            self.options.setdefault("offload_optim_frac", frac)
            self.origin["placement_options.offload_param_frac"] = param.path
            note = "" if optim is not None else " (and offload_optim_frac=1.0: a host-resident shard steps on the host)"
            if frac < 1:
                note = " (at most offload_optim_frac: the other chunks' shards stay on the device)"
            self.mapped[param.path] = (f"placement='static' (zero-offload), placement_options.offload_param_frac={frac!r}: "
                                       f"master shards stay in host memory between uses{note}")
        disks = [o for o in (optim, param) if o is not None and o.nvme_path is not None]
        if disks:
            disk_dir = disks[0].nvme_path
            self.options["disk_dir"] = disk_dir
            self.origin["placement_options.disk_dir"] = disks[0].nvme_path_key
            self.mapped[disks[0].nvme_path_key] = f"placement_options.disk_dir={disk_dir!r} (the disk tier)"
            for other in disks[1:]:
                if other.nvme_path == disk_dir:
                    self.no_ops[other.nvme_path_key] = "the same directory as offload_optimizer's"
                else:
                    self.unmapped[other.nvme_path_key] = (f"zero has one disk tier, in {disk_dir!r} "
                                                          f"(offload_optimizer's nvme_path); {other.nvme_path!r} is not used")

    def deprecated_flag(self, zero: Mapping[str, Any], name: str, section: _Offload | None) -> _Offload | None:
        """DeepSpeed's old spellings ``cpu_offload`` / ``cpu_offload_param`` (true = device cpu)."""
        path = f"zero_optimization.{name}"
        if zero.get(name) is None:
            if name in zero:
                self.no_ops[path] = "null: no offload"
            return section
        if not _bool(path, zero[name]):
            self.no_ops[path] = "false: no offload"
            return section
        if section is not None:
            self.no_ops[path] = "the offload section says the same"
            return section
        return _Offload(device="cpu", path=path)

    def offload_section(self, zero: Mapping[str, Any], name: str) -> _Offload | None:
        """The offload an ``offload_optimizer`` / ``offload_param`` section asks for (None: none); reports its other keys."""
        section = zero.get(name)
        prefix = f"zero_optimization.{name}"
        if section is None:
            if name in zero:
                self.no_ops[prefix] = "null: no offload"
            return None
        if not isinstance(section, Mapping):
            raise ConfigError(f'DeepSpeed key {prefix} must be an object such as {{"device": "cpu"}}, got {section!r}.')
        device = section.get("device") or "none"
        if not isinstance(device, str) or device.lower() not in _OFFLOAD_DEVICES:
            raise ConfigError(f"DeepSpeed key {prefix}.device must be one of 'cpu', 'nvme', 'none', got {device!r}.")
        device = device.lower()
        if device == "none":
            for key in section:
                self.no_ops[f"{prefix}.{key}"] = "offload is off (device 'none')"
            return None
        nvme_path = section.get("nvme_path")
        if device == "nvme" and not (isinstance(nvme_path, str) and nvme_path):
            raise ConfigError(f"DeepSpeed key {prefix}.nvme_path must be a directory when {prefix}.device is 'nvme', "
                              f"got {nvme_path!r}.")
        ratio = section.get("ratio")
        if ratio is not None and not 0 <= _number(f"{prefix}.ratio", ratio) <= 1:
            raise ConfigError(f"DeepSpeed key {prefix}.ratio must be a fraction in [0, 1], got {ratio!r}.")
        for key in section:
            path = f"{prefix}.{key}"
            if key in ("device", "ratio") or (key == "nvme_path" and device == "nvme"):
                continue
            if key == "pin_memory":
                self.no_ops[path] = "zero pins host-resident shards whenever CUDA is present"
            elif key == "nvme_path":
                self.no_ops[path] = "device is 'cpu': no disk tier"
            elif key in _OFFLOAD_UNMAPPED:
                self.unmapped[path] = _OFFLOAD_UNMAPPED[key]
            else:
                self.unmapped[path] = self.unknown(prefix, key, ("device", "nvme_path", "pin_memory", "ratio",
                                                                 *_OFFLOAD_UNMAPPED))
        return _Offload(device=device, path=f"{prefix}.device", nvme_path=nvme_path if device == "nvme" else None,
                        ratio=None if ratio is None else float(ratio))

    def bucket_size(self) -> None:
        path, elements = self.bucket_elements  # type: ignore[misc]
        reduce = self.precision.get("reduce", "fp32")
        mib = elements * _BYTES[reduce] / 2**20
        self.set("reduce_bucket_mb", mib, path,
                 f"reduce_bucket_mb={mib:.6g} ({elements:g} elements of {reduce}; used by bucketing comm backends: "
                 "strategy='tensor' or comm_backend='bucketed'; the chunk strategy reduces whole chunks)")

    # ------------------------------------------------------------------ the rest

    def top_level(self, key: str, value: Any) -> None:
        if key == "gradient_clipping":
            if _is_auto(value):
                self.unmapped[key] = _AUTO + " (then call zero_core.clip_grad_norm_ as below)"
            elif _number(key, value) == 0:
                self.no_ops[key] = "0: no clipping"
            else:
                self.gradient_clipping = float(value)
                self.unmapped[key] = (f"zero clips in the training loop: call zero_core.clip_grad_norm_(model, {value!r}) "
                                      "after the backward, before optimizer.step() (the value is "
                                      "DeepSpeedConversion.gradient_clipping)")
        elif key == "gradient_predivide_factor":
            if _is_auto(value):
                self.unmapped[key] = _AUTO
            else:
                self.set("precision.gradient_predivide_factor", value, key)
        elif key == "prescale_gradients":
            if _bool(key, value):
                self.unmapped[key] = ("set precision.gradient_predivide_factor to the world size for the same effect "
                                      "(gradients divided by it before the reduction)")
            else:
                self.no_ops[key] = "false: gradients are averaged after the reduction, as zero does"
        elif key in _TOP_NO_OPS:
            self.no_ops[key] = _TOP_NO_OPS[key]
        elif key == "scheduler":
            self.scheduler(value)
        elif (key in _TOP_UNMAPPED or key in _TOP_OTHER or key in _MONITORS) and _switched_off(key, value):
            self.no_ops[key] = _switched_off(key, value)  # type: ignore[assignment]
        elif key in _TOP_UNMAPPED:
            self.unmapped[key] = _TOP_UNMAPPED[key]
        elif key in _MONITORS:
            self.unmapped[key] = _LOOP + "log from the training loop; model.comm_stats has the communication"
        elif key in _TOP_OTHER:
            self.unmapped[key] = _TOP_OTHER[key]
        elif key in _QUIET_ALWAYS:
            self.unmapped[key] = _LOOP + "nothing in zero's config changes with it"
        else:
            self.unmapped[key] = self.unknown("", key, _TOP_KEYS)

    def scheduler(self, value: Any) -> None:
        """The scheduler section: checked as DeepSpeed would, and reported with the zero_core call that builds it."""
        from zero_core.tools._deepspeed_lr import scheduler_section

        if value is None:
            self.no_ops["scheduler"] = "null: no scheduler"
            return
        try:
            kind, params = scheduler_section({"scheduler": value})
        except ConfigError as err:
            self.unmapped["scheduler"] = f"{err}; as written DeepSpeed would refuse it"
            return
        auto = [name for name, v in params.items() if _is_auto(v)]
        text = f"DeepSpeed's {kind} schedule: " + _TOP_UNMAPPED["scheduler"]
        if auto:
            text += (f"; 'auto' {', '.join(auto)}: give deepspeed_lr_scheduler total_num_steps=, warmup_num_steps= "
                     "or learning_rate= to fill them as HF's Trainer does")
        self.unmapped["scheduler"] = text

    def build(self) -> ZeroConfig:
        """The ZeroConfig, each dataclass's own check naming the DeepSpeed key that set the refused value."""
        precision = dict(self.precision)
        if self.loss_scale is not None:
            precision["loss_scale"] = self.checked(LossScale, self.loss_scale, "precision.loss_scale.")
        self.fields["precision"] = self.checked(Precision, precision, "precision.")
        if self.options:
            self.fields["placement_options"] = dict(self.options)
        return self.checked(ZeroConfig, self.fields, "")

    def checked(self, cls: type, kwargs: dict[str, Any], prefix: str) -> Any:
        try:
            return cls(**kwargs)
        except ConfigError as err:
            names = {f.name for f in dataclasses.fields(cls)}
            keys = [self.origin[prefix + m.group(1)] for m in re.finditer(rf"\b{cls.__name__}\.(\w+)", str(err))
                    if m.group(1) in names and prefix + m.group(1) in self.origin]
            keys = keys or sorted({v for k, v in self.origin.items() if k.startswith(prefix)}) or ["(the config)"]
            raise ConfigError(f"DeepSpeed key {', '.join(keys)}: {err}") from err
