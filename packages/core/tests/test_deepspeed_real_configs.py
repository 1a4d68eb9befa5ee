"""Real DeepSpeed configs, as their projects ship them, mapped field by field.

The 24 files in ``data/deepspeed/`` are copied unchanged from public repositories (HF transformers,
accelerate, trl, LLaMA-Factory, axolotl, DeepSpeedExamples, Megatron-DeepSpeed, gpt-neox);
``data/deepspeed/SOURCES.md`` names the repository, path and commit of each. Every expectation
below is DeepSpeed's reading of the file: keys it leaves out take DeepSpeed's defaults (see
[Note: DeepSpeed's defaults] in ``zero_core.tools._deepspeed``), ``"auto"`` is filled only from
TrainingArguments.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zero_core import ConfigError, LossScale, convert_deepspeed_config

DATA = Path(__file__).parent / "data" / "deepspeed"
F16, B16, F32 = torch.float16, torch.bfloat16, torch.float32
OPTIM = {"offload_optim_frac": 1.0}
BOTH = {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}


def ds_scale(init: float = 2.0**16, window: int = 1000, *, static: bool = False) -> LossScale:
    """DeepSpeed's dynamic scaler with its defaults (hysteresis 2, refilled on growth only, min scale 1)."""
    if static:
        return LossScale(init_scale=init, growth_interval=window, hysteresis=2, min_scale=1.0, dynamic=False)
    return LossScale(init_scale=init, growth_interval=window, hysteresis=2, consecutive_hysteresis=False, min_scale=1.0)


# file: (stage, compute, reduce, loss scale, placement, placement options, gradient clipping)
EXPECTED = {
    "accelerate_zero2_offload.json": (2, F16, F16, ds_scale(), "static", OPTIM, None),
    "accelerate_zero3_model_only.json": (3, None, F32, None, "static", BOTH, None),
    "axolotl_zero1.json": (1, None, F32, None, "device", {}, None),
    "axolotl_zero3_bf16_cpuoffload_all.json": (3, B16, B16, None, "static", BOTH, None),
    "dse_autotuning_fp16_z1.json": (1, F16, F16, ds_scale(), "device", {}, None),
    "dse_cifar_zero2_legacy_cpu_offload.json": (2, F16, F16, ds_scale(2.0**15, 500), "static", OPTIM, 1.0),
    "dse_megatron_zero2.json": (2, F16, F16, ds_scale(), "device", {}, 1.0),
    "dse_megatron_zero3_nvme.json": (3, F16, F16, ds_scale(1024.0, static=True), "static",
                                     {**BOTH, "disk_dir": "/nvme_data"}, 1.0),
    "gpt_neox_base_trailing_comma.json": (2, F16, F16, ds_scale(), "device", {}, 1.0),
    "gpt_neox_zero1.json": (1, F16, F16, ds_scale(), "device", {}, 1.0),
    "gpt_neox_zero2_onebitadam.json": (2, F16, F16, ds_scale(), "static", OPTIM, 1.0),
    "hf_transformers_zero2.json": (2, None, F32, None, "static", OPTIM, None),
    "hf_transformers_zero3.json": (3, None, F32, None, "static", BOTH, None),
    "hf_transformers_zero3_bfloat16.json": (3, None, F32, None, "static", BOTH, None),
    "hf_transformers_zero3_legacy_explicit.json": (3, F16, F16, ds_scale(), "static", BOTH, None),
    "llamafactory_z3_offload.json": (3, None, F32, None, "static", BOTH, None),
    "megatron_ds_zero1.json": (1, F16, F16, ds_scale(2.0**11, 500), "device", {}, 1.0),
    "megatron_ds_zero1_cpu_offload.json": (1, None, F32, None, "static", OPTIM, None),
    "megatron_ds_zero2_bfloat16.json": (2, B16, B16, None, "device", {}, 1.0),
    "trl_stack_llama_zero3.json": (3, None, F32, None, "device", {}, None),
    "trl_zero3_offload_none.json": (3, None, F32, None, "device", {}, None),
}
# Stage 0 (plain data parallelism) is refused, naming why and what to use.
STAGE_0 = {"dse_autotuning_fp16_z0.json": "zero_optimization.stage is 0",
           "dse_bing_bert_no_zero.json": "no zero_optimization section",
           "llamafactory_z0.json": "zero_optimization.stage is 0"}


def test_every_file_is_covered():
    assert set(EXPECTED) | set(STAGE_0) == {p.name for p in DATA.glob("*.json")}
    assert len(EXPECTED) + len(STAGE_0) >= 12


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_real_config_maps_field_by_field(name):
    stage, compute, reduce, scale, placement, options, clipping = EXPECTED[name]
    conversion = convert_deepspeed_config(DATA / name)
    config = conversion.config
    assert config.stage == stage
    assert config.precision.compute == compute
    assert config.precision.reduce == reduce
    assert config.precision.loss_scale == scale
    assert config.placement == placement
    assert dict(config.placement_options) == options
    assert conversion.gradient_clipping == clipping
    # every key of the file lands in exactly one report
    reports = [conversion.mapped, conversion.no_ops, conversion.unmapped, conversion.quiet, conversion.tuning]
    keys = [k for r in reports for k in r]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name", sorted(STAGE_0))
def test_stage_0_configs_are_refused(name):
    with pytest.raises(ConfigError, match=STAGE_0[name]):
        convert_deepspeed_config(DATA / name)


def _args(**kwargs):
    base = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, world_size=2, max_grad_norm=1.0,
                learning_rate=3e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.01,
                fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False)
    return SimpleNamespace(**{**base, **kwargs})


def test_auto_values_are_filled_from_training_arguments_as_hf_does():
    conversion = convert_deepspeed_config(DATA / "hf_transformers_zero2.json", training_args=_args(bf16=True))
    config = conversion.config
    assert (config.precision.compute, config.precision.reduce) == (B16, B16)
    assert conversion.gradient_clipping == 1.0
    assert config.reduce_bucket_mb == pytest.approx(2e8 * 2 / 2**20)  # 2e8 elements of the bf16 reduction
    assert "TrainingArguments.bf16" in conversion.mapped["bf16.enabled"]
    assert conversion.quiet["train_batch_size"].endswith("[auto: world_size x per_device_train_batch_size x "
                                                         "gradient_accumulation_steps]")
    fp16 = convert_deepspeed_config(DATA / "axolotl_zero1.json", training_args=_args(fp16=True)).config
    assert fp16.precision.loss_scale == ds_scale(2.0**32)  # its own initial_scale_power 32
    hidden = convert_deepspeed_config(DATA / "hf_transformers_zero3.json", training_args=_args(), hidden_size=1024)
    assert hidden.config.reduce_bucket_mb == pytest.approx(1024 * 1024 * 4 / 2**20)


def test_the_report_puts_what_changes_training_first_and_the_harmless_keys_last():
    conversion = convert_deepspeed_config(DATA / "dse_megatron_zero3_nvme.json")
    # the file's own misspelling of stage3_param_persistence_threshold
    assert "did you mean 'stage3_param_persistence_threshold'" in \
        conversion.unmapped["zero_optimization.stage3_param_persitance_threshold"]
    report = conversion.report()
    assert report.index("changes training") < report.index("mapped") < report.index("quiet")
    assert "wall_clock_breakdown" in conversion.quiet and "steps_per_print" in conversion.quiet
    defaults = convert_deepspeed_config(DATA / "gpt_neox_zero1.json").defaults
    assert set(defaults) == {"fp16.consecutive_hysteresis", "communication_data_type"}  # its window is explicit


def test_fp16_auto_does_not_call_its_loss_scale_keys_disabled():
    conversion = convert_deepspeed_config(DATA / "hf_transformers_zero3.json")
    assert "'auto'" in conversion.unmapped["fp16.loss_scale_window"]
    assert "fp16.loss_scale_window" not in conversion.no_ops
