"""The disk tier's optimizer step: the next chunk's files read while a chunk steps, its own written behind, and
the values those of plain training ([Note: the disk tier's pipeline])."""

import torch

from zero_core import ChunkPolicy, ZeroConfig, shard
from zero_offload._tiers import DISK, HOST, Part

WIDTH, DEPTH, CHUNK = 32, 6, 32 * 32 + 32  # one Linear per chunk


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(DEPTH)])


def _batches(steps):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, WIDTH, generator=g) for _ in range(steps)]


def _train(model, opt, batches, backward=None):
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = model(x).square().mean()
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def test_disk_reads_run_ahead_of_the_step_and_writes_behind_it_with_plain_training_values(tmp_path):
    batches = _batches(4)
    plain = _mlp()
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batches)

    # the host holds the gradients, two shards, and room to step one chunk with the next read ahead and the last
    # written behind: every chunk's states and four shards go to disk
    # margin_ratio 0: every chunk steps on the host, so past the host budget its optimizer states live on disk
    options = {"device_budget_mb": 4, "host_budget_mb": 0.08, "disk_dir": str(tmp_path), "margin_ratio": 0.0}
    model = _mlp()
    model, opt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                       config=ZeroConfig(chunk=ChunkPolicy(chunk_size=CHUNK), placement="gemini", placement_options=options))
    policy = model.engine.placement
    tiers = policy.tiers
    on_disk = [c.index for c in model.engine.chunks if tiers.tier(c, Part.OPTIM) is DISK]
    shards_on_disk = {c.index for c in model.engine.chunks if tiers.tier(c, Part.PARAMS) is DISK}
    assert len(on_disk) == DEPTH and len(shards_on_disk) >= 3, (on_disk, shards_on_disk)
    tiers.disk.events = []
    losses = _train(model, opt, batches, backward=model.backward)
    events = list(tiers.disk.events)  # the training's (full_parameters() below reads shards too)

    assert losses == expected  # same values as one plain AdamW, to the bit
    for name, param in plain.named_parameters():
        assert torch.equal(model.full_parameters()[name], param.detach()), name
    assert tiers.peak[HOST] <= tiers.budget[HOST]  # read-aheads are charged and fit

    # the order of events in the last step (states exist from the first step on): each event happens once a step
    at = {event: i for i, event in enumerate(events)}  # its last occurrence
    step = events[at[("read issued", f"optim-{on_disk[1]}")]:]
    for current, following in zip(on_disk, on_disk[1:]):
        # the next chunk's states are read while this one steps: issued before its step starts
        assert at[("read issued", f"optim-{following}")] < at[("step start", f"chunk-{current}")], (current, step)
        # this chunk's states are written behind: the next chunk's step starts without waiting for the write
        assert at[("write issued", f"optim-{current}")] < at[("step start", f"chunk-{following}")]
        if following in shards_on_disk:  # and its shard too
            assert at[("read issued", f"params-{following}")] < at[("step start", f"chunk-{current}")]
        if current in shards_on_disk:
            assert at[("write issued", f"params-{current}")] < at[("step start", f"chunk-{following}")]
    # every write is in its file when the optimizer step returns
    assert sum(what == "write issued" for what, _ in step) == sum(what == "write done" for what, _ in step) > 0
    report = policy.report()
    assert report["disk_bytes_read"] > 0 and report["disk_bytes_written"] > 0
    model.close()
