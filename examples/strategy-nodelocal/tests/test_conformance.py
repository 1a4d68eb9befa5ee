"""The zero conformance kit run against the ``node-local`` strategy, plus its own plan: meshes, sizes, errors."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    import zero_strategy_nodelocal  # noqa: F401 - installed (pip install ./examples/strategy-nodelocal)
except ImportError:  # run from a checkout where the example is not installed: test its sources
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import zero_strategy_nodelocal.plugin  # noqa: E402
from torch import nn  # noqa: E402
from zero_strategy_nodelocal import DEFAULT_CHUNK_SIZE, SHARD_SIZE_ENV, NodeLocalStrategy  # noqa: E402

from zero_core import ChunkPolicy, ConfigError, ZeroConfig  # noqa: E402
from zero_core.plugin import MeshSpec, ParamInfo, Reduction, Topology, ZeroPlugins  # noqa: E402
from zero_core.testing import ShardStrategyConformance  # noqa: E402

ENV = (SHARD_SIZE_ENV, "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan reads the environment; each test sets what it needs (torchrun's LOCAL_WORLD_SIZE must not leak in)."""
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


class TestNodeLocal(ShardStrategyConformance):
    """No shard size set: one group over the whole mesh (plain full sharding), at 1, 2 and 4 ranks."""

    strategy_class = NodeLocalStrategy


class TestNodeLocalInPairs(ShardStrategyConformance):
    """Nodes of 2 ranks: every 1-D mesh becomes (W / 2, 2); the user's 2-D meshes are used as they are."""

    strategy_class = NodeLocalStrategy
    world_sizes = (2, 4, 8)

    @pytest.fixture(autouse=True)
    def _pairs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(SHARD_SIZE_ENV, "2")


class TestNodeLocalFromTorchrun(ShardStrategyConformance):
    """LOCAL_WORLD_SIZE (as torchrun sets it) without the override."""

    strategy_class = NodeLocalStrategy
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=100), reshard_after_forward=False)
    world_sizes = (4, 8)

    @pytest.fixture(autouse=True)
    def _torchrun(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


# -- the plan itself ----------------------------------------------------------------------


def infos(*sizes: int, frozen: tuple[int, ...] = ()) -> list[ParamInfo]:
    out = []
    for i, n in enumerate(sizes):
        p = nn.Parameter(torch.randn(n), requires_grad=i not in frozen)
        out.append(ParamInfo(f"layer{i}.weight", p, 0 if i not in frozen else None))
    return out


def plan(params: list[ParamInfo], world: int, *, chunk_size: int | None = 10, topology: Topology | None = None, **config):
    cfg = ZeroConfig(chunk=ChunkPolicy(chunk_size=chunk_size), **config)
    shard = topology.default.shard_ranks if topology is not None else world
    result = NodeLocalStrategy().plan(params, world_size=shard, config=cfg, topology=topology)
    result.validate(params, shard, topology)
    return result


def test_override_shards_within_groups_of_consecutive_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's value; the override wins
    monkeypatch.setenv(SHARD_SIZE_ENV, "2")
    params = infos(3, 4, 5, 9)
    result = plan(params, 4, topology=Topology.of(MeshSpec.of_shape((4,))), reshard_after_forward=False)
    assert result.chunk_plans is not None and len(result.chunk_plans) == len(result.chunks)
    for cp in result.chunk_plans:
        assert cp.mesh == MeshSpec.of_shape((4,)).hybrid(2)
        assert cp.mesh.shape == (2, 2) and cp.mesh.shard_groups() == [[0, 1], [2, 3]]
        assert cp.reduction is Reduction.REDUCE_SCATTER_ALL_REDUCE
        assert cp.reshard_after_forward is False
    # greedy in order: 3+4 fit in 10, 5 opens a new chunk, 9 another; sizes are multiples of 2, the last trimmed
    assert [[p.name for p in c.params] for c in result.chunks] == [
        ["layer0.weight", "layer1.weight"], ["layer2.weight"], ["layer3.weight"]]
    assert [c.size for c in result.chunks] == [10, 10, 10]


def test_local_world_size_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    result = plan(infos(8, 8), 8)  # one process per rank, no topology given: a 1-D mesh of 8 ranks
    assert {cp.mesh.shape for cp in result.chunk_plans} == {(4, 2)}
    assert result.chunk_plans[0].mesh.ranks == tuple(range(8))


def test_without_a_shard_size_it_shards_over_the_whole_mesh() -> None:
    result = plan(infos(8, 8), 4)
    assert {(cp.mesh.shape, cp.reduction) for cp in result.chunk_plans} == {((1, 4), Reduction.REDUCE_SCATTER)}


def test_a_two_dimensional_mesh_is_used_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # would not divide 4: ignored, the user laid the mesh out
    mesh = MeshSpec((2, 2), (0, 2, 1, 3))
    result = plan(infos(5, 6, 7), 4, topology=Topology.of(mesh))
    assert all(cp.mesh is mesh or cp.mesh == mesh for cp in result.chunk_plans)
    assert all(c.size % 2 == 0 for c in result.chunks)


def test_module_meshes_get_their_own_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARD_SIZE_ENV, "2")
    default, strided = MeshSpec.of_shape((4,)), MeshSpec((4, 1), (0, 1, 2, 3))
    topology = Topology.of(default, {"layer1": strided})
    result = plan(infos(2, 2, 2), 4, topology=topology)
    meshes = [(tuple(p.name for p in c.params), cp.mesh.shape) for c, cp in zip(result.chunks, result.chunk_plans)]
    assert meshes == [(("layer0.weight", "layer2.weight"), (2, 2)), (("layer1.weight",), (4, 1))]
    assert result.chunk_plans[1].reduction is Reduction.ALL_REDUCE


@pytest.mark.parametrize(("var", "value", "world", "match"), [
    (SHARD_SIZE_ENV, "3", 4, r"groups of 3 consecutive ranks .*ZERO_NODELOCAL_SHARD_SIZE=3.*4 ranks.*one of \[1, 2, 4\]"),
    ("LOCAL_WORLD_SIZE", "8", 4, r"groups of 8 .*LOCAL_WORLD_SIZE=8.*2-D \(replicate, shard\) mesh"),
    (SHARD_SIZE_ENV, "2", 1, r"groups of 2 .*1 ranks"),
    (SHARD_SIZE_ENV, "0", 4, r"ZERO_NODELOCAL_SHARD_SIZE='0'.*positive int"),
    (SHARD_SIZE_ENV, "two", 4, r"ZERO_NODELOCAL_SHARD_SIZE='two'.*positive int"),
])
def test_a_shard_size_that_does_not_fit_is_a_config_error(monkeypatch, var, value, world, match) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=match):
        plan(infos(4, 4), world)


def test_keys_never_share_a_chunk_and_large_parameters_get_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARD_SIZE_ENV, "4")
    params = infos(2, 3, 25, 2, 3, frozen=(1, 4))
    result = plan(params, 8)
    names = [[p.name for p in c.params] for c in result.chunks]
    assert names == [["layer0.weight", "layer3.weight"], ["layer1.weight", "layer4.weight"], ["layer2.weight"]]
    assert [c.size for c in result.chunks] == [4, 8, 28]  # trimmed to content, rounded up to the 4-rank shard group
    assert all(len({p.key for p in c.params}) == 1 for c in result.chunks)


def test_chunk_size_defaults_and_rounds_to_the_shard_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARD_SIZE_ENV, "4")
    assert [c.size for c in plan(infos(7, 7), 4, chunk_size=9).chunks] == [12, 8]  # 9 -> 12, the last one trimmed
    big = plan(infos(DEFAULT_CHUNK_SIZE - 1, 2), 4, chunk_size=None).chunks
    assert [c.size for c in big] == [DEFAULT_CHUNK_SIZE, 4]


def test_reshard_after_forward_as_a_group_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARD_SIZE_ENV, "4")
    assert {cp.reshard_after_forward for cp in plan(infos(4), 8, reshard_after_forward=2).chunk_plans} == {2}
    # a group at least the shard group's: the backward's gathers stay inside the node anyway
    assert {cp.reshard_after_forward for cp in plan(infos(4), 8, reshard_after_forward=4).chunk_plans} == {True}
    with pytest.raises(ConfigError, match="node-local strategy places chunks on mesh 2x4"):
        plan(infos(4), 8, reshard_after_forward=3)


def test_entry_point_registers_the_strategy() -> None:
    """Installed, the distribution's ``zero`` entry point makes ``strategy="node-local"`` resolve to it; from a
    checkout, pyproject.toml declares that entry point and the plugin module registers it."""
    declared = [ep for ep in importlib.metadata.entry_points(group="zero") if ep.value == "zero_strategy_nodelocal.plugin"]
    if declared:
        assert ZeroPlugins.load().strategies.get("node-local") is NodeLocalStrategy
    else:
        text = (ROOT / "pyproject.toml").read_text()
        assert '[project.entry-points.zero]\nstrategy-nodelocal = "zero_strategy_nodelocal.plugin"' in text
        assert ZeroPlugins.load([zero_strategy_nodelocal.plugin]).strategies.get("node-local") is NodeLocalStrategy


def test_imports_only_the_plugin_surface() -> None:
    """A third-party strategy: zero_core and zero_core.plugin only, never zero_core._* or another distribution."""
    allowed = {"zero_core", "zero_core.plugin"}
    for path in sorted((ROOT / "src" / "zero_strategy_nodelocal").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                if name.startswith("zero"):
                    assert name in allowed or name.startswith("zero_strategy_nodelocal"), f"{path.name} imports {name}"
