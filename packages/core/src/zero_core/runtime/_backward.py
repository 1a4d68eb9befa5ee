"""The running backward's own state: one object per backward, made when it begins, dropped when it ends.

What used to be separate flags on the engine (capture only, create graph, hold gathered, callback queued,
no_sync window open) is decided once, when the backward begins, and read from here until its one end
(``Engine._end_backward``, whichever way it ended: see :class:`~zero_core.base._state.BackwardEnd`).
"""

from __future__ import annotations

from zero_core.base._state import BackwardKind

__all__ = ["BackwardPass"]


class BackwardPass:
    """One backward through the wrapped model, from its first hook to its end."""

    __slots__ = ("accumulates", "holds_gathered", "kind", "window_open")

    def __init__(self, kind: BackwardKind, *, window_open: bool, holds_gathered: bool) -> None:
        self.kind = kind
        #: It accumulates into trainable parameters (prepares gradient buffers, reduces): ``kind`` is REDUCE.
        self.accumulates = kind is BackwardKind.REDUCE
        #: Gradients a ``no_sync()`` window accumulated before it share its buffers: a failure loses them too.
        self.window_open = window_open
        #: It runs through the graph of a CAPTURE_FOR_GRAPH backward's gradients, which reads the gathered
        #: parameters and has no module hooks to gather them again: it releases nothing before its end.
        self.holds_gathered = holds_gathered

    @property
    def keeps_gathered(self) -> bool:
        """When it finishes, the chunks stay gathered for the backward through its gradients' graph."""
        return self.kind is BackwardKind.CAPTURE_FOR_GRAPH

    def __repr__(self) -> str:
        return (f"BackwardPass({self.kind.value}, window_open={self.window_open}, "
                f"holds_gathered={self.holds_gathered})")
