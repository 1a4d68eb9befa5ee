"""Device meshes: HSDP (replicate x shard), a mesh per module, reshard_after_forward, checkpoints across mesh shapes.

Every run is 4 gloo ranks compared with one process on the whole batch: fp32 within 1e-5,
bf16 within 1e-3 of the 16-bit reference (see tests/test_parity.py for both tolerances).
Several configurations share one process group per test, so the file stays lean.
"""

from __future__ import annotations

import json

import pytest
import torch

from zero_core import ChunkPolicy, Precision, ZeroConfig
from zero_core.checkpoint._checkpoint import piece_runs
from zero_core.comm.backend import CollectiveKind, ring_bytes_sent
from zero_core.testing import assert_parity, device_under_test, rank_device, run_distributed, train_reference, train_sharded
from zero_core.testing.checkpointing import phase
from zero_core.testing.zoo import get_case

_references: dict = {}


def reference(case, precision="fp32"):
    key = (case, precision)
    if key not in _references:
        if precision == "fp32":
            _references[key] = train_reference(case)
        else:
            _references[key] = train_reference(case, precision=Precision(compute="bf16"), world=4)
    return _references[key]


def _config(case, **kwargs):
    return ZeroConfig(chunk=ChunkPolicy(chunk_size=get_case(case).chunk_size), **kwargs)


def _train_many(runs):
    """Several sharded runs, one after another, in one process group."""
    return [train_sharded(case, config=config, **kwargs) for case, config, kwargs in runs]


def _check(results, runs, precisions):
    for index, ((case, _, kwargs), precision) in enumerate(zip(runs, precisions)):
        tolerance = 1e-5 if precision == "fp32" else 1e-3
        per_rank = [r[index] for r in results]
        for rank, result in enumerate(per_rank):
            assert_parity(reference(case, precision), result, rtol=tolerance, label=f"{case} {kwargs} rank {rank}:")
        # every replica holds bit-identical shards after every step (the last one checked here)
        by_coordinates: dict = {}
        for result in per_rank:
            for chunk, (_shape, (_, shard_rank), digest) in enumerate(result.shards):
                by_coordinates.setdefault((chunk, shard_rank), set()).add(digest)
        assert all(len(d) == 1 for d in by_coordinates.values()), f"{case} {kwargs}: replicas differ"


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1)])
def test_hsdp_parity(shape):
    """A 2-D mesh (replicate, shard) trains like one process; 1x4 is full sharding, 4x1 plain data parallelism."""
    runs = [("gpt", _config("gpt"), {"mesh_shape": shape})]
    precisions = ["fp32"]
    if shape == (2, 2):
        runs += [("gpt", _config("gpt", stage=1), {"mesh_shape": shape}),
                 ("gpt", _config("gpt", stage=2), {"mesh_shape": shape}),
                 ("gpt", _config("gpt", strategy="tensor"), {"mesh_shape": shape}),
                 ("gpt", _config("gpt", precision=Precision(compute="bf16")), {"mesh_shape": shape})]
        precisions += ["fp32", "fp32", "fp32", "bf16"]
    results = run_distributed(_train_many, 4, runs)
    _check(results, runs, precisions)
    for result in results:
        assert {s[0] for s in result[0].shards} == {shape}
    stats = results[0][0].step_stats[-1]
    replicas = shape[0]
    assert ("all_reduce" in stats) == (replicas > 1)
    assert ("all_gather" in stats) == (shape[1] > 1)  # a shard group of one rank keeps every chunk whole


def test_module_meshes_put_experts_on_their_own_mesh():
    """MoE-style: experts chosen per sample (data-dependent, different per rank) sharded over pairs of ranks and
    replicated twice, the dense layers over all four; chunks never mix meshes."""
    runs = [("unused", _config("unused"), {"module_meshes": {"experts": (2, 2)}}),
            ("unused", _config("unused", strategy="tensor"), {"module_meshes": {"experts": (2, 2)}}),
            ("unused", _config("unused", stage=2), {"module_meshes": {"experts": (2, 2)}})]
    results = run_distributed(_train_many, 4, runs)
    _check(results, runs, ["fp32"] * len(runs))
    for result in results[0]:
        shapes = [s[0] for s in result.shards]
        assert set(shapes) == {(4,), (2, 2)}, shapes


def test_clip_grad_norm_over_module_meshes():
    """zero_core.clip_grad_norm_ sums each mesh's part once, and torch's own clip over model.parameters() gives the
    same (see [Note: torch's clip over several meshes]), at every stage, and with the tensor strategy."""
    meshes = {"module_meshes": {"experts": (2, 2)}, "clip": 0.05}
    runs = [("unused", _config("unused"), meshes),
            ("unused", _config("unused"), {**meshes, "clip_with": "torch"}),
            ("unused", _config("unused", stage=1), {**meshes, "clip_with": "torch"}),
            ("unused", _config("unused", stage=2), {**meshes, "clip_with": "torch"}),
            ("unused", _config("unused", strategy="tensor", stage=2), {**meshes, "clip_with": "torch"})]
    results = run_distributed(_train_many, 4, runs)
    expected = train_reference("unused", clip=0.05)
    assert expected.norms and max(expected.norms) > 0.05  # the clip bites
    for rank, result in enumerate(results):
        for run, (_, _, kwargs) in zip(result, runs):
            assert_parity(expected, run, label=f"{kwargs.get('clip_with', 'zero')} rank {rank}:")
            assert run.norms == pytest.approx(expected.norms, rel=1e-5)


def _reshard_runs():
    return [("gpt", _config("gpt", reshard_after_forward=True), {}),
            ("gpt", _config("gpt", reshard_after_forward=False), {}),
            ("gpt", _config("gpt", reshard_after_forward=2, static_graph=True), {}),
            ("gpt_checkpointed", _config("gpt_checkpointed", reshard_after_forward=2, static_graph=True), {}),
            ("unused", _config("unused", reshard_after_forward=False), {})]


def test_reshard_after_forward():
    """True gathers again in backward, False never does, 2 gathers inside pairs of ranks: exact all-gather bytes."""
    runs = _reshard_runs()
    results = run_distributed(_train_many, 4, runs)
    _check(results, runs, ["fp32"] * len(runs))
    always, never, pairs = (results[0][i] for i in range(3))
    steps = len(always.step_stats)
    full = sum(c["size"] for c in always.chunks) * 4  # fp32 bytes of every chunk, gathered
    forward = ring_bytes_sent(CollectiveKind.ALL_GATHER, full, 4)
    gathered = [s["all_gather"]["bytes_sent"] for s in always.step_stats]
    assert gathered == [2 * forward] * steps  # forward and backward
    assert [s["all_gather"]["bytes_sent"] for s in never.step_stats] == [forward] * steps
    inside_pairs = ring_bytes_sent(CollectiveKind.ALL_GATHER, full, 2)
    assert [s["all_gather"]["bytes_sent"] for s in pairs.step_stats] == [forward + inside_pairs] * steps


# -- counting at 2x2 ---------------------------------------------------------------------------------------


def counting_model() -> torch.nn.Module:
    """A model without padding at 4 ranks in chunks of 272: the formulas hold exactly."""
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))


def counting_worker(**options):
    """Three AdamW steps on a 2x2 mesh (ZeroConfig ``options``): model-state bytes and collectives per step; then a
    write to the parameters under ``no_grad`` and how far the next forward is from one on the written values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import zero_core

    torch.manual_seed(0)
    model = counting_model()
    psi = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device_under_test(), (2, 2), mesh_dim_names=("replicate", "shard"))
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=272), **options)
    model, opt = zero_core.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config, mesh=mesh)
    rank = dist.get_rank()
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(rank_device())
        model(x).square().mean().backward()
        opt.step()
    engine = model.engine
    chunks = [{"size": c.size, "shard": c.shard_size} for c in engine.chunks]
    result = {"psi": psi, "bytes": model.model_state_bytes(), "chunks": chunks,
              "steps": [engine.comm.stats.summary(s) for s in engine.comm.stats.steps]}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(99)).to(rank_device())
        want = torch.func.functional_call(counting_model(), model.full_parameters(), (x.cpu(),))  # CPU copies
        result["after_write"] = (model(x).cpu() - want).abs().max().item()
    model.close()
    return result


def test_counting_at_2x2():
    """All-gathers and reduce-scatters stay inside the shard group of 2; the only inter-replica traffic is one
    all-reduce of each chunk's shard-sized gradient per step; model states are 16 psi / S bytes per rank."""
    for result in run_distributed(counting_worker, 4):
        chunks, psi = result["chunks"], result["psi"]
        payload = sum(c["size"] for c in chunks) * 4
        for step in result["steps"]:
            assert step["all_gather"] == {"calls": 2 * len(chunks),
                                          "bytes_sent": 2 * ring_bytes_sent(CollectiveKind.ALL_GATHER, payload, 2)}
            assert step["reduce_scatter"] == {"calls": len(chunks),
                                              "bytes_sent": ring_bytes_sent(CollectiveKind.REDUCE_SCATTER, payload, 2)}
            shard_bytes = sum(c["shard"] for c in chunks) * 4
            assert step["all_reduce"] == {"calls": len(chunks),
                                          "bytes_sent": ring_bytes_sent(CollectiveKind.ALL_REDUCE, shard_bytes, 2)}
        state = result["bytes"]
        assert sum(c["size"] for c in chunks) == psi  # no padding: the formula holds exactly
        assert state["params"] + state["grads"] + state["optimizer_states"] == 16 * psi // 2
        assert result["after_write"] < 1e-6  # a write under no_grad reaches the next forward


# -- checkpoints across mesh shapes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    """One checkpoint saved on a 2x2 mesh and one on a 1-D mesh of 4, each with the uninterrupted run."""
    saved = {}
    for shape in [(2, 2), (4,)]:
        directory = tmp_path_factory.mktemp("mesh" + "x".join(map(str, shape)))
        reference = run_distributed(phase, 4, "gpt", _config("gpt"), str(directory), mode="save", k=2, j=2,
                                    mesh_shape=shape)[0]
        saved[shape] = (directory, reference)
    return saved


def assert_resumed(resumed, reference):
    for got, want in zip(resumed["losses"], reference["losses"][2:], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed["losses"], reference["losses"])
    for name, value in reference["params"].items():
        err = ((resumed["params"][name] - value).abs().max() / value.abs().max().clamp_min(1e-12)).item()
        assert err <= 1e-6, f"{name}: {err:.3g} relative"


@pytest.mark.parametrize(("saved", "world", "loaded"), [((2, 2), 4, (1, 4)), ((4,), 4, (2, 2)), ((2, 2), 1, None)])
def test_checkpoints_resume_at_another_mesh_shape(saved_checkpoints, saved, world, loaded):
    directory, reference = saved_checkpoints[saved]
    resumed = run_distributed(phase, world, "gpt", _config("gpt"), str(directory), mode="load", k=2, j=2,
                              mesh_shape=loaded)[0]
    assert_resumed(resumed, reference)


def checkpoint_writers(directory) -> set[int]:
    """The ranks that wrote parameter pieces into the checkpoint in ``directory``, after checking that the pieces
    cover every element of every parameter exactly once."""
    metadata = json.loads((directory / "zero_checkpoint.json").read_text())
    for name, info in metadata["params"].items():
        # a piece is one range, or several (a parameter cut along a later dimension): see piece_runs
        covered = sorted((lo, hi) for piece in info["pieces"] for _, lo, hi, _ in piece_runs(piece))
        total = 1
        for d in info["shape"]:
            total *= d
        assert sum(hi - lo for lo, hi in covered) == total, name
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), name
    return {piece[0] for info in metadata["params"].values() for piece in info["pieces"]}


def test_a_2x2_checkpoint_writes_each_shard_once(saved_checkpoints):
    directory, _ = saved_checkpoints[(2, 2)]
    assert checkpoint_writers(directory) == {0, 1}  # the first replica's two ranks; ranks 2 and 3 hold the same shards


# -- bad input ---------------------------------------------------------------------------------------------


def _bad_inputs():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import zero_core

    def attempt(build):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        try:
            build(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except zero_core.ZeroError as exc:
            return str(exc)
        return None

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    return {
        "both": attempt(lambda m, o: zero_core.shard(m, o, mesh=mesh, process_group=dist.group.WORLD)),
        "not_a_mesh": attempt(lambda m, o: zero_core.shard(m, o, mesh=(1, 2))),
        "unknown_module": attempt(lambda m, o: zero_core.shard(m, o, mesh=mesh, module_meshes={"experts": mesh})),
        "group_size": attempt(lambda m, o: zero_core.shard(m, o, config=ZeroConfig(reshard_after_forward=3))),
        "dynamic": attempt(lambda m, o: zero_core.shard(m, o, config=ZeroConfig(reshard_after_forward=2))),
    }


def test_bad_mesh_input_is_named():
    messages = run_distributed(_bad_inputs, 4)[0]
    assert "not both" in messages["both"]
    assert "DeviceMesh" in messages["not_a_mesh"]
    assert "'experts'" in messages["unknown_module"] and "named_modules" in messages["unknown_module"]
    assert "reshard_after_forward=3" in messages["group_size"] and "[2]" in messages["group_size"]
    assert "static_graph=True" in messages["dynamic"]
