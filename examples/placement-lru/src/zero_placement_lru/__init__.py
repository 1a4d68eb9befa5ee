"""zero-placement-lru: an example third-party placement policy for zero.

Select it with ``ZeroConfig(placement="lru", placement_options={"device_chunks": 2})``.
"""

from zero_placement_lru._policy import LruConfig, LruPolicy
from zero_placement_lru._version import __version__

__all__ = ["LruConfig", "LruPolicy", "__version__"]
