"""The DeepSpeed config importer: each section's mapping, and every key reported as mapped, a no-op or unmapped."""

import json
import warnings

import pytest
import torch

from zero_core import (
    ConfigError,
    DeepSpeedConfigWarning,
    LossScale,
    Precision,
    ZeroConfig,
    config_from_deepspeed,
    convert_deepspeed_config,
)


def ds(zero=None, **top):
    """A DeepSpeed config: stage 3 plus ``zero`` keys in zero_optimization, plus top-level ``top``."""
    return {"zero_optimization": {"stage": 3, **(zero or {})}, **top}


def convert(zero=None, **top):
    return convert_deepspeed_config(ds(zero, **top))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage(stage):
    conversion = convert_deepspeed_config({"zero_optimization": {"stage": stage}})
    assert conversion.config == ZeroConfig(stage=stage)
    assert conversion.mapped == {"zero_optimization.stage": f"stage={stage}"}
    assert conversion.no_ops == {} and conversion.unmapped == {} and conversion.gradient_clipping is None


@pytest.mark.parametrize(("config", "message"), [
    ({"zero_optimization": {"stage": 0}}, r"^DeepSpeed key zero_optimization.stage is 0: plain data parallelism.*"
                                          r"torch.nn.parallel.DistributedDataParallel, or set stage 1, 2 or 3"),
    ({"zero_optimization": {}}, r"zero_optimization.stage is not set, which DeepSpeed reads as 0.*DistributedDataParallel"),
    ({"train_batch_size": 8}, r"no zero_optimization section, which means stage 0.*DistributedDataParallel"),
    ({"zero_optimization": {"stage": "3"}}, r"^DeepSpeed key zero_optimization.stage must be 0, 1, 2 or 3, got '3'"),
    ({"zero_optimization": 3}, r"^DeepSpeed key zero_optimization must be an object such as \{\"stage\": 3\}, got 3"),
    (ds(fp16={"enabled": True}, bf16={"enabled": True}), r"bf16.enabled and fp16.enabled are both true; enable one"),
    (ds(bf16={"enabled": 1}), r"^DeepSpeed key bf16.enabled must be true or false, got 1"),
    (ds(fp16={"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}),
     r"^DeepSpeed key fp16.min_loss_scale: LossScale.min_scale 8.0 is above init_scale 4.0"),
    (ds(fp16={"enabled": True, "loss_scale_window": 0}), r"^DeepSpeed key fp16.loss_scale_window must be a whole number >= 1"),
    (ds(fp16={"enabled": True, "loss_scale": -1}), r"^DeepSpeed key fp16.loss_scale must be a number >= 0, got -1"),
    (ds(communication_data_type="int8"), r"^DeepSpeed key communication_data_type must be one of 'fp32', 'bf16', 'fp16', got 'int8'"),
    (ds(gradient_predivide_factor=0), r"^DeepSpeed key gradient_predivide_factor: Precision.gradient_predivide_factor must be"),
    (ds(gradient_clipping="x"), r"^DeepSpeed key gradient_clipping must be a number >= 0, got 'x'"),
    (ds({"offload_optimizer": {"device": "gpu"}}),
     r"^DeepSpeed key zero_optimization.offload_optimizer.device must be one of 'cpu', 'nvme', 'none', got 'gpu'"),
    (ds({"offload_param": {"device": "nvme"}}),
     r"^DeepSpeed key zero_optimization.offload_param.nvme_path must be a directory when .*'nvme', got None"),
    (ds({"offload_optimizer": {"device": "cpu", "ratio": 1.5}}), r"offload_optimizer.ratio must be a fraction in \[0, 1\], got 1.5"),
    (ds({"offload_optimizer": "cpu"}), r"offload_optimizer must be an object such as \{\"device\": \"cpu\"\}, got 'cpu'"),
    (ds({"zero_hpz_partition_size": 1.5}), r"zero_optimization.zero_hpz_partition_size must be a whole number >= 0, got 1.5"),
    ([("zero_optimization", {"stage": 3})], r"a DeepSpeed config must be a dict .* or the path of that file, got list"),
])
def test_errors_name_the_deepspeed_key(config, message):
    with pytest.raises(ConfigError, match=message):
        convert_deepspeed_config(config)


def test_bf16():
    conversion = convert(bf16={"enabled": True})
    # DeepSpeed reduces in the compute dtype when communication_data_type is absent: so does the import
    assert conversion.config.precision == Precision(compute="bf16", reduce="bf16")
    assert "bf16.enabled" in conversion.mapped and "DeepSpeed reduces" in conversion.defaults["communication_data_type"]
    assert convert(bf16={"enabled": True}, communication_data_type="fp32").config.precision.reduce is torch.float32
    assert convert(bfloat16={"enabled": True}).config.precision.compute is torch.bfloat16  # DeepSpeed's old name
    off = convert(bf16={"enabled": False, "immediate_grad_update": True})
    assert off.config.precision == Precision() and set(off.no_ops) == {"bf16.enabled", "bf16.immediate_grad_update"}
    masters = convert(bf16={"enabled": True, "bf16_master_weights_and_grads": True})
    assert "build the model in bf16" in masters.unmapped["bf16.bf16_master_weights_and_grads"]


def test_fp16_dynamic_loss_scale():
    conversion = convert(fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 100,
                               "hysteresis": 3, "min_loss_scale": 0.5, "consecutive_hysteresis": True, "auto_cast": True})
    assert conversion.config.precision == Precision(compute="fp16", reduce="fp16", loss_scale=LossScale(
        init_scale=256.0, growth_interval=100, hysteresis=3, consecutive_hysteresis=True, min_scale=0.5, dynamic=True))
    assert set(conversion.mapped) == {"zero_optimization.stage", "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power",
                                      "fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale",
                                      "fp16.consecutive_hysteresis"}
    assert set(conversion.no_ops) == {"fp16.auto_cast"}
    assert conversion.unmapped == {}
    assert convert(fp16={"enabled": True, "consecutive_hysteresis": False}).config.precision.loss_scale == \
        LossScale(growth_interval=1000, consecutive_hysteresis=False)
    # absent keys: DeepSpeed's defaults (window 1000, hysteresis refilled on growth only), each listed
    absent = convert(fp16={"enabled": True})
    assert absent.config.precision.loss_scale == LossScale(growth_interval=1000, consecutive_hysteresis=False)
    assert set(absent.defaults) == {"fp16.loss_scale_window", "fp16.consecutive_hysteresis", "communication_data_type"}


def test_fp16_static_loss_scale():
    conversion = convert(fp16={"enabled": True, "loss_scale": 128, "initial_scale_power": 30})
    assert conversion.config.precision.loss_scale == LossScale(init_scale=128.0, dynamic=False)
    assert "static" in conversion.mapped["fp16.loss_scale"]
    assert "a static loss_scale is set" in conversion.no_ops["fp16.initial_scale_power"]


def test_fp16_keys_are_no_ops_when_it_is_off():
    conversion = convert(fp16={"enabled": False, "loss_scale": 0, "hysteresis": 2})
    assert conversion.config == ZeroConfig()
    assert set(conversion.no_ops) == {"fp16.enabled", "fp16.loss_scale", "fp16.hysteresis"}


@pytest.mark.parametrize(("value", "expected"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_communication_data_type(value, expected):
    conversion = convert(communication_data_type=value)
    assert conversion.config.precision.reduce is expected
    assert conversion.mapped["communication_data_type"] == f"precision.reduce='{value}'"


def test_gradient_predivide_factor_and_prescale():
    assert convert(gradient_predivide_factor=8).config.precision.gradient_predivide_factor == 8.0
    assert "world size" in convert(prescale_gradients=True).unmapped["prescale_gradients"]
    assert "prescale_gradients" in convert(prescale_gradients=False).no_ops


@pytest.mark.parametrize(("reduce", "mib"), [(None, 5e8 * 4 / 2**20), ("bf16", 5e8 * 2 / 2**20)])
def test_reduce_bucket_size_is_elements_at_the_reduce_dtype(reduce, mib):
    extra = {"communication_data_type": reduce} if reduce else {}
    conversion = convert({"reduce_bucket_size": 5e8}, **extra)
    assert conversion.config.reduce_bucket_mb == mib
    assert conversion.mapped["zero_optimization.reduce_bucket_size"].startswith(f"reduce_bucket_mb={mib:.6g} ")


@pytest.mark.parametrize(("zero", "options"), [
    ({"offload_optimizer": {"device": "cpu"}}, {"offload_optim_frac": 1.0}),
    ({"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
     {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}),
    ({"offload_param": {"device": "cpu"}}, {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_param": {"device": "cpu"}},
     {"offload_optim_frac": 0.3, "offload_param_frac": 0.3}),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
     {"offload_optim_frac": 1.0, "disk_dir": "/nvme"}),
    ({"cpu_offload": True}, {"offload_optim_frac": 1.0}),  # DeepSpeed's deprecated spelling
])
def test_offload_maps_to_the_static_policy(zero, options):
    conversion = convert(zero)
    assert conversion.config.placement == "static" and conversion.config.placement_options == options
    zero_offload = pytest.importorskip("zero_offload")
    zero_offload.StaticConfig.from_options(options)  # options the policy accepts


def test_offload_keys_that_need_nothing_or_cannot_map():
    conversion = convert({"offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": True},
                          "offload_param": {"device": "none", "pin_memory": True}})
    assert conversion.config.placement_options == {"offload_optim_frac": 1.0}
    assert set(conversion.no_ops) == {"zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.device",
                                      "zero_optimization.offload_param.pin_memory"}
    assert set(conversion.tuning) == {"zero_optimization.offload_optimizer.fast_init"}  # memory and speed only
    stage2 = convert_deepspeed_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert stage2.config.placement == "device"
    assert "only at stage 3" in stage2.unmapped["zero_optimization.offload_param.device"]
    two_disks = convert({"offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                         "offload_param": {"device": "nvme", "nvme_path": "/b"}})
    assert two_disks.config.placement_options["disk_dir"] == "/a"
    assert "'/b' is not used" in two_disks.unmapped["zero_optimization.offload_param.nvme_path"]


def test_hpz_partition_size():
    assert convert({"zero_hpz_partition_size": 8}).config.reshard_after_forward == 8
    assert "zero_optimization.zero_hpz_partition_size" in convert({"zero_hpz_partition_size": 1}).no_ops
    stage2 = convert_deepspeed_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}})
    assert stage2.config.reshard_after_forward is True and "stage 3 only" in stage2.unmapped[
        "zero_optimization.zero_hpz_partition_size"]


@pytest.mark.parametrize("key", ["overlap_comm", "contiguous_gradients", "round_robin_gradients"])
@pytest.mark.parametrize("value", [True, False])
def test_always_on_or_not_applicable_keys_are_no_ops(key, value):
    conversion = convert({key: value})
    assert conversion.config == ZeroConfig() and conversion.unmapped == {}
    assert conversion.no_ops[f"zero_optimization.{key}"]  # with a reason


def test_gradient_clipping_is_carried_and_reported():
    conversion = convert(gradient_clipping=1.0)
    assert conversion.gradient_clipping == 1.0
    assert "zero_core.clip_grad_norm_(model, 1.0)" in conversion.unmapped["gradient_clipping"]
    off = convert(gradient_clipping=0)
    assert off.gradient_clipping is None and "gradient_clipping" in off.no_ops


def test_auto_values_are_reported_and_left_at_zeros_defaults():
    conversion = convert({"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
                         bf16={"enabled": "auto"}, gradient_clipping="auto", communication_data_type="auto",
                         train_batch_size="auto")
    assert conversion.config == ZeroConfig() and conversion.gradient_clipping is None
    for key in ("zero_optimization.reduce_bucket_size", "bf16.enabled", "gradient_clipping", "communication_data_type"):
        assert "'auto' is a placeholder" in conversion.unmapped[key], key
    assert set(conversion.unmapped) == {"zero_optimization.reduce_bucket_size", "bf16.enabled", "gradient_clipping",
                                        "communication_data_type"}
    assert set(conversion.tuning) == {"zero_optimization.stage3_prefetch_bucket_size"}  # zero sizes gathers itself
    assert set(conversion.quiet) == {"train_batch_size"}  # the data loader's business, filled or not


# Every key a ZeRO-3 offload config of DeepSpeed's documentation and the HF templates uses, and some more.
FULL = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": {"type": "WarmupLR"},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
             "min_loss_scale": 1},
    "bf16": {"enabled": False}, "communication_data_type": "fp32", "gradient_predivide_factor": 1.0,
    "prescale_gradients": False, "gradient_clipping": 1.0, "steps_per_print": 100, "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True, "activation_checkpointing": {"partition_activations": True},
    "tensorboard": {"enabled": True}, "my_own_key": 1,
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
        "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 1e9}, "overlap_comm": True,
        "contiguous_gradients": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "reduce_scatter": True,
        "allgather_partitions": True, "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True, "round_robin_gradients": True, "zero_hpz_partition_size": 8,
        "zero_quantized_weights": False, "zero_quantized_gradients": True, "mics_shard_size": -1,
        "ignore_unused_parameters": True, "load_from_fp32_weights": True, "elastic_checkpoint": False,
        "memory_efficient_linear": True, "some_future_knob": 3,
    },
}


def _leaves(config, prefix=""):
    """Key paths the importer reports: sections it understands are walked, any other key is one entry."""
    for key, value in config.items():
        path = prefix + key
        if isinstance(value, dict) and path in ("zero_optimization", "fp16", "bf16", "zero_optimization.offload_optimizer",
                                                 "zero_optimization.offload_param"):
            yield from _leaves(value, path + ".")
        else:
            yield path


def test_every_key_lands_in_exactly_one_report():
    conversion = convert_deepspeed_config(FULL)
    reports = [conversion.mapped, conversion.no_ops, conversion.unmapped, conversion.quiet, conversion.tuning]
    assert sum(len(r) for r in reports) == len(set().union(*reports))  # disjoint
    assert set().union(*reports) == set(_leaves(FULL))
    assert all(text.strip() for r in reports for text in r.values())  # each with a reason
    assert conversion.config == ZeroConfig(
        stage=3, precision=Precision(compute="fp16", reduce="fp32", gradient_predivide_factor=1.0,
                                     loss_scale=LossScale(init_scale=2.0**16, growth_interval=1000, hysteresis=2,
                                                          consecutive_hysteresis=False, min_scale=1.0)),
        reduce_bucket_mb=5e8 * 4 / 2**20, placement="static",
        placement_options={"offload_optim_frac": 1.0, "offload_param_frac": 1.0}, reshard_after_forward=8)
    for key in ("my_own_key", "zero_optimization.some_future_knob", "optimizer",
                "zero_optimization.zero_quantized_gradients"):
        assert key in conversion.unmapped
    for key in ("zero_optimization.offload_param.max_in_cpu", "zero_optimization.sub_group_size",
                "zero_optimization.stage3_max_live_parameters", "activation_checkpointing"):
        assert key in conversion.tuning
    for key in ("tensorboard", "steps_per_print", "wall_clock_breakdown", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        assert key in conversion.quiet
    for key in ("zero_optimization.zero_quantized_weights", "zero_optimization.mics_shard_size", "zero_allow_untested_optimizer"):
        assert key in conversion.no_ops
    report = conversion.report()
    assert report.startswith("DeepSpeed config -> zero_core.ZeroConfig\n")
    for title, entries in [("mapped", conversion.mapped), ("no effect: zero does this anyway, or it is off", conversion.no_ops),
                           ("changes training: zero cannot hold these, do this instead", conversion.unmapped)]:
        assert f"\n{title} ({len(entries)}):\n" in report
    assert all(f"  {key}: " in report for r in reports[:3] for key in r)
    assert all(key in report.split("quiet (")[1] for key in conversion.quiet)  # the quiet keys: named once, last


def test_from_deepspeed_warns_once_listing_every_unmapped_key():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        config = config_from_deepspeed(FULL)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller's line
    unmapped = convert_deepspeed_config(FULL).unmapped
    assert f"{len(unmapped)} DeepSpeed config key(s) change training unless you act on them" in str(record[0].message)
    assert all(f"  {key}: {reason}" in str(record[0].message) for key, reason in unmapped.items())
    assert config == convert_deepspeed_config(FULL).config


def test_strict_raises_instead_and_a_fully_mapped_config_is_silent():
    with pytest.raises(ConfigError, match=r"(?s)cannot be mapped to ZeroConfig, and strict=True:\n  .*gradient_clipping: "):
        config_from_deepspeed(FULL, strict=True)
    clean = ds({"overlap_comm": True, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_deepspeed(clean, strict=True) == config_from_deepspeed(clean)


def test_a_ds_config_json_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds(bf16={"enabled": True})))
    assert convert_deepspeed_config(path).config == convert_deepspeed_config(str(path)).config
    assert config_from_deepspeed(path).precision.compute is torch.bfloat16
    bad = tmp_path / "broken.json"
    bad.write_text('{"zero_optimization": ')
    with pytest.raises(ConfigError, match=rf"^DeepSpeed config {bad} is neither JSON nor hjson .*line 1"):
        convert_deepspeed_config(bad)
    commas = tmp_path / "trailing.json"  # DeepSpeed parses with hjson: trailing commas and comments load
    commas.write_text('{\n  // a comment\n  "zero_optimization": {"stage": 2,},\n  "bf16": {"enabled": true,},\n}\n')
    assert convert_deepspeed_config(commas).config.stage == 2
