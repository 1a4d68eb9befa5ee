"""Materialise a lazily built model into its chunks: replay the initialisers, keep this rank's shards."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zero_core.base._trace import MATERIALIZE, traced
from zero_core.base.errors import ZeroSetupError
from zero_core.chunks.chunk import Chunk
from zero_core.comm._agreement import rank0_value
from zero_core.comm.backend import CommBackend
from zero_core.setup._lazy import LazyRecording

__all__ = ["materialize"]


def _view(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.size(), like.stride())


@traced(MATERIALIZE)
def materialize(
    recording: LazyRecording, module: nn.Module, chunks: Sequence[Chunk], metas: dict[int, torch.Tensor], *,
    comm: CommBackend, from_rank0: bool, params_loaded: bool,
) -> None:
    """Give every chunk's shard (after ``Chunk.begin_fill``) and every buffer its initial value.

    ``metas`` maps each parameter (by id) to the meta tensor it was built as.
    Parameters keep only this rank's part; each buffer is materialised whole on the CPU. With
    ``from_rank0``, every rank replays from rank 0's random state (what ``sync_module_states``
    gives eager models). With ``params_loaded`` the parameters' values come from a state dict
    next, so only the buffers are computed.
    """
    finals: dict[int, list[Callable[[torch.UntypedStorage], object]]] = {}
    if not params_loaded:
        for chunk in chunks:
            for i, slot in enumerate(chunk.slots):
                meta = metas[id(slot.param)]
                param_key = recording.key(meta)
                assert param_key is not None  # find_recording chose the recording that made every meta parameter
                finals.setdefault(param_key, []).append(functools.partial(_fill_slot, chunk, i, meta))
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is None or buf.device.type != "meta":
                continue
            key = recording.key(buf)
            if key is None:
                raise ZeroSetupError(
                    f"buffer {name!r} of {type(owner).__name__} is on the meta device but was not built under "
                    "zero_core.lazy_init(); build the whole model inside the context"
                )
            finals.setdefault(key, []).append(functools.partial(_set_buffer, owner, name, buf))
    rng_state = recording.rng_state
    if from_rank0:
        rng_state = rank0_value(comm, rng_state)
    recording.replay(
        device=torch.device("cpu"),
        finals={key: _call_each(calls) for key, calls in finals.items()},
        rng_state=rng_state, run_all=not params_loaded,
    )


def _fill_slot(chunk: Chunk, i: int, like: torch.Tensor, storage: torch.UntypedStorage) -> None:
    chunk.fill(i, _view(storage, like).reshape(-1).to(chunk.master_dtype))


def _set_buffer(owner: nn.Module, name: str, like: torch.Tensor, storage: torch.UntypedStorage) -> None:
    owner._buffers[name] = _view(storage, like)


def _call_each(calls: list[Callable[[torch.UntypedStorage], object]]) -> Callable[[torch.UntypedStorage], None]:
    def call_each(storage: torch.UntypedStorage) -> None:
        for call in calls:
            call(storage)

    return call_each
