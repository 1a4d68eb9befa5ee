"""Many training runs from one spawned world: the suite's parametrized parity and counting tests share them.

Starting a world (forking its ranks, the rendezvous, gloo's connections, each rank's first imports) cost more
than the tiny zoo models' training in most of the parametrized tests, and a file like test_accumulate_clip.py
started a hundred worlds. ``SharedWorlds`` groups a file's runs by world size (and anything else the file keys
them by): the first test that asks for a run trains every run of its group, each in turn under its own engine,
in one world, and the tests read their results. A run's counts and values are its engine's own, so a run
trained after another in the same process group is what it would be alone; a failure in one run fails every
test of its group with the ranks' tracebacks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from zero_core.testing import run_distributed, train_sharded

Run = tuple[str, dict[str, Any]]  # a zoo case and train_sharded's keyword arguments


def train_each(runs: list[Run]) -> list[Any]:
    """On every rank: :func:`train_sharded` on each run in turn, in one process group."""
    return [train_sharded(case, **kwargs) for case, kwargs in runs]


class SharedWorlds:
    """Every rank's results of a run, the run's group trained in one world on its first use.

    ``plan(group)`` returns the group's world size and its runs by key; ``train(runs)``, a module-level function
    the ranks can import, trains a list of them on every rank and returns their results in order (default:
    :func:`train_each`, whose runs are a zoo case and train_sharded's keyword arguments).
    """

    def __init__(self, plan: Callable[[Hashable], tuple[int, dict[Hashable, Any]]], *,
                 train: Callable[[list[Any]], list[Any]] = train_each, timeout: float = 800.0) -> None:
        self._plan = plan
        self._train = train
        self._timeout = timeout
        self._done: dict[Hashable, dict[Hashable, list[Any]]] = {}

    def __call__(self, group: Hashable, key: Hashable) -> list[Any]:
        if group not in self._done:
            world, runs = self._plan(group)
            per_rank = run_distributed(self._train, world, list(runs.values()), timeout=self._timeout)
            self._done[group] = {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(runs)}
        return self._done[group][key]
