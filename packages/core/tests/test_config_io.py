"""ZeroConfig to and from dicts and JSON, TOML and YAML files: exact round trips, and errors that name the key."""

import sys
import tomllib

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig

try:
    import yaml
except ImportError:  # optional: YAML files need PyYAML (the CI installs it with transformers)
    yaml = None
NEEDS_YAML = pytest.mark.skipif(yaml is None, reason="PyYAML is not installed")

CONFIGS = {
    "default": ZeroConfig(),
    "stage1-bf16": ZeroConfig(stage=1, precision=Precision(compute="bf16", reduce="bf16")),
    "fp16-static-scale": ZeroConfig(stage=2, precision=Precision(
        compute="fp16", loss_scale=LossScale(init_scale=1024, growth_factor=4.0, backoff_factor=0.25, growth_interval=7,
                                             hysteresis=3, min_scale=0.5, dynamic=False),
        gradient_predivide_factor=4)),
    "everything-set": ZeroConfig(
        strategy="tensor", comm_backend="bucketed", reduce_bucket_mb=12.5, device="cuda:1", collective_timeout_s=30,
        sync_module_states=False, check_ranks_agree=False, static_graph=True, reshard_after_forward=4,
        shard_optimizer_across_replicas=True, release_host_memory=False,
        chunk=ChunkPolicy(chunk_size=300, min_chunk_size=64, search_interval=8, search_range=4096, param_order="first_use")),
    "no-bucketing": ZeroConfig(reduce_bucket_mb=-1, reshard_after_forward=False, device="cpu"),
    "options-mapping": ZeroConfig(placement="static", placement_options={
        "offload_optim_frac": 0.5, "host_budget_mb": 16384, "disk_dir": "/scratch/zéro \"disk\"", "extra": {"list": [1, 2.5, "x"]}}),
}
FORMATS = ["dict", "json", "toml", pytest.param("yaml", marks=NEEDS_YAML), pytest.param("yml", marks=NEEDS_YAML)]


def _round_trip(config, fmt, tmp_path):
    if fmt == "dict":
        return ZeroConfig.from_dict(config.to_dict())
    path = tmp_path / f"config.{fmt}"
    config.to_file(path)
    return ZeroConfig.from_file(str(path))  # the CLI passes a str


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_exact(name, fmt, tmp_path):
    config = CONFIGS[name]
    assert _round_trip(config, fmt, tmp_path) == config


def test_to_dict_schema():
    """Nested tables, dtype names, None left out, defaults written (the documented schema)."""
    config = ZeroConfig(precision=Precision(compute="bf16"), chunk=ChunkPolicy(chunk_size=64))
    assert config.to_dict() == {
        "stage": 3, "precision": {"compute": "bf16", "reduce": "fp32", "gradient_predivide_factor": 1.0},
        "strategy": "chunk", "reduce_bucket_mb": 25.0, "placement": "device", "placement_options": {},
        "chunk": {"chunk_size": 64, "min_chunk_size": 1 << 20, "search_interval": 1024, "search_range": 1 << 22,
                  "param_order": "registration"},
        "collective_timeout_s": 300.0, "sync_module_states": True, "check_ranks_agree": True, "static_graph": False,
        "reshard_after_forward": True, "shard_optimizer_across_replicas": False, "optimizer_updates": "auto",
        "release_host_memory": True,
    }


@NEEDS_YAML
def test_files_hold_the_dict(tmp_path):
    config = CONFIGS["fp16-static-scale"]
    for fmt, load in [("toml", lambda p: tomllib.loads(p.read_text())), ("yaml", lambda p: yaml.safe_load(p.read_text()))]:
        path = tmp_path / f"c.{fmt}"
        config.to_file(path)
        assert load(path) == config.to_dict()
    assert "[precision.loss_scale]" in (tmp_path / "c.toml").read_text()


@pytest.mark.parametrize("fmt", FORMATS)
def test_policy_config_object_reads_back_as_its_non_default_fields(fmt, tmp_path):
    zero_offload = pytest.importorskip("zero_offload")  # the options classes live in zero-offload
    options = zero_offload.GeminiConfig(device_budget_mb=512.5, margin_ratio=0.25, prefetch=False)
    config = ZeroConfig(placement="gemini", placement_options=options)
    back = _round_trip(config, fmt, tmp_path)
    assert back.placement_options == {"device_budget_mb": 512.5, "margin_ratio": 0.25, "prefetch": False}
    assert back == config.replace(placement_options=back.placement_options)
    assert zero_offload.GeminiConfig.from_options(back.placement_options) == options  # the policy builds the same object
    assert ZeroConfig(placement_options=zero_offload.StaticConfig()).to_dict()["placement_options"] == {}


@pytest.mark.parametrize("fmt", ["toml", pytest.param("yaml", marks=NEEDS_YAML), pytest.param("yml", marks=NEEDS_YAML)])
def test_an_empty_file_is_the_default_config(fmt, tmp_path):
    path = tmp_path / f"empty.{fmt}"
    path.write_text("")
    assert ZeroConfig.from_file(path) == ZeroConfig()


def test_missing_keys_take_their_defaults():
    assert ZeroConfig.from_dict({"precision": {"compute": "bf16"}}) == ZeroConfig(precision=Precision(compute="bf16"))


@pytest.mark.parametrize(("data", "message"), [
    ({"precison": {}}, r"^unknown config key 'precison'; did you mean 'precision'\? Valid keys at the top level: stage, "
                       r"precision, strategy, .*, reshard_after_forward, shard_optimizer_across_replicas, optimizer_updates, "
                       r"release_host_memory\.$"),
    ({"precision": {"compte": "bf16"}}, r"^unknown config key 'precision.compte'; did you mean 'precision.compute'\? "
                                        r"Valid keys in precision: compute, reduce, loss_scale, gradient_predivide_factor\.$"),
    ({"precision": {"loss_scale": {"windw": 3}}}, r"^unknown config key 'precision.loss_scale.windw'\. Valid keys in "
                                                  r"precision.loss_scale: init_scale, growth_factor, .*, dynamic\.$"),
    ({"chunk": {"chunksize": 64}}, r"did you mean 'chunk.chunk_size'\?"),
    ({"precision": {"compute": "fp8"}}, r"^precision.compute: Precision.compute must be one of 'fp32', 'bf16', 'fp16'.*got 'fp8'"),
    ({"precision": {"reduce": 16}}, r"^precision.reduce: Precision.reduce must be one of .*got 16"),
    ({"precision": {"compute": "fp16"}}, r"^precision: fp16 compute needs loss scaling"),
    ({"precision": {"compute": "fp16", "loss_scale": {"init_scale": 2, "min_scale": 8}}},
     r"^precision.loss_scale.min_scale: LossScale.min_scale 8.0 is above init_scale 2.0"),
    ({"precision": {"loss_scale": {"growth_factor": 1}}}, r"^precision.loss_scale.growth_factor: .*above 1, got 1.0"),
    ({"stage": 4}, r"^stage: ZeroConfig.stage must be 1, 2 or 3, got 4"),
    ({"stage": "3"}, r"^stage: ZeroConfig.stage must be 1, 2 or 3, got '3'"),
    ({"chunk": {"chunk_size": 0}}, r"^chunk.chunk_size: ChunkPolicy.chunk_size must be a positive int or None, got 0"),
    ({"chunk": {"param_order": "random"}}, r"^chunk.param_order: .*'registration' or 'first_use', got 'random'"),
    ({"reshard_after_forward": 1}, r"^reshard_after_forward: ZeroConfig.reshard_after_forward must be True .*got 1"),
    ({"device": "tpu"}, r"^device: ZeroConfig.device must be None, 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"precision": "bf16"}, r"^precision must be a table of Precision fields .* got str 'bf16'"),
    ({"precision": {"loss_scale": True}}, r"^precision.loss_scale must be a table of LossScale fields .* got bool True"),
    ({"placement_options": [1]}, r"^placement_options must be a table of the placement policy's options.* got list \[1\]"),
    ([("stage", 3)], r"^the config must be a table of ZeroConfig fields"),
])
def test_errors_name_the_key_path_the_value_and_the_valid_values(data, message):
    with pytest.raises(ConfigError, match=message):
        ZeroConfig.from_dict(data)


@NEEDS_YAML
def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('stage = 3\n[precision]\ncompute = "fp9"\n')
    with pytest.raises(ConfigError, match=rf"^{bad}: precision.compute: Precision.compute must be one of .*got 'fp9'"):
        ZeroConfig.from_file(bad)
    for name, text, fmt in [("bad.json", "{stage: 3}", "JSON"), ("broken.toml", "stage = = 3\n", "TOML"),
                            ("bad.yaml", "stage: [3", "YAML")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"(?s)^{tmp_path / name} is not valid {fmt}: .*line 1"):
            ZeroConfig.from_file(tmp_path / name)
    with pytest.raises(ConfigError, match=r"from its suffix '.ini'; name it with one of .json, .toml, .yaml, .yml"):
        ZeroConfig.from_file(tmp_path / "zero.ini")
    with pytest.raises(ConfigError, match=r"suffix ''"):
        ZeroConfig().to_file(tmp_path / "zero")


@NEEDS_YAML
def test_values_a_file_cannot_hold(tmp_path):
    with pytest.raises(ConfigError, match=r"^placement_options.disk_dir is None, which TOML cannot hold .*leave the key out"):
        ZeroConfig(placement_options={"disk_dir": None}).to_file(tmp_path / "c.toml")
    config = ZeroConfig(placement_options={"disk_dir": None})  # JSON and YAML have null
    for fmt in ("json", "yaml"):
        assert _round_trip(config, fmt, tmp_path) == config
    with pytest.raises(ConfigError, match=r"^placement_options.dtype is a dtype \(torch.float16\), which a config file "
                                          r"cannot hold; use strings, numbers, booleans, lists and tables\."):
        ZeroConfig(placement_options={"dtype": torch.float16}).to_dict()
    with pytest.raises(ConfigError, match=r"^placement_options.tiers has the key 1; config files hold string keys only"):
        ZeroConfig(placement_options={"tiers": {1: "host"}}).to_dict()


def test_yaml_without_pyyaml_says_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("stage: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    with pytest.raises(ConfigError, match=r"YAML config files need PyYAML: pip install pyyaml"):
        ZeroConfig.from_file(path)
    with pytest.raises(ConfigError, match=r"pip install pyyaml"):
        ZeroConfig().to_file(tmp_path / "out.yml")
