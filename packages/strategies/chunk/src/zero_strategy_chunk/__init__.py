"""zero-strategy-chunk: chunked, evenly sharded ZeRO-3 for zero."""

from zero_strategy_chunk._search import SearchResult, block_of, search_chunk_size
from zero_strategy_chunk._strategy import ChunkStrategy, pack_chunks
from zero_strategy_chunk._version import __version__

__all__ = ["ChunkStrategy", "SearchResult", "__version__", "block_of", "pack_chunks", "search_chunk_size"]
