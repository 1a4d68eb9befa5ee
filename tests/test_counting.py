"""Exact, deterministic counts: collectives per step, bytes sent, model-state bytes per rank.

Formulas (peers.md section 4, Adam): ZeRO-3 sends (N-1)/N * Psi * (2*b_p + b_g) bytes
per rank per step (two all-gathers, one reduce-scatter); stages 1 and 2 send
(N-1)/N * Psi * (b_g + b_p) (a reduce-scatter, and the all-gather of the updated
parameters), which in fp32 is exactly DDP's ring all-reduce. Psi is counted over the
padded chunks; padding carries parameter and gradient bytes but no optimizer state.
Every installed strategy is counted the same way from its chunks and gather groups
(tensor-wise ZeRO-3: a chunk per parameter, a gather group per module), with the
``torch`` comm backend: one reduce-scatter per chunk, one all-gather per group.
Bucketed reduce-scatters have tests of their own at the end.

Every count is read from the same runs: one spawned world per strategy and world size trains each
configuration the tests count (every stage and precision, the bucket sizes, frozen parameters, the static
graph promise) in turn, three steps each, and the tests share the results (``counted``). The counts are per
engine, so a configuration trained after another in the same process group counts exactly what it would alone.

Model-state bytes per rank (fp32 | 16-bit compute with fp32 masters):
stage 1: 8Psi + 8Psi/N | 4Psi + 16Psi/N; stage 2: 4Psi + 12Psi/N | 2Psi + 16Psi/N;
stage 3: 16Psi/N | 16Psi/N. The 16-bit figures exceed the paper's 4Psi + 12Psi/N and
2Psi + 14Psi/N because the fp32 masters' gradients are fp32 shards (4Psi/N) where the
paper keeps 16-bit ones; the paper's count has no gradient for the masters in stage 1.
"""

import pytest
from _shared_worlds import SharedWorlds

from zero_comm import BucketedCommBackend
from zero_core import ChunkPolicy, LossScale, Precision, ZeroConfig
from zero_core.plugin import CollectiveKind, ZeroPlugins, ring_bytes_sent
from zero_core.testing import run_distributed, train_sharded

PRECISIONS = {"fp32": Precision(), "bf16": Precision(compute="bf16")}
STRATEGIES = ZeroPlugins.load().strategies.names()


def gpt_config(strategy, stage=3, precision="fp32", **kwargs):
    kwargs.setdefault("comm_backend", "torch")
    return ZeroConfig(strategy=strategy, stage=stage, precision=PRECISIONS[precision], chunk=ChunkPolicy(chunk_size=300),
                      **kwargs)


STEPS = 3
BUCKETS = [(2, 0.0), (2, 2.0**-10), (2, 2.0**-8), (2, 25.0), (4, 2.0**-9)]  # (world, reduce_bucket_mb)


def plan(group):
    strategy, world = group
    runs = {("gpt", stage, precision): ("gpt", {"config": gpt_config(strategy, stage, precision)})
            for stage in (1, 2, 3) for precision in PRECISIONS}
    for bucket_world, bucket_mb in BUCKETS:
        if bucket_world == world:
            config = gpt_config(strategy, comm_backend="bucketed", reduce_bucket_mb=bucket_mb)
            runs[("bucketed", bucket_mb)] = ("gpt", {"config": config})
    if world == 2:
        runs[("frozen",)] = ("frozen", {"config": gpt_config(strategy).replace(chunk=ChunkPolicy(chunk_size=64))})
        runs[("static_graph",)] = ("gpt", {"config": gpt_config(strategy, static_graph=True)})
    return world, {key: (case, {**kwargs, "steps": STEPS}) for key, (case, kwargs) in runs.items()}


shared = SharedWorlds(plan)


def counted(strategy, world, *key):
    """The per-rank results of the run ``key`` names (default: stage 3 in fp32) for ``strategy`` on ``world`` ranks."""
    return shared((strategy, world), key or ("gpt", 3, "fp32"))


def padding_on_rank(chunk, rank, world):
    """Padding in ``rank``'s shard: each parameter's rows it does not own (torch.chunk pieces) and the chunk's tail."""
    return chunk["size"] // world - chunk["real"][rank]


# See [Note: lockstep rounds]: one MAX all-reduce of a tagged control message per communicating phase.
LOCKSTEP_BYTES = 2 * 8  # two int64 words: the tag and payload, the complemented tag
LOCKSTEP_ROUNDS_STAGES_1_2 = 2  # the backward, the optimizer step
LOCKSTEP_ROUNDS_STAGE_3 = 3  # and the forward, which gathers


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_sends_nothing(strategy):
    result = counted(strategy, 1)[0]
    assert result.step_stats == [{}] * STEPS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero3_collectives_and_bytes_per_step(strategy, world):
    results = counted(strategy, world)
    chunks = results[0].chunks
    n_chunks, n_groups, padded = len(chunks), len(results[0].groups), sum(c["size"] for c in chunks)
    assert all(c["requires_grad"] for c in chunks)
    for result in results:
        assert len(result.step_stats) == 3
        for step in result.step_stats:
            assert step["all_gather"]["calls"] == 2 * n_groups  # forward + backward, one per gather group
            assert step["reduce_scatter"]["calls"] == n_chunks
            assert step["all_gather"]["bytes_sent"] == 2 * (world - 1) * padded * 4 // world
            assert step["reduce_scatter"]["bytes_sent"] == (world - 1) * padded * 4 // world
            data = step["all_gather"]["bytes_sent"] + step["reduce_scatter"]["bytes_sent"]
            assert data == (world - 1) * padded * (2 * 4 + 4) // world  # the ZeRO-3 formula plus padding
            assert set(step) == {"all_gather", "reduce_scatter", "control"}
        # agreement rounds: at most one per gather plus a drain per pass and one gradient-presence exchange
        # (prefetched chunks need none), and three lockstep rounds (forward, backward, step); the same on every
        # rank. Two steps in, each pass's gather sequence has repeated, so the third step replays it: only the
        # drains (one per pass, which verify the replay), the gradient-presence exchange and the lockstep rounds.
        # See [Note: replaying a repeated gather sequence].
        first, second, third = result.step_stats
        assert first["control"] == second["control"] == results[0].step_stats[0]["control"]
        assert first["control"]["calls"] <= 2 * n_groups + 3 + LOCKSTEP_ROUNDS_STAGE_3
        assert third["control"] == results[0].step_stats[2]["control"]
        assert third["control"]["calls"] == 2 + 1 + LOCKSTEP_ROUNDS_STAGE_3
        assert result.replayed_passes == 2  # the third step's forward and backward


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_state_bytes_are_16_psi_over_n_plus_padding(strategy, world):
    results = counted(strategy, world)
    chunks = results[0].chunks
    psi = sum(c["used"] for c in chunks)
    padding = sum(c["size"] - c["used"] for c in chunks)
    total = 0
    for rank, result in enumerate(results):
        mem = result.model_state_bytes
        shard_elems = sum(c["size"] // world for c in chunks)
        pad = sum(padding_on_rank(c, rank, world) for c in chunks)
        assert mem["params"] == 4 * shard_elems
        if world == 1:  # autograd's own gradients, no buffer: no padding (see zero_core.chunks._chunk_grads,
            assert mem["grads"] == 4 * psi  # [Note: gradients handed over as autograd made them])
        else:
            assert mem["grads"] == 4 * shard_elems
        assert mem["optimizer_states"] == 8 * (shard_elems - pad)  # exp_avg and exp_avg_sq, no padding
        assert mem["gathered_buffers"] == 0
        total += mem["params"] + mem["grads"] + mem["optimizer_states"]
    assert total == 16 * psi + (4 if world == 1 else 8) * padding


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters_hold_no_gradient_or_optimizer_state(strategy):
    results = counted(strategy, 2, "frozen")
    chunks = results[0].chunks
    trainable = sum(c["size"] // 2 for c in chunks if c["requires_grad"])
    everything = sum(c["size"] // 2 for c in chunks)
    for result in results:
        assert result.model_state_bytes["params"] == 4 * everything
        assert result.model_state_bytes["grads"] == 4 * trainable
        assert sum(result.step_stats[-1]["reduce_scatter"].values()) > 0
        assert result.step_stats[-1]["reduce_scatter"]["calls"] == sum(c["requires_grad"] for c in chunks)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_graph_sends_no_control_traffic(strategy):
    results = counted(strategy, 2, "static_graph")
    assert all("control" not in step for step in results[0].step_stats)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stages_1_and_2_send_what_ddp_sends(strategy, stage, world, precision):
    results = counted(strategy, world, "gpt", stage, precision)
    chunks = results[0].chunks
    n_chunks, n_groups, padded = len(chunks), len(results[0].groups), sum(c["size"] for c in chunks)
    b_p, b_g = (4, 4) if precision == "fp32" else (2, 4)
    for result in results:
        for step in result.step_stats:
            assert step["reduce_scatter"] == {"calls": n_chunks, "bytes_sent": (world - 1) * padded * b_g // world}
            # the only all-gathers: updated parameters after the step; nothing is gathered in forward or backward
            assert step["all_gather"] == {"calls": n_groups, "bytes_sent": (world - 1) * padded * b_p // world}
            # which parameters got gradients, and the lockstep rounds of the backward and the step; no gather agreement
            assert step["control"]["calls"] == 1 + LOCKSTEP_ROUNDS_STAGES_1_2
            assert step["control"]["bytes_sent"] == (
                ring_bytes_sent(CollectiveKind.ALL_REDUCE, sum(c["params"] for c in chunks), world)
                + LOCKSTEP_ROUNDS_STAGES_1_2 * ring_bytes_sent(CollectiveKind.ALL_REDUCE, LOCKSTEP_BYTES, world))
            if precision == "fp32":  # the same volume as DDP's one ring all-reduce of fp32 gradients
                ddp = ring_bytes_sent(CollectiveKind.ALL_REDUCE, padded * 4, world)
                assert step["reduce_scatter"]["bytes_sent"] + step["all_gather"]["bytes_sent"] == ddp


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stage_3_in_bf16_gathers_16bit_and_reduces_fp32(strategy, world):
    results = counted(strategy, world, "gpt", 3, "bf16")
    chunks = results[0].chunks
    n_chunks, n_groups, padded = len(chunks), len(results[0].groups), sum(c["size"] for c in chunks)
    for step in results[0].step_stats:
        assert step["all_gather"] == {"calls": 2 * n_groups, "bytes_sent": 2 * (world - 1) * padded * 2 // world}
        assert step["reduce_scatter"] == {"calls": n_chunks, "bytes_sent": (world - 1) * padded * 4 // world}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_state_bytes_per_stage_and_precision(strategy, world, stage, precision):
    results = counted(strategy, world, "gpt", stage, precision)
    chunks = results[0].chunks
    full = sum(c["size"] for c in chunks)  # Psi plus padding
    shard = full // world  # Psi/N plus this rank's padding
    b = 4 if precision == "fp32" else 2
    kept_full = stage < 3 or world == 1
    # a chunk with a parameter cut along a later dimension (the tiny GPT's 37-row embedding over 2 ranks: see
    # [Note: shard dimension]) keeps its fp32 shards apart from its kept full buffers: its pieces are not ranges
    apart = sum(c["size"] for c in chunks if c["strided"]) // world
    # parameters: the kept full buffer in the compute dtype, plus the fp32 master shard unless it is a view of it
    params = (b * full if kept_full else 0) + (4 * apart if kept_full and b == 4 else 4 * shard)
    # gradients: stage 1 keeps a full compute-dtype buffer, whose own slice holds the fp32 mean when b == 4;
    # otherwise the masters' gradients are fp32 shards
    grads = (b * full if stage == 1 else 0) + (4 * apart if stage == 1 and b == 4 else 4 * shard)
    if world == 1 and stage != 1 and b == 4:  # autograd's own gradients, no buffer and no padding: see
        grads = 4 * sum(c["used"] for c in chunks)  # [Note: gradients handed over as autograd made them]
    for rank, result in enumerate(results):
        mem = result.model_state_bytes
        pad = sum(padding_on_rank(c, rank, world) for c in chunks)
        assert mem["params"] == params
        assert mem["grads"] == grads
        assert mem["optimizer_states"] == 8 * (shard - pad)
        assert mem["gathered_buffers"] == 0
    psi_over_n, psi = shard, full  # padding aside
    expected = {("fp32", 1): 8 * psi + 8 * psi_over_n, ("fp32", 2): 4 * psi + 12 * psi_over_n,
                ("fp32", 3): 16 * psi_over_n, ("bf16", 1): 4 * psi + 16 * psi_over_n,
                ("bf16", 2): 2 * psi + 16 * psi_over_n, ("bf16", 3): 16 * psi_over_n}
    if world > 1:  # one rank keeps the full buffer at every stage
        mem = results[0].model_state_bytes
        pad0 = sum(padding_on_rank(c, 0, world) for c in chunks)
        views = {("fp32", 1): 2, ("fp32", 2): 1}.get((precision, stage), 0)  # fp32 shards that would be views
        assert mem["params"] + mem["grads"] + mem["optimizer_states"] + 8 * pad0 == \
            expected[(precision, stage)] + 4 * views * apart


def test_fp16_checks_overflow_with_one_collective_per_step():
    precision = Precision(compute="fp16", loss_scale=LossScale(init_scale=2.0**10))
    config = ZeroConfig(stage=3, precision=precision, chunk=ChunkPolicy(chunk_size=300), static_graph=True)
    results = run_distributed(train_sharded, 2, "gpt", steps=3, config=config)
    for step in results[0].step_stats:  # static graph: no other control traffic, so this is the overflow flag
        assert step["control"] == {"calls": 1, "bytes_sent": ring_bytes_sent(CollectiveKind.ALL_REDUCE, 1, 2)}
    assert results[0].scales == [2.0**10] * 3


@pytest.mark.parametrize(("world", "bucket_mb"), BUCKETS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bucketed_reduce_scatters_follow_the_bucket_size(strategy, world, bucket_mb):
    config = gpt_config(strategy, comm_backend="bucketed", reduce_bucket_mb=bucket_mb)
    results = counted(strategy, world, "bucketed", bucket_mb)
    chunks = results[0].chunks
    # the engine reduces trainable chunks in reverse plan order; each sends its shard-sized slice per rank
    shard_sizes = [c["size"] // world for c in reversed(chunks) if c["requires_grad"]]
    # the backend's own statement of its bucket rule (what zero_core.estimate uses), checked against the wire
    expected = BucketedCommBackend.estimate_reduce_scatter_calls(shard_sizes, element_size=4, world_size=world, config=config)
    padded = sum(c["size"] for c in chunks)
    for result in results:
        for step in result.step_stats:
            assert step["reduce_scatter"] == {"calls": expected, "bytes_sent": (world - 1) * padded * 4 // world}
    if bucket_mb == 25.0:
        assert expected == 1  # the tiny model's gradients all share one bucket
    unbucketed = counted(strategy, world)
    assert results[0].losses == unbucketed[0].losses  # the same sums, in the same order: bit for bit
