"""``nox -s bench`` (``zero bench``): every registered strategy, stage, comm backend and placement policy, side by
side with torch DDP and FSDP2 (``fully_shard``), on the same GPT-style model, data and ranks.

Modules: :mod:`.configs` (what runs), :mod:`.launch` (one configuration under torchrun, and why it failed),
:mod:`.worker` (one configuration on every rank), :mod:`.teardown` (a rank's clean exit), :mod:`.counting`
(bytes and calls of DDP's and FSDP2's collectives), :mod:`.report` (the table and the loss check), :mod:`.plot`,
:mod:`.compare` (a run against a saved baseline), :mod:`.main` (the command line: ``main(argv)``).
"""

from zero_bench._version import __version__

__all__ = ["__version__"]
