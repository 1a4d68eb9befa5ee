"""Who allocates the large blocks gemini counts as activations for the tensor strategy at world 2 on CUDA?
And: does DTensor.full_tensor() over gloo with CUDA tensors work (uneven shards)?"""
import json
import torch
import torch.distributed as dist
from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing import run_distributed, train_sharded


def alloc_worker(strategy):
    torch.cuda.memory._record_memory_history(max_entries=200000)
    config = ZeroConfig(stage=3, strategy=strategy, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                        placement_options={"device_budget_mb": 1000})
    result = train_sharded("gpt", config=config, steps=2)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc" and e["size"] >= 512 * 1024:
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                      if f["filename"].endswith(".py")][:8]
            rows.append((e["size"], e.get("stream"), frames))
    rows.sort(key=lambda r: -r[0])
    return {"need": result.placement.get("need"), "non_model_peak": result.placement.get("non_model_peak"),
            "n_big": len(rows), "top": rows[:6]}


def dtensor_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    out = {}
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for rows in (8, 3):
        full = torch.arange(rows * 4, dtype=torch.float32, device="cuda").view(rows, 4)
        d = distribute_tensor(full, mesh, [Shard(0)])
        out[rows] = torch.equal(d.full_tensor(), full)
    return out


def main():
    for strategy in ("tensor", "chunk"):
        try:
            for r, res in enumerate(run_distributed(alloc_worker, 2, strategy, timeout=120)):
                print(strategy, "rank", r, json.dumps(res, default=str), flush=True)
        except Exception as e:
            print(strategy, "alloc diag failed", repr(e)[:1500], flush=True)
    try:
        print("dtensor full_tensor over gloo+cuda", run_distributed(dtensor_worker, 2, timeout=60), flush=True)
    except Exception as e:
        print("dtensor diag failed", repr(e)[:1500], flush=True)
