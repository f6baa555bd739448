"""Will it fit? The host RAM and GPU memory ``cpu_adam.OffloadOptimizer`` needs for a model, per state precision
and master dtype, and the CPU step's estimated time on this machine.

    python -m cpu_adam.plan --params 1.3B --gpu-memory 80GiB --host-memory 125GiB
    python -m cpu_adam.plan --config path/to/config.json      # memory detected here
    python -m cpu_adam.plan 70B --fsdp2 --world-size 8          # FSDP2 + CPUAdam: per rank, per host, per unit

    from cpu_adam.plan import plan
    rows = plan(model)  # an nn.Module (the meta device will do), a count such as "7B", or a config.json path

- ``sizes.py``: counts and sizes as people write them; the memory this machine has;
- ``models.py``: a model as the shapes of the params the optimizer trains;
- ``table.py``: the bytes, counted from the optimizer's own layout and dtypes, and the rows;
- ``fsdp2.py``: the same for FSDP2 with CPU offload and CPUAdam stepping the shards;
- ``probe.py``: the step time, estimated from a bandwidth probe;
- ``__main__.py``: the command line.
"""

from .fsdp2 import FSDP2Row, plan_fsdp2
from .models import ModelSpec, from_config, model_spec
from .sizes import PlanError, parse_bytes, parse_count
from .table import Row, plan

__all__ = [
    "FSDP2Row",
    "ModelSpec",
    "PlanError",
    "Row",
    "from_config",
    "model_spec",
    "parse_bytes",
    "parse_count",
    "plan",
    "plan_fsdp2",
]
