"""Inspection: what the engine holds (bytes, exactly) and the full parameters on demand.

Mixed into :class:`~zero_core.Engine`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from zero_core._accounting import engine_work_context as _engine_work
from zero_core.chunk import Chunk, to_local

__all__ = ["Inspection"]


class Inspection:
    """Read-only views of the engine's memory and parameters."""

    def device_bytes(self) -> int:
        """Bytes the engine holds on the device now: gathered or kept full buffers, gradient buffers, idle pooled buffers.

        Exact, from storage sizes. Master shards, their gradients and optimizer states are not
        counted here: where they live is the placement policy's to account.
        """
        pool = self.chunks[0].pool if self.chunks else None
        # pooled buffers: idle, or lent to a backward or a reduction in flight (gradient buffers, receive buffers)
        total = pool.nbytes + pool.lent if pool is not None else 0
        for chunk in self.chunks:
            if not chunk.shard_is_view:
                total += chunk.full.untyped_storage().nbytes()
            else:  # the kept buffer holds the shard: the shard's part is the policy's
                total += chunk.full_bytes - chunk.shard_bytes
            if chunk.grad_full is not None:
                total += chunk.grad_full.untyped_storage().nbytes()
        return total

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds now, by kind (exact, from tensor storages).

        ``params`` counts master shards and the full buffers stages 1 and 2 keep, each
        storage once (in one dtype the kept buffer holds the shard). ``grads`` counts each
        gradient storage once: the segments' gradients (views of one shard-sized buffer
        per chunk) and the full-size buffer stage 1 keeps. ``optimizer_scalars`` counts
        zero-dimensional optimizer states (step counters) separately, because the ZeRO
        formulas leave them out. ``gathered_buffers`` is stage 3's full buffers gathered
        right now; ``gradient_workspace`` the idle full-size gradient buffers kept for reuse.
        """
        report = {"params": 0, "grads": 0, "optimizer_states": 0, "optimizer_scalars": 0, "gathered_buffers": 0,
                  "gradient_workspace": self.chunks[0].pool.nbytes if self.chunks else 0}
        param_storages: dict[int, int] = {}
        grad_storages: dict[int, int] = {}

        def add(storages: dict[int, int], tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

        for chunk in self.chunks:
            if chunk._shard is not None:  # else the kept full buffer holds the master values
                add(param_storages, chunk._shard)
            if chunk.persistent:
                add(param_storages, chunk.full)
            elif chunk.is_gathered:
                report["gathered_buffers"] += chunk.full_bytes
            if chunk.grad_full is not None:
                add(grad_storages, chunk.grad_full)
            for seg in chunk.segments:
                if seg.param.grad is not None:
                    add(grad_storages, to_local(seg.param.grad))
                for value in self.optimizer.state.get(seg.param, {}).values():
                    if isinstance(value, torch.Tensor):
                        per_element = isinstance(value, DTensor) or value.dim() > 0
                        value = to_local(value)
                        key = "optimizer_states" if per_element else "optimizer_scalars"
                        report[key] += value.numel() * value.element_size()
        report["params"] = sum(param_storages.values())
        report["grads"] = sum(grad_storages.values())
        return report

    @torch.no_grad()
    def iter_full_chunks(self) -> Iterator[tuple[Chunk, torch.Tensor]]:
        """Each chunk with its whole master values (a device tensor), one chunk at a time.

        Collective: every rank iterates to the end. The tensor is only valid until the next
        item; no rank holds more than one gathered chunk beyond its shards.
        """
        self.require_idle("reading the full parameters")
        for chunk in self.chunks:
            with _engine_work():
                self.placement.before_gather([chunk])  # a shard on disk comes back to be read
                if chunk.shard_is_view:
                    full = chunk.full
                else:
                    received = torch.empty(chunk.size, dtype=chunk.master_dtype, device=chunk.device)
                    gather = chunk.groups.gather if chunk.groups is not None else self.comm
                    gather.all_gather(received, chunk.shard.to(chunk.device))
                    full = torch.empty(chunk.size, dtype=chunk.master_dtype, device=chunk.device)
                    torch.split_with_sizes_copy(received.view(chunk.world_size, chunk.shard_size), chunk._split, dim=1,
                                                out=chunk._regions(full))
                    del received
            try:
                yield chunk, full
            finally:
                del full
                with _engine_work():
                    self.placement.after_release([chunk])

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, as CPU copies of the master values, one chunk at a time.

        Collective: call on every rank. With 16-bit compute these are the fp32 masters
        the optimizer updates, not the 16-bit copies forward uses.
        """
        result: dict[str, torch.Tensor] = {}
        for chunk, full in self.iter_full_chunks():
            for slot in chunk.slots:
                result[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to("cpu", copy=True)
        return result
