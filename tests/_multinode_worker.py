"""One process of tests/test_multinode.py's two-"node" launch: ``torchrun --nnodes 2 ... _multinode_worker.py MODE DIR OUT``.

Each rank checks what torchrun gave it (``RANK``, ``LOCAL_RANK``, the node it is on), trains the zoo
GPT on a 2x2 mesh (replicated across the two nodes, sharded within each), and, for ``MODE`` ``save``,
trains 2 steps, saves a sharded checkpoint into ``DIR`` and trains 2 more; for ``load``, loads it and
trains the last 2. Rank 0 writes what it saw and the run's losses and parameters to ``OUT``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing.checkpointing import phase
from zero_core.testing.zoo import get_case


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    node = int(os.environ["GROUP_RANK"])
    seen = [None] * world
    dist.all_gather_object(seen, {"rank": rank, "local_rank": local, "node": node, "env_rank": int(os.environ["RANK"])})
    config = ZeroConfig(chunk=ChunkPolicy(chunk_size=get_case("gpt").chunk_size), collective_timeout_s=120)
    result = phase("gpt", config, directory, mode=mode, k=2, j=2, mesh_shape=(world // per_node, per_node))
    if rank == 0:
        torch.save({"seen": seen, "losses": result["losses"], "params": result["params"], "step": result["step"]}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
