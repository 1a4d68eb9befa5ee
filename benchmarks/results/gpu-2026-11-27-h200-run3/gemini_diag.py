"""GPU diagnostics: gemini's warm-up plan on CUDA (what it counts per compute point), who allocates, a profile."""
import os, sys, time, statistics, collections
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from zero_core import ChunkPolicy, Precision, ZeroConfig, shard
from zero_core.plugin import in_engine_work
from zero_core.testing.gpt import GPT, GPTConfig, SyntheticTokens, lm_loss
from zero_offload import GeminiConfig

dev = torch.device("cuda")
MiB = 2**20
SHAPE = dict(vocab_size=50257, seq_len=1024, d_model=2048, n_head=16)
B = 4
ONLY = os.environ.get("ONLY", "plan,ops,prof")

class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.rows = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        out = func(*args, **(kwargs or {}))
        self.rows.append((str(func), in_engine_work(), torch.cuda.memory_allocated() - before, torch.cuda.memory_allocated()))
        return out

def build(depth, budget_mb=100_000, margin=0.0):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=depth, checkpoint=True, **SHAPE))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    cfg = ZeroConfig(strategy="chunk", stage=3, precision=Precision(compute="bf16"), chunk=ChunkPolicy(search_interval=2048),
                     placement="gemini", placement_options=GeminiConfig(device_budget_mb=budget_mb, margin_ratio=margin))
    return shard(model, opt, config=cfg)

def step(zm, zo, toks):
    loss = lm_loss(zm(toks), toks); zm.backward(loss); zo.step(); zo.zero_grad(set_to_none=True); return loss

data = SyntheticTokens(vocab_size=SHAPE["vocab_size"], seq_len=SHAPE["seq_len"])
toks = [data.batch(i, B).to(dev) for i in range(6)]

if "plan" in ONLY:
  for depth in (2, 3):
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    zm, zo = build(depth)
    pol = zm.engine.placement
    rec = []
    orig = pol.before_compute
    def bc(chunks, *, backward, _o=orig):
        rec.append((backward, tuple(c.index for c in chunks), torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                    pol.context.device_bytes(), pol.tiers.device_state_bytes(pol.chunks)))
        return _o(chunks, backward=backward)
    pol.before_compute = bc
    logger = OpLog() if (depth == 3 and "ops" in ONLY) else None
    if logger: logger.__enter__()
    step(zm, zo, toks[0]); torch.cuda.synchronize()
    if logger: logger.__exit__(None, None, None)
    pk = torch.cuda.max_memory_allocated()
    print(f"=== depth {depth}: base alloc {base/MiB:.0f} MiB, warm-up peak alloc {pk/MiB:.0f}, reserved peak {torch.cuda.max_memory_reserved()/MiB:.0f}")
    print(f"need {pol.need/MiB:.0f} MiB; inflight_reserve {pol.inflight_reserve/MiB:.0f}; cached_free {pol.tracer.cached_free/MiB:.0f}; "
          f"fragmented {pol.tracer.fragmented/MiB:.0f}; resident {pol.tracer.resident/MiB:.0f}; "
          f"group_bytes max {max(pol.group_bytes)/MiB:.0f}; chunks {[ (c.index, c.full_bytes//MiB, c.shard_bytes//MiB, c.persistent) for c in pol.chunks]}")
    tot = [w + n for w, n in zip(pol.work, pol.non_model)]
    kmax = max(range(len(tot)), key=tot.__getitem__)
    print(f"argmax k={kmax} work {pol.work[kmax]/MiB:.0f} non_model {pol.non_model[kmax]/MiB:.0f}")
    print("k bwd chunks | work nm | alloc reserved ctx_dev tier_dev (MiB)")
    for k, (b, idx, a, r, cd, td) in enumerate(rec):
        print(f"{k:2d} {int(b)} {idx} | {pol.work[k]/MiB:7.0f} {pol.non_model[k]/MiB if k < len(pol.non_model) else -1:7.0f} | {a/MiB:7.0f} {r/MiB:7.0f} {cd/MiB:7.0f} {td/MiB:7.0f}")
    ts = []
    for i in range(1, 4):
        torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize(); t0 = time.perf_counter()
        step(zm, zo, toks[i]); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"steps 1-3 s {[round(t,3) for t in ts]}, peak alloc step 3 {torch.cuda.max_memory_allocated()/MiB:.0f} MiB; report {pol.report()}")
    if logger:
        rows = logger.rows
        imax = max(range(len(rows)), key=lambda i: rows[i][3])
        print(f"ops {len(rows)}; max alloc {rows[imax][3]/MiB:.0f} at op {imax} {rows[imax][0]} engine={rows[imax][1]}")
        for r in rows[max(0, imax-25): imax+3]:
            print(f"   {r[0][:60]:60s} eng={int(r[1])} d={r[2]/MiB:8.1f} a={r[3]/MiB:8.0f}")
        agg = collections.defaultdict(lambda: [0, 0])
        for name, eng, d, a in rows:
            if d > 0: agg[(name, eng)][0] += d; agg[(name, eng)][1] += 1
        for (name, eng), (d, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:15]:
            print(f"  alloc+ {name[:60]:60s} eng={int(eng)} total {d/MiB:9.0f} MiB over {n}")
    zm.close(); del zm, zo, pol; import gc; gc.collect(); torch.cuda.empty_cache()

if "prof" in ONLY:
    from torch.profiler import profile, ProfilerActivity
    zm, zo = build(2)
    for i in range(2): step(zm, zo, toks[i])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step(zm, zo, toks[2]); torch.cuda.synchronize()
    ka = p.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=55))
    print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=55))
    zm.close()
