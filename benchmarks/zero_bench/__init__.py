"""``nox -s bench``: every registered strategy, stage, comm backend and placement policy, side by side with
torch DDP and FSDP2 (``fully_shard``), on the same GPT-style model, data and ranks.

Modules: :mod:`.configs` (what runs), :mod:`.worker` (one configuration on every rank, under torchrun),
:mod:`.counting` (bytes and calls of DDP's and FSDP2's collectives), :mod:`.report` (the table and the loss
check), :mod:`.plot`, :mod:`.compare` (a run against a saved baseline), :mod:`.main` (the command line).
"""
