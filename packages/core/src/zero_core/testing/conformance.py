"""Conformance kits: pytest base classes a plugin author subclasses to test an implementation.

Subclass the kit in a test module, set the class attribute naming your implementation,
and pytest collects every inherited ``test_*`` method::

    from zero_core.testing import PlacementPolicyConformance
    from my_zero_policy import LruPolicy

    class TestLru(PlacementPolicyConformance):
        policy_class = LruPolicy

Each test's docstring says what a failure usually means.
"""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from typing import Any, ClassVar

import torch

from zero_core.base._state import ChunkState, MemoryTier
from zero_core.chunks._collectives import broadcast_from_rank0, gather_chunk
from zero_core.chunks.chunk import Chunk, ChunkSpec, ParamInfo
from zero_core.comm.backend import CollectiveKind, CommBackend
from zero_core.config.api import ChunkPolicy, ZeroConfig
from zero_core.interfaces._plugins import hookimpl
from zero_core.interfaces.mesh import MeshSpec, Topology
from zero_core.interfaces.placement import PlacementPolicy
from zero_core.interfaces.strategy import ChunkPlan, ShardPlan, ShardStrategy
from zero_core.testing.distributed import run_distributed
from zero_core.testing.zoo import ZOO, get_case

__all__ = ["ChunkConformance", "CommBackendConformance", "PlacementPolicyConformance", "ShardStrategyConformance"]


def _params(case: str) -> list[ParamInfo]:
    torch.manual_seed(0)
    model = get_case(case).build()
    return [ParamInfo(n, p, 0 if p.requires_grad else None) for n, p in model.named_parameters()]


def _chunks(world_size: int = 1, rank: int = 0, case: str = "gpt") -> list[Chunk]:
    params = _params(case)
    specs: list[ChunkSpec] = []
    current: list[ParamInfo] = []
    used = 0
    for info in params:  # simple packing: a new chunk whenever 300 elements are exceeded or the key changes
        if current and (used + info.numel > 300 or current[-1].key != info.key):
            specs.append(ChunkSpec(tuple(current), -(-used // world_size) * world_size))
            current, used = [], 0
        current.append(info)
        used += info.numel
    specs.append(ChunkSpec(tuple(current), -(-used // world_size) * world_size))
    return [Chunk(i, s, rank=rank, world_size=world_size, device=torch.device("cpu")) for i, s in enumerate(specs)]


# -- comm backends -------------------------------------------------------------------


def _comm_worker(backend_cls: type[CommBackend]) -> dict[str, Any]:
    import torch.distributed as dist

    comm = backend_cls(dist.group.WORLD, timeout=timedelta(seconds=60))
    n, r = comm.world_size, comm.rank
    shard = torch.arange(3, dtype=torch.float32) + 10 * r
    full = torch.empty(3 * n)
    comm.all_gather(full, shard)
    rs_in = torch.arange(2 * n, dtype=torch.float32) * (r + 1)
    rs_out = torch.empty(2)
    comm.reduce_scatter(rs_out, rs_in)
    pending_out = torch.empty(2)
    pending = comm.reduce_scatter(pending_out, rs_in.clone(), async_op=True)
    if pending is not None:
        pending.wait()
    ar = torch.tensor([float(r + 1)])
    comm.all_reduce(ar)
    mx = torch.tensor([float(r)])
    comm.all_reduce(mx, op="max")
    b = torch.full((4,), float(r))
    comm.broadcast(b, src=0)
    agreed = comm.agree_min(5 + r)
    anyflags = comm.agree_any(torch.tensor([0, int(r == n - 1), 0], dtype=torch.uint8))
    objs = comm.all_gather_object({"rank": r})
    stats = comm.stats.summary(comm.stats.current)  # before agree_max: its default counts as an all-reduce
    maxed = comm.agree_max(torch.tensor([r, -r, 7], dtype=torch.int64)).tolist()
    # all_to_all with uneven splits: rank r sends rank j (j + 1) copies of 100 r + j
    sent = torch.cat([torch.full((j + 1,), float(100 * r + j)) for j in range(n)])
    exchanged = torch.empty((r + 1) * n)
    comm.all_to_all(exchanged, sent, output_splits=[r + 1] * n, input_splits=[j + 1 for j in range(n)])
    # the collectives that may be lossy ([Note: collectives that may be lossy] in zero_core.comm.backend), on values
    # that span several blocks of any block size up to 256 and end in a partial one
    values = [torch.randn(700 * n, generator=torch.Generator().manual_seed(k)) for k in range(n)]
    gathered = torch.empty(700 * n)
    comm.all_gather_params(gathered, values[r][:700])
    gathered_async = torch.empty(700 * n)
    pending = comm.all_gather_params(gathered_async, values[r][:700].clone(), async_op=True)
    if pending is not None:
        pending.wait()
    in_place = torch.zeros(700 * n)
    in_place[700 * r : 700 * (r + 1)] = values[r][:700]
    comm.all_gather_params(in_place, in_place[700 * r : 700 * (r + 1)])
    grads = torch.empty(700)
    comm.reduce_scatter_grads(grads, values[r].clone())
    grads_async = torch.empty(700)
    pending = comm.reduce_scatter_grads(grads_async, values[r].clone(), async_op=True)
    if pending is not None:
        pending.wait()
    return {
        "rank": r, "world": n, "full": full, "rs": rs_out, "rs_async": pending_out, "ar": ar.item(), "max": mx.item(),
        "bcast": b, "agreed": agreed, "any": anyflags.tolist(), "maxed": maxed, "objs": objs, "stats": stats,
        "exchanged": exchanged, "values": values, "gathered": gathered, "gathered_async": gathered_async,
        "in_place": in_place, "grads": grads, "grads_async": grads_async,
    }


class CommBackendConformance:
    """Tests for a :class:`~zero_core.plugin.CommBackend`; set ``backend_class``.

    The tests run the backend on 1 and 2 gloo ranks in separate processes.
    """

    backend_class: ClassVar[type[CommBackend]]
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    #: How far ``all_gather_params`` may move a value, as a fraction of the largest magnitude among the inputs
    #: gathered; 0 (default) demands the exact gather. A lossy backend states its bound here (int8 blocks with
    #: absmax scales: 1/254), see [Note: collectives that may be lossy] in ``zero_core.comm.backend``.
    params_tolerance: ClassVar[float] = 0.0
    #: How far ``reduce_scatter_grads`` may move a sum, as a fraction of the sum over ranks of each rank's largest
    #: input magnitude; 0 (default) demands exactly the sum in rank order.
    grads_tolerance: ClassVar[float] = 0.0

    _results: ClassVar[dict[tuple[type[CommBackend], int], list[dict[str, Any]]]] = {}

    def _run(self, world: int) -> list[dict[str, Any]]:
        # one world per size and backend for the whole class: every test reads the same run
        key = (self.backend_class, world)
        if key not in CommBackendConformance._results:
            CommBackendConformance._results[key] = run_distributed(_comm_worker, world, self.backend_class, timeout=120)
        return CommBackendConformance._results[key]

    def test_lossy_collectives_within_tolerance(self) -> None:
        """all_gather_params and reduce_scatter_grads compute what all_gather and reduce_scatter do, within
        params_tolerance and grads_tolerance (exactly, by default); every rank gathers the same values; a gather in
        place leaves this rank's own row bit for bit. A failure with the default tolerances means the backend's
        lossy path ran where the exact one was asked for."""
        for world in self.world_sizes:
            results = self._run(world)
            for res in results:
                n, r, values = res["world"], res["rank"], res["values"]
                # exact at one rank: nothing is sent, so nothing needs quantizing
                params_tol = self.params_tolerance if n > 1 else 0.0
                grads_tol = self.grads_tolerance if n > 1 else 0.0
                expect = torch.cat([v[:700] for v in values])
                bound = params_tol * max(v[:700].abs().max().item() for v in values)
                for key in ("gathered", "gathered_async", "in_place"):
                    err = (res[key] - expect).abs().max().item()
                    assert err <= bound, f"{key} at rank {r} of {n}: off by up to {err:.3g}, allowed {bound:.3g}"
                own = slice(700 * r, 700 * (r + 1))
                assert torch.equal(res["in_place"][own], values[r][:700]), "a gather in place changed this rank's row"
                exact = torch.sum(torch.stack([v.view(n, 700)[r] for v in values]), dim=0)
                bound = grads_tol * sum(v.view(n, 700)[r].abs().max().item() for v in values)
                for key in ("grads", "grads_async"):
                    err = (res[key] - exact).abs().max().item()
                    assert err <= bound, f"{key} at rank {r} of {n}: off by up to {err:.3g}, allowed {bound:.3g}"
            for key in ("gathered", "gathered_async"):
                assert all(torch.equal(res[key], results[0][key]) for res in results), f"{key} differs between ranks"

    def test_collectives_compute_the_right_values(self) -> None:
        """all_gather concatenates in rank order; reduce_scatter sums and keeps this rank's slice."""
        for world in self.world_sizes:
            for res in self._run(world):
                n, r = res["world"], res["rank"]
                expect_full = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * k for k in range(n)])
                torch.testing.assert_close(res["full"], expect_full)
                total = sum(k + 1 for k in range(n))
                expect_rs = torch.arange(2 * n, dtype=torch.float32)[2 * r : 2 * r + 2] * total
                torch.testing.assert_close(res["rs"], expect_rs)
                torch.testing.assert_close(res["rs_async"], expect_rs)
                assert res["ar"] == total and res["max"] == n - 1
                torch.testing.assert_close(res["bcast"], torch.zeros(4))
                assert res["agreed"] == 5
                assert res["any"] == [0, 1, 0]
                assert res["maxed"] == [n - 1, 0, 7]
                assert [o["rank"] for o in res["objs"]] == list(range(n))
                expect_a2a = torch.cat([torch.full((r + 1,), float(100 * i + r)) for i in range(n)])
                torch.testing.assert_close(res["exchanged"], expect_a2a)

    def test_counts_match_ring_formulas(self) -> None:
        """Bytes sent per rank follow the ring convention in zero_core.comm.backend's docstring; one rank sends nothing."""
        for world in self.world_sizes:
            stats = self._run(world)[0]["stats"]
            if world == 1:
                assert all(v["bytes_sent"] == 0 for v in stats.values()), stats
                continue
            n = world
            assert stats[CollectiveKind.ALL_GATHER.value] == {"calls": 1, "bytes_sent": (n - 1) * 3 * 4}
            assert stats[CollectiveKind.REDUCE_SCATTER.value] == {"calls": 2, "bytes_sent": 2 * (n - 1) * 2 * 4}
            assert stats[CollectiveKind.ALL_REDUCE.value] == {"calls": 2, "bytes_sent": 2 * (2 * (n - 1) * 4 // n)}
            assert stats[CollectiveKind.BROADCAST.value] == {"calls": 1, "bytes_sent": (n - 1) * 16 // n}

    def test_rejects_mismatched_sizes(self) -> None:
        """A wrongly sized output raises ValueError naming the sizes, instead of hanging or corrupting."""
        comm = self.backend_class(None, timeout=timedelta(seconds=5))
        try:
            comm.all_gather(torch.empty(5), torch.empty(3))
        except ValueError as err:
            assert "5" in str(err) and "3" in str(err)
        else:
            raise AssertionError("all_gather accepted an output of the wrong size")


# -- chunks -------------------------------------------------------------------------


def _chunk_roundtrip_worker() -> list[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    from zero_core.interfaces._plugins import ZeroPlugins

    comm = ZeroPlugins.load().comm_backends.get("torch")(dist.group.WORLD, timeout=timedelta(seconds=60))
    chunks = _chunks(comm.world_size, comm.rank)
    expected = {s.name: s.param.detach().clone() for c in chunks for s in c.slots}
    out = []
    for chunk in chunks:
        chunk.pack(sync=functools.partial(broadcast_from_rank0, comm=comm))
        assert chunk.state is ChunkState.SHARDED or chunk.persistent
        assert chunk.shard.numel() == chunk.shard_size
        gather_chunk(chunk, comm)
        for slot in chunk.slots:
            assert torch.equal(slot.param.detach(), expected[slot.name]), slot.name
            out.append((slot.name, slot.param.detach().clone()))
        chunk.release()
    return out


class ChunkConformance:
    """Tests for the :class:`~zero_core.plugin.Chunk` contract (state transitions and exact bytes)."""

    chunk_class: ClassVar[type[Chunk]] = Chunk

    def test_pack_gather_release_round_trips_values(self) -> None:
        """Gathering after packing restores every parameter bit for bit, at 1 and 2 ranks."""
        for world in (1, 2):
            results = run_distributed(_chunk_roundtrip_worker, world, timeout=120)
            for other in results[1:]:  # every rank sees the same whole parameters
                assert [n for n, _ in other] == [n for n, _ in results[0]]
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other, results[0]))

    def test_released_storage_is_freed(self) -> None:
        """A sharded chunk holds no full buffer and its parameters are empty, so a stray access fails loudly."""
        params = tuple(_params("odd_sizes"))
        used = sum(p.numel for p in params)
        chunk = self.chunk_class(0, ChunkSpec(params, used + (-used) % 2), rank=0, world_size=2, device=torch.device("cpu"))
        chunk.pack()  # no collective without sync
        assert chunk.state is ChunkState.SHARDED
        assert chunk.full.untyped_storage().nbytes() == 0
        assert chunk.shard.numel() == chunk.size // 2
        assert all(p.param.numel() == 0 for p in params)
        try:
            torch.nn.functional.linear(torch.ones(1, 6), params[0].param)
        except RuntimeError:
            pass  # the expected loud failure: a sharded parameter never reads freed memory
        else:
            raise AssertionError("using a released parameter did not fail")

    def test_sizes_and_padding_are_exact(self) -> None:
        """Shard size is size / world; padding is size - used; bytes follow from the dtype."""
        for world in (1, 2, 4):
            for chunk in _chunks(world_size=world):
                assert chunk.size % world == 0
                assert chunk.shard_size * world == chunk.size
                assert chunk.padding == chunk.size - sum(s.numel for s in chunk.slots)
                assert chunk.shard_bytes == chunk.shard_size * 4
                assert chunk.tier is MemoryTier.DEVICE


# -- shard strategies -----------------------------------------------------------------


class ShardStrategyConformance:
    """Tests for a :class:`~zero_core.plugin.ShardStrategy`; set ``strategy_class`` (and ``config``, ``world_sizes`` if needed).

    Plans are made for every zoo model at each of ``world_sizes`` ranks, once without a
    topology (one 1-D mesh) and once for each of several user topologies: 1-D, every
    ``(replicate, shard)`` layout, ranks in a non-default order, and a per-module mesh.
    A strategy whose ``plan`` takes no ``topology`` argument is planned for the 1-D mesh
    only, without one, as :func:`zero_core.shard` does (it refuses other meshes for it).
    Strategies that read the environment (for example a shard group size) set it in a
    fixture of their test module.
    """

    strategy_class: ClassVar[type[ShardStrategy]]
    config: ClassVar[ZeroConfig] = ZeroConfig(chunk=ChunkPolicy(chunk_size=128))
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4)

    def test_plan_covers_every_parameter_once(self) -> None:
        """ShardPlan.validate names the first broken invariant (missing, duplicated, mixed or misaligned)."""
        for case in ZOO:
            params = _params(case)
            for world in self.world_sizes:
                plan = self.strategy_class().plan(params, world_size=world, config=self.config)
                plan.validate(params, world)
                assert plan.numel == sum(p.numel for p in params)

    def test_plan_is_deterministic(self) -> None:
        """Every rank computes the plan on its own; the same input must give the same plan (chunks, gather groups
        and chunk plans), with or without a topology."""
        params = _params("gpt")
        world = max(self.world_sizes)
        for topology in (None, *_topologies(world, params, meshes=_accepts_topology(self.strategy_class))):
            a, b = (_plan(self.strategy_class(), params, self.config, world, topology) for _ in range(2))
            assert [(tuple(p.name for p in c.params), c.size) for c in a.chunks] == [
                (tuple(p.name for p in c.params), c.size) for c in b.chunks
            ], topology
            assert a.gather_groups == b.gather_groups, topology
            assert a.chunk_plans == b.chunk_plans, topology

    def test_chunk_plans_fit_their_meshes(self) -> None:
        """Without a topology, any chunk plans the strategy returns are one zero_core.plugin.ChunkPlan per chunk, each chunk's
        size divides by its mesh's shard size, and every mesh spans exactly ranks 0 .. world_size - 1.
        A failure usually means chunk sizes were rounded to world_size instead of the chunk's own shard group."""
        for case in ZOO:
            params = _params(case)
            for world in self.world_sizes:
                plan = self.strategy_class().plan(params, world_size=world, config=self.config)
                _check_chunk_plans(plan, tuple(range(world)), f"{case}, {world} ranks, no topology")

    def test_plans_for_every_topology(self) -> None:
        """For 1-D and 2-D user meshes (and a per-module mesh), the plan passes ShardPlan.validate with the topology,
        covers every parameter once, and its chunk plans fit their meshes and span every data-parallel rank.
        A failure usually means a mesh was built over a subset of the ranks (every rank computes every
        module), or that world_size was taken as the number of ranks rather than the default mesh's shard size."""
        for case in ZOO:
            params = _params(case)
            for world in self.world_sizes:
                for topology in _topologies(world, params, meshes=_accepts_topology(self.strategy_class)):
                    where = f"{case}, {topology}"
                    plan = _plan(self.strategy_class(), params, self.config, world, topology)
                    try:
                        plan.validate(params, topology.default.shard_ranks, topology)
                    except ValueError as err:
                        raise AssertionError(f"{where}: {err}") from None
                    assert plan.numel == sum(p.numel for p in params), where
                    assert plan.chunk_plans is not None or not topology.modules, (
                        f"{where}: no chunk_plans for a topology with module meshes; shard() refuses such a plan, "
                        "since without them every chunk would go on the default mesh"
                    )
                    _check_chunk_plans(plan, topology.default.ranks, where)


def _accepts_topology(strategy: ShardStrategy | type[ShardStrategy]) -> bool:
    """Whether ``plan`` takes ``topology`` (as ``zero_core.shard`` decides: it passes a topology only then, and
    refuses 2-D and per-module meshes for a strategy that does not take one)."""
    return "topology" in inspect.signature(strategy.plan).parameters


def _plan(strategy: ShardStrategy, params: list[ParamInfo], config: ZeroConfig, world: int,
          topology: Topology | None) -> ShardPlan:
    """The strategy's plan for ``topology`` (``None``: a 1-D mesh of ``world`` ranks), called as the runtime calls it:
    ``world_size`` is the default mesh's shard group size; ``topology`` only for a strategy that takes it."""
    if topology is None:
        return strategy.plan(params, world_size=world, config=config)
    if _accepts_topology(strategy):
        return strategy.plan(params, world_size=topology.default.shard_ranks, config=config, topology=topology)
    assert topology.default.ndim == 1 and not topology.modules, "shard() gives no other topology to such a strategy"
    return strategy.plan(params, world_size=topology.default.shard_ranks, config=config)


def _topologies(world: int, params: list[ParamInfo] | None = None, *, meshes: bool = True) -> list[Topology]:
    """The user topologies a strategy must handle at ``world`` ranks: the 1-D mesh; with ``meshes`` (a strategy
    whose plan takes a topology) also every (replicate, shard) layout, a 2-D layout with ranks out of order,
    and (with ``params``) a 2-D mesh for one module only."""
    default = MeshSpec.of_shape((world,))
    out = [Topology.of(default)]
    if not meshes:
        return out
    out += [Topology.of(MeshSpec.of_shape((r, world // r))) for r in range(1, world + 1) if world % r == 0]
    if world >= 4 and world % 2 == 0:
        strided = tuple(range(0, world, 2)) + tuple(range(1, world, 2))
        out.append(Topology.of(MeshSpec((2, world // 2), strided)))
        owner = params[0].name.rpartition(".")[0] if params else ""
        if owner:
            out.append(Topology.of(default, {owner: MeshSpec((2, world // 2), strided)}))
    return out


def _check_chunk_plans(plan: ShardPlan, ranks: tuple[int, ...], where: str) -> None:
    if plan.chunk_plans is None:
        return
    assert len(plan.chunk_plans) == len(plan.chunks), (
        f"{where}: {len(plan.chunks)} chunks but {len(plan.chunk_plans)} chunk plans; give every chunk a ChunkPlan"
    )
    for i, (spec, cp) in enumerate(zip(plan.chunks, plan.chunk_plans)):
        assert isinstance(cp, ChunkPlan), f"{where}: chunk plan {i} is a {type(cp).__name__}, not a zero_core.plugin.ChunkPlan"
        assert spec.size % cp.mesh.shard_ranks == 0, (
            f"{where}: chunk {i} has size {spec.size}, not a multiple of its mesh's shard size {cp.mesh.shard_ranks} ({cp.mesh})"
        )
        assert sorted(cp.mesh.ranks) == sorted(ranks), (
            f"{where}: chunk {i} is planned on {cp.mesh}, which does not span every data-parallel rank {sorted(ranks)}"
        )


# -- placement policies ----------------------------------------------------------------


class _Registers:
    """A plugin object that registers one placement policy class under its name."""

    def __init__(self, policy_class: type[PlacementPolicy]) -> None:
        self.policy_class = policy_class

    @hookimpl
    def zero_register_placement_policies(self, registry: Any) -> None:
        if self.policy_class.name not in registry:
            registry.add(self.policy_class.name, self.policy_class)


def _policy_worker(policy_class: type[PlacementPolicy], options: dict[str, Any], stage: int) -> dict[str, Any]:
    from zero_core.testing.parity import train_sharded

    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300), placement=policy_class.name, placement_options=options)
    result = train_sharded("gpt", config=config, plugins=[_Registers(policy_class)])
    return {"losses": result.losses, "params": result.params}


class PlacementPolicyConformance:
    """Tests for a :class:`~zero_core.plugin.PlacementPolicy`; set ``policy_class`` (and ``options``, its placement_options).

    The policy must train exactly like the ``device`` policy (single process and 2 ranks,
    stages 1 and 3), report every chunk's tier consistently, and leave every shard it is
    asked to gather readable on the compute device's side (not the disk stand-in).
    """

    policy_class: ClassVar[type[PlacementPolicy]]
    options: ClassVar[dict[str, Any]] = {}

    def test_has_a_name(self) -> None:
        """Users select the policy by this name; it must be a non-empty string."""
        assert isinstance(self.policy_class.name, str) and self.policy_class.name

    def test_builds_from_its_options(self) -> None:
        """from_config turns ZeroConfig.placement_options into a policy instance."""
        config = ZeroConfig(placement=self.policy_class.name, placement_options=self.options)
        assert isinstance(self.policy_class.from_config(config), self.policy_class)

    def test_trains_like_the_device_policy(self) -> None:
        """Losses and parameters equal one-process training, on 1 and 2 ranks, stages 1 and 3 (fp32: 1e-5 relative)."""
        from zero_core.testing.parity import assert_parity, train_reference

        reference = train_reference("gpt")
        for stage, world in ((3, 1), (3, 2), (1, 2)):
            results = run_distributed(_policy_worker, world, self.policy_class, dict(self.options), stage, timeout=300)
            for result in results:
                assert_parity(reference, _as_result(result), label=f"{self.policy_class.name} stage {stage} world {world}")

    def test_checkpoints_round_trip(self, tmp_path: Any) -> None:
        """A checkpoint saved under the policy resumes under it bitwise (2 ranks), and one saved under the
        ``device`` policy loads into it (loading writes shards through before_load/after_load)."""
        import torch

        from zero_core.testing.checkpointing import phase
        from zero_core.testing.distributed import device_under_test

        plugins = [_Registers(self.policy_class)]
        ours = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement=self.policy_class.name,
                          placement_options=self.options)
        device = ZeroConfig(chunk=ChunkPolicy(chunk_size=300))
        for saving, name in ((ours, "ours"), (device, "device")):
            directory = str(tmp_path / name)
            # saves after 2 steps and trains 2 more: the uninterrupted reference
            reference = run_distributed(phase, 2, "gpt", saving, directory, mode="save", k=2, j=2,
                                        plugins=plugins, timeout=300)[0]
            resumed = run_distributed(phase, 2, "gpt", ours, directory, mode="load", k=2, j=2, plugins=plugins,
                                      timeout=300)[0]
            if name == "device" and device_under_test() == "cuda":
                # saved stepping on the GPU, resumed stepping where the policy puts the states (the host's Adam
                # rounds otherwise than the GPU's): close, not bitwise; on the CPU host and device are one
                for got, want in zip(resumed["losses"], reference["losses"][2:], strict=True):
                    assert abs(got - want) <= 1e-5 * abs(want), (name, resumed["losses"], reference["losses"])
                for param, value in reference["params"].items():
                    err = ((resumed["params"][param] - value).abs().max() / value.abs().max().clamp_min(1e-12)).item()
                    assert err <= 1e-5, (name, param, err)
                continue
            assert resumed["losses"] == reference["losses"][2:], (name, resumed["losses"], reference["losses"])
            for param, value in reference["params"].items():
                assert torch.equal(resumed["params"][param], value), (name, param)

    def test_hooks_keep_the_contract(self) -> None:
        """Every hook sees chunks whose tier agrees with tier_of; gathered chunks have their shard in memory."""
        results = run_distributed(_contract_worker, 2, self.policy_class, dict(self.options), timeout=300)  # stage 3: gathers
        violations = results[0] + results[1]
        assert not violations, "\n".join(violations[:10])


def _as_result(result: dict[str, Any]) -> Any:
    from zero_core.testing.parity import RunResult

    return RunResult(losses=result["losses"], params=result["params"])


def _contract_worker(policy_class: type[PlacementPolicy], options: dict[str, Any]) -> list[str]:
    from zero_core.testing.parity import train_sharded

    violations: list[str] = []

    class Checked(policy_class):  # type: ignore[misc, valid-type]
        def _check(self, where: str, chunks: Any) -> None:
            for chunk in chunks:
                if self.tier_of(chunk) is not chunk.tier:
                    violations.append(f"{where}: tier_of(chunk {chunk.index}) is {self.tier_of(chunk)} but chunk.tier is {chunk.tier}")

        def before_gather(self, chunks: Any) -> None:
            super().before_gather(chunks)
            self._check("before_gather", chunks)
            for chunk in chunks:
                if not chunk.shard_in_memory:
                    violations.append(f"before_gather left chunk {chunk.index}'s shard out of memory")

        def after_release(self, chunks: Any) -> None:
            super().after_release(chunks)
            self._check("after_release", chunks)

        def after_step(self, chunks: Any) -> None:
            super().after_step(chunks)
            self._check("after_step", chunks)

    # its own name: the policy itself may be registered too (through its entry point)
    Checked.name = f"{policy_class.name}-checked"
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300), placement=Checked.name, placement_options=options)
    train_sharded("gpt", config=config, plugins=[_Registers(Checked)])
    return violations
