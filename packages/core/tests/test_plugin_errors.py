"""Plugin authors and config typos get zero's errors: the placement policy contract of docs/plugins.md, with its
example trained as written; a policy or class that breaks the contract; unknown config fields and plugin names."""

from __future__ import annotations

import dataclasses
import pickle
import re
import types
from pathlib import Path

import pytest
import torch

from zero_core import ChunkPolicy, ConfigError, LossScale, Precision, ZeroConfig
from zero_core.base.errors import PluginContractError, PluginNotFoundError
from zero_core.plugin import MemoryTier, PlacementPolicy, Registry
from zero_core.testing import assert_parity, get_case, run_distributed, train_sharded

DOCS = Path(__file__).resolve().parents[3] / "docs" / "plugins.md"
SECTION = "## A placement policy with zero-core alone"


def docs_example() -> str:
    """The one Python block of the docs section, exactly as written there."""
    text = DOCS.read_text()
    section = text[text.index(SECTION):]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"{DOCS}: the section should hold one example, found {len(blocks)}"
    return blocks[0]


def example_module(source: str) -> types.ModuleType:
    module = types.ModuleType("docs_placement_example")
    exec(compile(source, f"{DOCS}:{SECTION}", "exec"), module.__dict__)
    return module


def _example_and_broken(source: str) -> dict:
    """On every rank: the docs example against device placement (stage 3 and 1), and the example without its
    before_gather, which must fail with zero's error on every rank."""
    module = example_module(source)
    case = get_case("gpt")
    out: dict = {"tiers": set()}

    def tiers(model, step):
        out["tiers"] |= {chunk.tier for chunk in model.engine.chunks}

    for stage in (3, 1):
        base = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=case.chunk_size))
        out[f"device{stage}"] = train_sharded("gpt", config=base, steps=3)
        out[f"example{stage}"] = train_sharded("gpt", config=base.replace(placement="alternate"), steps=3,
                                               plugins=[module], after_step=tiers)

    class Forgetful(module.AlternatePolicy):  # written from the old docs: name, attach, tier_of only
        name = "forgetful"
        before_gather = PlacementPolicy.before_gather

    class Plugin:
        @staticmethod
        @module.hookimpl
        def zero_register_placement_policies(registry):
            registry.add(Forgetful.name, Forgetful)

    config = ZeroConfig(placement="forgetful", chunk=ChunkPolicy(chunk_size=case.chunk_size))
    try:
        train_sharded("gpt", config=config, steps=1, plugins=[Plugin()])
        out["broken"] = "trained"
    except PluginContractError as exc:
        out["broken"] = str(exc)
    return out


def test_the_docs_example_policy_trains_at_parity_and_the_contract_is_enforced():
    results = run_distributed(_example_and_broken, 2, docs_example(), timeout=240)
    for rank, result in enumerate(results):
        assert result["tiers"] == {MemoryTier.DEVICE, MemoryTier.HOST}, result["tiers"]  # both tiers used
        for stage in (3, 1):
            assert_parity(result[f"device{stage}"], result[f"example{stage}"], rtol=1e-6,
                          label=f"rank {rank} stage {stage}")
        message = result["broken"]
        assert message.startswith("placement policy 'forgetful' (") and "Forgetful) left chunk 1 on the host tier" \
            in message, message
        assert "override before_gather(chunks)" in message and "move_shard(chunk, device)" in message, message


def test_a_policy_class_with_an_abstract_method_left_is_refused_by_name():
    class NoTiers(PlacementPolicy):
        name = "no-tiers"

        def attach(self, chunks):
            pass

    registry: Registry[type] = Registry("placement policy")
    registry.add("no-tiers", NoTiers)
    with pytest.raises(PluginContractError, match=r"the placement policy 'no-tiers' \(.*NoTiers\) does not implement "
                                                   r"tier_of: a placement policy must override every abstract method"):
        registry.get("no-tiers")


@pytest.mark.parametrize(("kwargs", "kind", "close"), [
    ({"strategy": "chunked"}, "shard strategy", "chunk"),
    ({"placement": "hots"}, "placement policy", "host"),
    ({"comm_backend": "bucketd"}, "comm backend", "bucketed"),
])
def test_an_unknown_plugin_name_gets_the_closest_one(kwargs, kind, close):
    from zero_core import shard

    model = torch.nn.Linear(4, 4)
    name = next(iter(kwargs.values()))
    with pytest.raises(PluginNotFoundError, match=rf"^no {kind} named '{name}' is registered \(available: .*"
                                                   rf"{close}.*\); did you mean '{close}'\?"):
        shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(**kwargs))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ZeroConfig(stag=2), "ZeroConfig has no field 'stag'; did you mean 'stage'? Its fields: stage, precision,"),
    (lambda: Precision(compte="bf16"), "Precision has no field 'compte'; did you mean 'compute'?"),
    (lambda: ChunkPolicy(chunksize=64), "ChunkPolicy has no field 'chunksize'; did you mean 'chunk_size'?"),
    (lambda: LossScale(init_scal=2.0), "LossScale has no field 'init_scal'; did you mean 'init_scale'?"),
    (lambda: ZeroConfig(zzz=1), "ZeroConfig has no field 'zzz'. Its fields: stage,"),
    (lambda: ZeroConfig().replace(strategi="chunk"), "ZeroConfig has no field 'strategi'; did you mean 'strategy'?"),
    (lambda: dataclasses.replace(Precision(), reduc="fp32"), "Precision has no field 'reduc'; did you mean 'reduce'?"),
])
def test_an_unknown_config_field_gets_the_closest_one(build, message):
    with pytest.raises(ConfigError) as refused:
        build()
    assert str(refused.value).startswith(message), str(refused.value)


def test_config_classes_stay_frozen_keyword_only_dataclasses():
    config = ZeroConfig(stage=2, precision=Precision(compute="bf16", loss_scale=None), chunk=ChunkPolicy(chunk_size=64))
    assert pickle.loads(pickle.dumps(config)) == config
    assert dataclasses.replace(config, stage=1) == ZeroConfig(stage=1, precision=config.precision, chunk=config.chunk)
    assert not hasattr(config, "__dict__")  # slots kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroConfig(2)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="ZeroConfig.stage must be 1, 2 or 3"):  # the fields' own checks still run
        ZeroConfig(stage=4)
