"""zero_bench.host_memory: host bytes kept per parameter (issue 48, item 4), exact on the CPU.

fp32 AdamW keeps 12 bytes per parameter (the parameter and two moments), and 16 while it keeps its gradients
(``zero_grad(set_to_none=False)``); gemini streaming every chunk from the host keeps its master
shards and the moments: 12 again, the same bytes its own accounting (``model_state_bytes``) reports, also built
lazily with bf16 compute as the GPU report's capacity section builds it.
"""

import torch

from zero_bench.host_memory import host_growth
from zero_core import ChunkPolicy, Precision, ZeroConfig, lazy_init, shard

IN, HIDDEN = 64, 256


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, IN))


PARAMS = sum(p.numel() for p in _mlp().parameters())  # 33,088: one chunk of that size holds them without padding


def test_plain_adamw_with_its_gradients_kept_holds_16_bytes_per_parameter():
    inputs = torch.randn(8, IN)
    with host_growth() as grown:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(inputs).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay: 4 bytes per parameter more
    assert grown.tensor_bytes == 16 * PARAMS
    row = grown.per_param(PARAMS)
    assert row["host_B_per_param"] == 16
    assert row["host_rss_B_per_param"] is not None  # Linux: the resident set's growth is read from /proc
    with host_growth() as dropped:
        opt.zero_grad(set_to_none=True)  # the window sees storages it did not make go: never below zero, not counted
    assert dropped.tensor_bytes == 0


def test_gemini_streaming_from_the_host_keeps_12_bytes_per_parameter():
    inputs = torch.randn(8, IN)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=PARAMS), placement="gemini",
                        placement_options={"device_budget_mb": 8})
    with host_growth() as grown:
        model = _mlp()
        model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
        model(inputs).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    states = model.model_state_bytes()
    # the chunk's full buffer, freed in place after the backward, holds nothing: only the shard and the moments count
    assert grown.tensor_bytes == states["params"] + states["optimizer_states"] == 12 * PARAMS
    assert grown.per_param(PARAMS)["host_B_per_param"] == 12
    model.close()


def test_gemini_built_lazily_with_bf16_compute_keeps_12_bytes_per_parameter():
    """As the capacity section builds it (issue 48, item 4): lazily, bf16 compute, fp32 master; exact bytes."""
    inputs = torch.randn(8, IN)
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=PARAMS), precision=Precision(compute="bf16"), placement="gemini",
                        placement_options={"device_budget_mb": 8})
    with host_growth() as grown:
        with lazy_init():  # shard() fills the shard by replaying the initialisers: no full copy of the model first
            model = _mlp()
        model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
        model.backward(model(inputs).float().square().mean())
        opt.step()
        opt.zero_grad(set_to_none=True)
    states = model.model_state_bytes()
    assert grown.tensor_bytes == states["params"] + states["optimizer_states"] == 12 * PARAMS
    assert grown.per_param(PARAMS)["host_B_per_param"] == 12
    model.close()


def test_a_budget_below_gemini_s_plan_is_refused_at_planning_in_the_capacity_section(tmp_path):
    """The capacity section tells a refusal at planning (zero's DeviceBudgetError) from a failure later."""
    from zero_bench.gpu import capacity

    system = next(s for s in capacity.SYSTEMS if s.name == "zero-gemini")
    env = capacity.Env(device=torch.device("cpu"), dry_run=True, budget_gib=2**-14, shape=capacity.DRY_SHAPE, batch=2,
                       host_cap=1 << 30, disk_dir=str(tmp_path), disk_budget=0)
    attempt = capacity._attempt(system, env, 1)
    assert attempt.status == capacity.REFUSED and "DeviceBudgetError" in attempt.detail, attempt
    assert capacity.refused_at_planning(RuntimeError("wrapped")) is False
