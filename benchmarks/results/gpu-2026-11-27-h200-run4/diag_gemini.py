"""What gemini's warm-up plan needs for the test zoo's tiny GPT, per strategy, world size and device."""
import json, os, sys
from zero_core import ChunkPolicy, ZeroConfig
from zero_core.testing import run_distributed, train_sharded

MiB = 2**20
def main():
    rows = []
    for strategy in ("chunk", "tensor"):
        for world in (1, 2):
            for stage in (3, 2):
                config = ZeroConfig(stage=stage, strategy=strategy, chunk=ChunkPolicy(chunk_size=300), placement="gemini",
                                    placement_options={"device_budget_mb": 1000})
                try:
                    r = run_distributed(train_sharded, world, "gpt", config=config, timeout=120)[0].placement
                    row = {k: r.get(k) for k in ("need", "non_model_peak", "resident", "fragmented", "allocator_cached_peak",
                                                 "audit_max", "peak")}
                except Exception as e:  # report and go on
                    row = {"error": repr(e)[:400]}
                row.update(strategy=strategy, world=world, stage=stage, device=os.environ.get("ZERO_TEST_DEVICE"))
                print(json.dumps(row), flush=True)


if __name__ == '__main__':
    main()
