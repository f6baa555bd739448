"""The offload optimizer: bf16 weights on the device, master weights and Adam states in host RAM.

``optimizer.py`` is the face and lists the rooms behind it, one concept each.
"""

from .optimizer import OffloadOptimizer
from .state_dict import LEGACY_FORMAT, STATE_DICT_FORMAT

__all__ = ["LEGACY_FORMAT", "STATE_DICT_FORMAT", "OffloadOptimizer"]
