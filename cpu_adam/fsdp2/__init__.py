"""CPUAdam on FSDP2's shards: the step behind the next forward (``step_behind_forward``)."""

from .behind import StepBehindForward, step_behind_forward

__all__ = ["StepBehindForward", "step_behind_forward"]
