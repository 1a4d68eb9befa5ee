"""Completing asynchronous reductions off the training thread.

The training thread must never block on a reduce-scatter in the middle of backward (see
[Note: agreeing on all-gathers]: a rank blocked there could hold up a gather another
rank waits for), and gloo reports an asynchronous collective as complete only once
someone waits on it. So one waiter thread per engine waits on the reductions in the
order they were issued and completes each the moment it finishes, which frees its
full-size gradient buffer right away instead of at the end of backward.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any

__all__ = ["ReductionWaiter"]


class ReductionWaiter:
    """Runs ``item.complete()`` for each submitted item, in order, on a daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zero-reduction-waiter", daemon=True)
        self._thread.start()
        # A waiter thread still alive while the interpreter tears torch down aborts the process
        # ("terminate called without an active exception"), so stop it before that.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            if (waiter := ref()) is not None:
                waiter.close(timeout=10.0)

        atexit.register(close_at_exit)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                if self._error is None:
                    item.complete()
            except BaseException as err:  # handed to the training thread by join()
                self._error = err
            finally:
                # Drop the collective's handle now: one outliving its process group aborts the process at exit.
                item = None
                self._queue.task_done()

    def submit(self, item: Any) -> None:
        self._queue.put(item)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread once everything submitted has completed (or ``timeout`` passed)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def join(self) -> None:
        """Wait until every submitted reduction has completed; re-raise the first failure."""
        self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
