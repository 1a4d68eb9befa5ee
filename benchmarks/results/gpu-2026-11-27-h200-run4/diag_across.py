"""Where does a (2,2) across-replicas run on CUDA leave one process? Forward-seen parameters and per-rank losses."""
import json
import torch
import torch.distributed as dist
from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_core._setup import resolve_device
from zero_core.testing import run_distributed, train_reference
from zero_core.testing.parity import _build, _device_mesh, make_optimizer
from zero_core.testing.zoo import get_case


def worker(variants):
    out = []
    case = get_case("gpt")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mesh_shape, across, strategy in variants:
        config = ZeroConfig(chunk=ChunkPolicy(chunk_size=case.chunk_size), strategy=strategy,
                            shard_optimizer_across_replicas=across)
        device = resolve_device(config)
        plain = _build(case).to(device)
        initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
        model = _build(case)
        model, opt = shard(model, make_optimizer(case, model, "adamw", 1e-3), config=config,
                           mesh=_device_mesh(mesh_shape) if mesh_shape else None)
        after_shard = {n: (v.to(device) - initial[n]).abs().max().item() for n, v in model.full_parameters().items()}
        seen = {}
        names = {id(m): n for n, m in model.named_modules()}

        def hook(module, args, output):
            for pn, p in module.named_parameters(recurse=False):
                full = names[id(module)] + ("." if names[id(module)] else "") + pn
                if full in initial and full not in seen:
                    seen[full] = (p.detach().to_local() if hasattr(p, "to_local") else p.detach()).reshape(initial[full].shape).sub(initial[full]).abs().max().item() \
                        if p.numel() == initial[full].numel() else f"numel {p.numel()} vs {initial[full].numel()}"
        handles = [m.register_forward_hook(hook) for m in model.modules()]
        local = 8 // world
        losses, local_losses = [], []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            inputs, targets = case.batch(step, 8)
            x, y = inputs[rank * local:(rank + 1) * local].to(device), targets[rank * local:(rank + 1) * local].to(device)
            loss = case.loss(model(x), y)
            with torch.no_grad():
                want = case.loss(plain(x), y).item() if step == 0 else None
            model.backward(loss)
            opt.step()
            r = loss.detach().clone(); dist.all_reduce(r); losses.append(r.item() / world)
            local_losses.append((loss.item(), want))
            for h in handles: h.remove()
            handles = []
        bad_seen = {k: v for k, v in seen.items() if not isinstance(v, float) or v > 0}
        out.append({"mesh": mesh_shape, "across": across, "strategy": strategy, "rank": rank,
                    "after_shard_bad": {k: v for k, v in after_shard.items() if v > 0},
                    "forward_seen_bad": bad_seen, "n_seen": len(seen), "losses": losses, "local_step0": local_losses[0],
                    "chunks": [(c.size, c.shard_size, getattr(c, "outer", None), c.rank, c.world_size) for c in model.engine.chunks][:3]})
        model.engine.close()
    return out


def main():
    ref = train_reference("gpt", steps=2)
    print("reference losses", ref.losses, flush=True)
    variants = [((2, 2), False, "chunk"), ((2, 2), True, "chunk"), ((1, 4), True, "chunk"), ((4, 1), True, "chunk"),
                ((2, 2), True, "tensor"), (None, False, "chunk")]
    results = run_distributed(worker, 4, variants, timeout=240)
    for rank_out in results:
        for row in rank_out:
            print(json.dumps(row, default=str), flush=True)
