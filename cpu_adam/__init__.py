"""Adam at memory-bandwidth speed on the CPU, for models larger than their GPU.

Importing the package compiles nothing: the kernels are loaded, or compiled
once, on the first optimizer step.
"""

__version__ = "0.3.0"

from .checkpoint import load_checkpoint, save_checkpoint
from .offload import OffloadOptimizer
from .optimizer import CPUAdam

__all__ = ["CPUAdam", "OffloadOptimizer", "__version__", "load_checkpoint", "save_checkpoint"]
