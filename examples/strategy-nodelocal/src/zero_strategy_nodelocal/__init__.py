"""zero-strategy-nodelocal: an example third-party shard strategy for zero (hybrid sharding, HSDP).

Select it with ``ZeroConfig(strategy="node-local")``; each chunk is sharded over the ranks of
one node (``LOCAL_WORLD_SIZE``, or ``ZERO_NODELOCAL_SHARD_SIZE``) and replicated across nodes.
"""

from zero_strategy_nodelocal._strategy import DEFAULT_CHUNK_SIZE, SHARD_SIZE_ENV, NodeLocalStrategy, node_shard_size
from zero_strategy_nodelocal._version import __version__

__all__ = ["DEFAULT_CHUNK_SIZE", "SHARD_SIZE_ENV", "NodeLocalStrategy", "__version__", "node_shard_size"]
