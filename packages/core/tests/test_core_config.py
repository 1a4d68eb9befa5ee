"""ZeroConfig and ChunkPolicy reject bad values at construction, naming the field and the fix."""

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"strategy": ""}, "ZeroConfig.strategy"),
        ({"comm_backend": 3}, "ZeroConfig.comm_backend"),
        ({"placement": None}, "ZeroConfig.placement"),
        ({"device": "tpu"}, "ZeroConfig.device"),
        ({"collective_timeout_s": 0}, "collective_timeout_s"),
        ({"collective_timeout_s": True}, "collective_timeout_s"),
        ({"sync_module_states": "yes"}, "sync_module_states"),
        ({"static_graph": 1}, "static_graph"),
        ({"chunk": {"chunk_size": 5}}, "ChunkPolicy"),
    ],
)
def test_zero_config_rejects(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -4}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"min_chunk_size": 0}, "min_chunk_size"),
        ({"search_interval": False}, "search_interval"),
        ({"search_range": -1}, "search_range"),
        ({"param_order": "random"}, "param_order"),
    ],
)
def test_chunk_policy_rejects(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ChunkPolicy(**kwargs)


def test_configs_are_frozen_and_keyword_only():
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=64))
    with pytest.raises(AttributeError):
        config.strategy = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroConfig("chunk")  # type: ignore[misc]
    assert config.replace(static_graph=True).static_graph is True
    with pytest.raises(ConfigError):
        config.replace(collective_timeout_s=-1)


@pytest.mark.parametrize("bad", [0, 4, "2", 2.0, True, None])
def test_unknown_stage(bad):
    with pytest.raises(ConfigError, match="ZeroConfig.stage must be 1, 2 or 3"):
        ZeroConfig(stage=bad)


@pytest.mark.parametrize("field", ["compute", "reduce"])
@pytest.mark.parametrize("bad", ["fp8", "float64", torch.int8, torch.float64, 16])
def test_unknown_dtype(field, bad):
    with pytest.raises(ConfigError, match=rf"Precision.{field} must be one of 'fp32', 'bf16', 'fp16'"):
        Precision(**{field: bad})


def test_dtype_spellings_normalise_to_torch_dtypes():
    assert Precision(compute="BF16", reduce="float32") == Precision(compute=torch.bfloat16, reduce=torch.float32)
    assert Precision(compute="half", loss_scale=LossScale()).compute is torch.float16
    assert Precision().compute is None and Precision().reduce is torch.float32


def test_fp16_without_a_loss_scale():
    with pytest.raises(ConfigError, match=r"fp16 compute needs loss scaling.*loss_scale=LossScale\(\)"):
        Precision(compute="fp16")


@pytest.mark.parametrize(("field", "bad", "message"), [
    ("init_scale", 0, "positive finite number"), ("init_scale", float("inf"), "positive finite number"),
    ("growth_factor", 1.0, "above 1"), ("backoff_factor", 1.0, "below 1"), ("hysteresis", 0, "positive int"),
    ("growth_interval", 1.5, "positive int"), ("min_scale", 1e9, "above init_scale"), ("dynamic", "yes", "True or False"),
])
def test_bad_loss_scale(field, bad, message):
    with pytest.raises(ConfigError, match=f"LossScale.{field}.*{message}|{message}"):
        LossScale(**{field: bad})


def test_precision_must_be_a_precision():
    with pytest.raises(ConfigError, match="ZeroConfig.precision must be a Precision"):
        ZeroConfig(precision="bf16")


def test_the_gpu_follows_local_rank_unless_the_script_chose_one():
    from zero_core.setup._setup import cuda_index

    assert cuda_index("3", 0, 8) == 3  # torchrun's 4th process of a node, no set_device: its own GPU
    assert cuda_index("3", 5, 8) == 5  # the script chose one: kept
    assert cuda_index("3", 0, 1) == 0  # one visible GPU per process (CUDA_VISIBLE_DEVICES)
    assert cuda_index(None, 0, 8) == 0  # not launched by torchrun
    assert cuda_index("9", 0, 8) == 1  # more processes than GPUs: shared round-robin


def test_comm_is_a_deprecated_alias_of_comm_backend():
    """``comm`` (a name) was renamed ``comm_backend``: ``comm`` elsewhere is a backend object. The old keyword,
    ``dataclasses.replace`` keyword, attribute and file key still work, each with a warning naming the new one."""
    import dataclasses

    with pytest.warns(DeprecationWarning, match="renamed comm_backend; pass comm_backend= instead"):
        old = ZeroConfig(comm="bucketed")  # type: ignore[call-arg]
    assert old == ZeroConfig(comm_backend="bucketed")
    with pytest.warns(DeprecationWarning, match="read config.comm_backend instead"):
        assert old.comm == "bucketed"
    with pytest.warns(DeprecationWarning, match="renamed comm_backend"):
        assert dataclasses.replace(ZeroConfig(), comm="torch") == ZeroConfig(comm_backend="torch")
    with pytest.warns(DeprecationWarning, match="write the key comm_backend instead"):
        assert ZeroConfig.from_dict({"comm": "torch"}) == ZeroConfig(comm_backend="torch")
    assert ZeroConfig(comm_backend="torch").to_dict()["comm_backend"] == "torch"  # files get the new key
    assert "comm" not in ZeroConfig(comm_backend="torch").to_dict()


def test_comm_and_comm_backend_together_are_refused():
    with pytest.raises(ConfigError, match="got both comm= and comm_backend=.*pass comm_backend= only"):
        ZeroConfig(comm="torch", comm_backend="bucketed")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="comm and comm_backend are both set.*keep comm_backend only"):
        ZeroConfig.from_dict({"comm": "torch", "comm_backend": "bucketed"})
    with pytest.raises(ConfigError, match="ZeroConfig.comm_backend must be a non-empty plugin name"):
        with pytest.warns(DeprecationWarning):
            ZeroConfig(comm="")  # type: ignore[call-arg]
