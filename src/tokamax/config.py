"""Library options: what a cache miss does, whether the shipped cache is used."""

from tokamax._src.config import OPTIONS as OPTIONS
from tokamax._src.config import CacheMiss as CacheMiss
from tokamax._src.config import override as override
