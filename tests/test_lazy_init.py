"""Lazy initialisation: same values as eager construction, shard by shard, with bounded setup memory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_offload import TENSOR_GEMINI_DEVICE

from zero_core import ChunkPolicy, ZeroConfig, ZeroSetupError, lazy_init, shard
from zero_core.testing import run_distributed
from zero_core.testing.checkpointing import build, train_steps
from zero_core.testing.gpt import GPT, GPTConfig
from zero_core.testing.parity import make_optimizer
from zero_core.testing.zoo import get_case

_orthogonal_bound_at_import = torch.nn.init.orthogonal_  # as `from torch.nn.init import orthogonal_` would bind it


def _lazy_vs_eager(case_name, config, steps=2, optimizer="adamw"):
    case = get_case(case_name)
    results = {}
    for lazy in (False, True):
        model, opt = build(case, config, lazy=lazy, optimizer=optimizer)
        after_setup = torch.rand(4)  # where the random generator is once the model exists
        params = model.full_parameters()
        buffers = {n: b.detach().clone() for n, b in model.module.named_buffers()}
        losses = train_steps(model, opt, case, 0, steps)
        results[lazy] = (params, buffers, losses, model.full_parameters(), after_setup)
        model.close()
    (p0, b0, l0, t0, r0), (p1, b1, l1, t1, r1) = results[False], results[True]
    return {
        "params": sorted(p0) == sorted(p1) and all(torch.equal(p0[n], p1[n]) for n in p0),
        "buffers": sorted(b0) == sorted(b1) and all(torch.equal(b0[n], b1[n]) for n in b0),
        "losses": l0 == l1,
        "trained": all(torch.equal(t0[n], t1[n]) for n in t0),
        "rng": torch.equal(r0, r1),
    }


@pytest.mark.parametrize(("world", "stage"), [(1, 3), (2, 3), (4, 3), (2, 1)])
def test_lazy_equals_eager_bitwise(world, stage):
    config = ZeroConfig(stage=stage, chunk=ChunkPolicy(chunk_size=300))
    for rank_result in run_distributed(_lazy_vs_eager, world, "gpt", config):
        assert rank_result == {"params": True, "buffers": True, "losses": True, "trained": True, "rng": True}


@pytest.mark.parametrize("case", ["frozen", "unused", "buffers", "gpt_checkpointed"])
def test_lazy_equals_eager_for_the_zoo(case):
    chunk = get_case(case).chunk_size or 64
    config = ZeroConfig(stage=2 if case == "buffers" else 3, chunk=ChunkPolicy(chunk_size=chunk))
    for rank_result in run_distributed(_lazy_vs_eager, 2, case, config):
        assert all(rank_result.values()), rank_result


@pytest.mark.parametrize(("strategy", "placement", "options"), [
    ("tensor", "device", {}),
    ("chunk", "host", {}),
    ("chunk", "static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}),
    # 0.208 MiB needed, the reduce-scatter buckets included (tests/test_offload.py: TENSOR_GEMINI_DEVICE)
    ("tensor", "gemini", {"device_budget_mb": TENSOR_GEMINI_DEVICE, "margin_ratio": 0.5}),
])
def test_lazy_with_every_strategy_and_policy(strategy, placement, options):
    config = ZeroConfig(strategy=strategy, chunk=ChunkPolicy(chunk_size=300), placement=placement,
                        placement_options=options)
    for rank_result in run_distributed(_lazy_vs_eager, 2, "gpt", config):
        assert all(rank_result.values()), rank_result


def test_lazy_with_first_use_order():
    case = get_case("gpt")
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=300, param_order="first_use"))
    torch.manual_seed(0)
    eager = case.build()
    torch.manual_seed(0)
    with lazy_init():
        lazy = case.build()
    example = case.batch(0, 2)[0]
    a, _ = shard(eager, make_optimizer(case, eager), config=config, example_inputs=example)
    b, _ = shard(lazy, make_optimizer(case, lazy), config=config, example_inputs=example)
    assert [s.name for c in a.engine.chunks for s in c.slots] == [s.name for c in b.engine.chunks for s in c.slots]
    pa, pb = a.full_parameters(), b.full_parameters()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    a.close()
    b.close()


def _ranks_seeded_apart(config):
    """Each rank seeds differently; like eager construction with sync_module_states, rank 0's values win."""
    case = get_case("gpt")
    model, _ = build(case, config, lazy=True, seed=100 + dist.get_rank())
    params = model.full_parameters()
    model.close()
    torch.manual_seed(100)
    reference = dict(case.build().named_parameters())
    return all(torch.equal(params[n], reference[n].detach()) for n in params)


def test_lazy_init_takes_rank0_values_when_ranks_seed_differently():
    assert run_distributed(_ranks_seeded_apart, 2, ZeroConfig(chunk=ChunkPolicy(chunk_size=300))) == [True, True]


def test_constants_and_explicit_initialisers_replay():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.emb = torch.nn.Embedding(10, 8, padding_idx=0)
            self.register_buffer("scale", torch.tensor([0.5, 2.0]))
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
            torch.nn.init.orthogonal_(self.lin.weight)
            torch.nn.init.trunc_normal_(self.emb.weight, std=0.1)
            with torch.no_grad():
                self.lin.bias.copy_(torch.arange(8.0))

    torch.manual_seed(1)
    eager = Model()
    torch.manual_seed(1)
    with lazy_init():
        lazy = Model()
    model, _ = shard(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1), config=ZeroConfig(chunk=ChunkPolicy(chunk_size=64)))
    params = model.full_parameters()
    for name, value in eager.named_parameters():
        assert torch.equal(params[name], value.detach()), name
    assert torch.equal(model.module.scale, eager.scale) and torch.equal(model.module.mask, eager.mask)
    model.close()


def test_bad_lazy_setups_are_refused():
    with lazy_init():
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2))
    with pytest.raises(ZeroSetupError, match="eagerly on the meta parameters"):
        shard(model, torch.optim.Adagrad(model.parameters()))
    with pytest.raises(ZeroSetupError, match="some parameters are on the meta device and some are not"):
        model.ln_f.weight = torch.nn.Parameter(torch.ones(16))
        shard(model, torch.optim.AdamW(model.parameters()))
    with torch.device("meta"):
        stray = torch.nn.Linear(4, 4)
    with pytest.raises(ZeroSetupError, match="not built under zero_core.lazy_init"):
        shard(stray, torch.optim.AdamW(stray.parameters()))


def _setup_peak(lazy, chunk_size):
    """Peak RSS growth of building and sharding a 55M-parameter GPT, with freed memory returned to the OS."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large blocks are unmapped when freed

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    small = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2)
    with lazy_init():  # torch imports its meta kernels on first use (~80 MiB of code, once per process)
        GPT(small)
    GPT(small)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    baseline = status("VmRSS:")
    cfg = GPTConfig(vocab_size=8192, seq_len=64, d_model=512, n_layer=16, n_head=8)
    torch.manual_seed(0)
    if lazy:
        with lazy_init():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    # release_host_memory=False: this test sets malloc itself (a lower threshold than shard()'s)
    model, opt = shard(model, torch.optim.AdamW(model.parameters()),
                       config=ZeroConfig(chunk=ChunkPolicy(chunk_size=chunk_size), release_host_memory=False))
    peak = status("VmHWM:") - baseline
    largest = max(c.size for c in model.engine.chunks) * 4
    shards = sum(c.shard_size for c in model.engine.chunks) * 4  # this rank's share, chunk padding included
    model.close()
    return {"peak": peak, "model": numel * 4, "largest_chunk": largest, "shards": shards}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lazy_setup_peak_memory_is_the_share_plus_one_chunk(world):
    """At one rank the shards are the whole model (kept gathered); from two ranks on, a share of it."""
    lazy = run_distributed(_setup_peak, world, True, None)
    eager = run_distributed(_setup_peak, world, False, None)
    for rank in range(world):
        # this rank's shards, the largest parameter while it is initialised (at most one chunk), and 32 MiB of
        # allocator and bookkeeping slack (about 8 MiB measured, more in a fresh virtual environment)
        bound = lazy[rank]["shards"] + lazy[rank]["largest_chunk"] + 32 * 2**20
        assert lazy[rank]["peak"] <= bound, (lazy[rank], bound)
        if world > 1:
            assert bound < lazy[rank]["model"]  # the bound is below what eager construction holds
        assert eager[rank]["peak"] >= eager[rank]["model"]  # eager construction holds the whole model


def test_an_initialiser_lazy_init_cannot_see_is_reported():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, bias=False)
            _orthogonal_bound_at_import(self.lin.weight)  # returns at once for a meta tensor, unrecorded

    with lazy_init():
        model = Model()
    # the Linear's own kaiming init is seen, so the weight was written: no warning here ...
    sharded, _ = shard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sharded.close()
    with lazy_init():
        weight = torch.nn.Parameter(torch.empty(4, 4))
        _orthogonal_bound_at_import(weight)
        bare = torch.nn.Module()
        bare.weight = weight
    # ... but a parameter whose only initialiser went unseen holds nothing, and that is said
    with pytest.warns(UserWarning, match="allocated but never written"):
        sharded, _ = shard(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    sharded.close()


def test_the_recording_is_dropped_once_every_model_built_under_it_is_sharded():
    from zero_core.setup import _lazy

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2)
    with lazy_init() as recording:
        first, second = GPT(cfg), GPT(cfg)
    a, _ = shard(first, torch.optim.AdamW(first.parameters()))
    assert recording in _lazy._RECORDINGS  # the second model still needs it
    b, _ = shard(second, torch.optim.AdamW(second.parameters()))
    assert recording not in _lazy._RECORDINGS and not recording.ops
    pa, pb = a.full_parameters(), b.full_parameters()
    assert any(not torch.equal(pa[n], pb[n]) for n in pa)  # two models, drawn one after the other
    a.close()
    b.close()


def test_several_lazy_models_and_draws_in_between_follow_eager_order():
    """Two models built lazily one after the other, with a random draw between, then sharded: all as eager."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=1, n_head=2)
    torch.manual_seed(5)
    eager_a, between, eager_b = GPT(cfg), torch.rand(3), GPT(cfg)
    after = torch.rand(3)
    torch.manual_seed(5)
    with lazy_init():
        lazy_a = GPT(cfg)
    lazy_between = torch.rand(3)
    with lazy_init():
        lazy_b = GPT(cfg)
    a, _ = shard(lazy_a, torch.optim.AdamW(lazy_a.parameters()))
    b, _ = shard(lazy_b, torch.optim.AdamW(lazy_b.parameters()))
    assert torch.equal(lazy_between, between) and torch.equal(torch.rand(3), after)
    for sharded, eager in ((a, eager_a), (b, eager_b)):
        params = sharded.full_parameters()
        for name, value in eager.named_parameters():
            assert torch.equal(params[name], value.detach()), name
        sharded.close()


def test_parameter_attributes_survive_lazy_materialisation():
    with lazy_init():
        model = torch.nn.Linear(4, 4)
        model.bias.no_decay = True
    sharded, _ = shard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.bias.no_decay is True and isinstance(model.bias, torch.nn.Parameter)
    sharded.close()
