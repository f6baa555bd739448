"""The step behind the next forward: ``step()`` takes the norm and the clip factor, fixes the hyper-parameters,
queues the shards' steps unit by unit in the order the next forward gathers them, and returns; the next forward
runs while the host steps, and each unit's gather waits for that unit's step alone.

    handle = step_behind_forward(model, optimizer)   # model: the FSDP2 root, or a list of model parts
    ...                                              # train as before: forward, backward, step, zero_grad
    handle.remove()                                  # the serial step again

Once backward has ended every grad shard is on the host, so the global norm, and with it the step, is known
before the next forward begins. Whatever reads what the step writes before it is done waits for it (``guard``);
the result is bitwise the serial step's. Lifecycle: ``IDLE`` (no step queued) -> ``IN_FLIGHT`` (after
``step()``) -> ``IDLE`` (every unit stepped, or a failure collected by a wait) ... -> ``REMOVED``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from .._compiled_step import GroupStep, check_groups
from .guard import ReadGuard
from .in_flight import InFlight, Status
from .units import Unit, find_units

__all__ = ["StepBehindForward", "step_behind_forward"]

OUTSIDE = -1  # a param of the optimizer in no FSDP2 unit: stepped first, before the units


class State(enum.Enum):
    IDLE = "idle"
    IN_FLIGHT = "in flight"
    REMOVED = "removed"


def step_behind_forward(
    model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer, *, threads: int | None = None
) -> StepBehindForward:
    """Runs ``optimizer``'s steps behind the next forward of ``model`` (an FSDP2 root module, or a list of model
    parts); ``threads``: the kernel's threads while the forward runs (default: torch's threads less one, which
    the forward's own thread keeps). Returns the handle; ``handle.remove()`` goes back to the serial step."""
    return StepBehindForward(model, optimizer, threads=threads)


class StepBehindForward:
    """The mode's handle: which units the optimizer's params lie in, the gather order learned from the forward,
    the step in flight and the waits on it."""

    def __init__(
        self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer, *, threads: int | None = None
    ) -> None:
        if not callable(getattr(type(optimizer), "_settled", None)):  # CPUAdam's: its step knows the handle
            raise TypeError(
                f"step_behind_forward: the optimizer must be a cpu_adam.CPUAdam, got {type(optimizer).__name__}; "
                "build CPUAdam over the FSDP2 module's params"
            )
        if optimizer.__dict__.get("_behind") is not None:
            raise RuntimeError(
                "step_behind_forward: this optimizer already steps behind the forward; call remove() on the "
                "handle first"
            )
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"step_behind_forward: threads must be a positive int (or None), got {threads!r}")
        parts = [model] if isinstance(model, nn.Module) else list(model)
        if not parts:
            raise ValueError("step_behind_forward: no model part given")
        self.units: list[Unit] = find_units(parts)
        self.threads = threads or max(1, torch.get_num_threads() - 1)
        self._removed = False
        self._optimizer = optimizer
        self._unit_of_param = {id(p): k for k, unit in enumerate(self.units) for p in unit.params}
        self._order = list(range(len(self.units)))  # module order until a forward shows FSDP2's
        self._queue = list(self._order)
        self._gathered: list[int] = []  # units whose forward ran since the last step, in that order
        self._in_flight: InFlight | None = None
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="cpu_adam step behind the forward")
        self._last: InFlight | None = None
        self._position: dict[int, int] = {}
        self._unit_of_tensor: dict[int, int] = {}
        self._guard: ReadGuard | None = None
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward(k), prepend=True)
            for k, unit in enumerate(self.units)
            for module in unit.modules
        ]
        self._hooks += [module.register_forward_hook(self._after_forward) for module in parts]
        modules = {id(m): m for m in [*parts, *(m for unit in self.units for m in unit.modules)]}.values()
        for module in modules:  # from any thread: the guard sees this thread's ops only
            self._hooks.append(module.register_state_dict_pre_hook(lambda *args: self.settle()))
            self._hooks.append(module.register_load_state_dict_pre_hook(lambda *args: self.settle()))
        optimizer._behind = self

    # -- lifecycle ------------------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        if self._removed:
            return State.REMOVED
        return State.IN_FLIGHT if self._in_flight is not None else State.IDLE

    def remove(self) -> None:
        """Waits for the step in flight, then goes back to the serial step."""
        if self._removed:
            return
        try:
            self.wait()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._retire_guard()
            self._stepper.shutdown()
            self._optimizer._behind = None
            self._removed = True

    def wait(self) -> None:
        """Until every unit of the step in flight is stepped; raises the failure of one that raised."""
        self._wait_all()
        self._retire_guard()

    @property
    def order(self) -> list[str]:
        """The units' names in the order the step runs them (FSDP2's gather order in the last forward)."""
        return [self.units[k].describe() for k in self._order]

    @property
    def unit_seconds(self) -> dict[str, float]:
        """Each unit's kernel time in the last step queued, by unit, in the queue's order (for benchmarks)."""
        in_flight = self._in_flight or self._last
        return dict(zip(in_flight.names, in_flight.seconds)) if in_flight else {}

    # -- the optimizer's side: CPUAdam.step calls these -------------------------------------------------------

    def unit_of(self, p: Tensor) -> int:
        return self._unit_of_param.get(id(p), OUTSIDE)

    def launch(self, per_group: list[dict[int, GroupStep]]) -> None:
        """Queues the step: each group's part in each unit (``per_group``: unit -> that group's GroupStep), every
        kernel call checked first (a refused step changes nothing); the optimizer's params outside every unit, if
        any, first (no gather waits for them; what reads them does)."""
        fixed = [{unit: step._replace(lr=float(step.lr)) for unit, step in parts.items()} for parts in per_group]
        check_groups([step for parts in fixed for step in parts.values()])
        self._learn_order(outside=any(OUTSIDE in parts for parts in fixed))
        steps = [[parts[k] for parts in fixed if k in parts] for k in self._queue]
        names = [self.units[k].describe() if k != OUTSIDE else "outside FSDP2's units" for k in self._queue]
        unit_of, held = self._guard_tensors()
        self._unit_of_tensor = unit_of
        self._in_flight = InFlight(steps, names, self.threads, self._stepper)
        self._push_guard(unit_of, held)

    def zero_grads(self, grads: list[Tensor]) -> bool:
        """zero_grad(set_to_none=False) while a step is in flight: each unit's grads are zeroed once its step has read
        them, and the forward goes on meanwhile; False where it cannot be done so (nothing in flight)."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.finished:
            return False
        by_unit: dict[int, list[Tensor]] = {}
        for g in grads:
            position = self._unit_of_tensor.get(id(g))
            if position is None:  # a grad the step does not read (its param has no state yet): zeroed now
                torch._foreach_zero_([g])
            else:
                by_unit.setdefault(position, []).append(getattr(g, "_local_tensor", g))
        in_flight.zero_after_step(by_unit)
        return True

    def settle(self) -> None:
        """Before anything that reads or writes the step's tensors from outside its forward: the whole step."""
        if self._in_flight is not None:
            self.wait()

    # -- the forward's side ---------------------------------------------------------------------------------

    def _before_forward(self, k: int):
        def hook(module: nn.Module, args: object) -> None:
            if torch._C._current_graph_task_id() == -1 and k not in self._gathered:  # not a recompute in backward
                self._gathered.append(k)
            if self._in_flight is not None:
                self._wait_unit(self._position[k])

        return hook

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        """A forward that gathered every unit found them all stepped (its last wait may have ended the step): the
        guard leaves before the backward."""
        in_flight = self._in_flight
        if in_flight is None or all(s not in (Status.QUEUED, Status.STEPPING) for s in in_flight.status):
            self.wait()

    def _learn_order(self, outside: bool) -> None:
        """The units in the order the last forward gathered them (the rest after, as before), behind the params
        outside every unit where there are any: the step's queue."""
        seen = list(self._gathered)
        self._order = seen + [k for k in self._order if k not in seen]
        self._queue = [OUTSIDE] * outside + self._order
        self._position = {k: i for i, k in enumerate(self._queue)}
        self._gathered = []

    # -- waits ----------------------------------------------------------------------------------------------

    def _wait_unit(self, position: int) -> None:
        in_flight = self._in_flight
        if in_flight is None:
            return
        in_flight.wait(position)
        self._collect(in_flight)

    def _wait_all(self) -> None:
        in_flight = self._in_flight
        if in_flight is not None:
            in_flight.wait_all()
            self._collect(in_flight)

    def _collect(self, in_flight: InFlight) -> None:
        """Raises a unit's failure once, to the first wait after it; ends the step once every unit is done."""
        if in_flight.failure is not None:
            in_flight.wait_all()
            position, error = in_flight.failure
            self._end(in_flight)
            stepped = [in_flight.names[i] for i, s in enumerate(in_flight.status) if s is Status.STEPPED]
            left = [in_flight.names[i] for i, s in enumerate(in_flight.status) if s is Status.LEFT]
            raise RuntimeError(
                f"CPUAdam: the step behind the forward failed in unit {in_flight.names[position]} "
                f"({type(error).__name__}: {error}); that unit and {len(left)} after it were left as they were "
                f"({len(stepped)} stepped), so the next step() can go on"
            ) from error
        if in_flight.finished:
            self._end(in_flight)

    def _end(self, in_flight: InFlight) -> None:
        if self._in_flight is in_flight:
            self._last = in_flight
            self._in_flight = None

    # -- the guard ------------------------------------------------------------------------------------------

    def _guard_tensors(self) -> tuple[dict[int, int], list[Tensor]]:
        """Which queue position each tensor of the step belongs to (by id), and the tensors: the optimizer's params,
        their grads and states (DTensors and their local shards), and the shards FSDP2's gather reads."""
        held: list[Tensor] = []
        unit_of: dict[int, int] = {}
        for k in self._order:
            for t in self.units[k].gathered:
                unit_of[id(t)] = self._position[k]
                held.append(t)
        state = self._optimizer.state
        for p in (p for group in self._optimizer.param_groups for p in group["params"]):
            position = self._position.get(self.unit_of(p))
            if position is None:  # outside every unit and not stepped
                continue
            tensors = [p, *([p.grad] if p.grad is not None else [])]
            tensors += [v for v in state.get(p, {}).values() if isinstance(v, Tensor)]
            tensors += [t._local_tensor for t in tensors if hasattr(t, "_local_tensor")]
            for t in tensors:
                unit_of[id(t)] = position
            held += tensors
        return unit_of, held

    def _push_guard(self, unit_of: dict[int, int], held: list[Tensor]) -> None:
        """The last step's guard off the stack (it is still there when that step ended in a wait of the forward's),
        this step's on."""
        self._retire_guard()
        in_flight = self._in_flight
        self._guard = ReadGuard(unit_of, held, self._wait_unit, self._wait_all, lambda: in_flight.finished)
        self._guard_thread = threading.get_ident()
        torch._C._push_on_torch_function_stack(self._guard)

    def _retire_guard(self) -> None:
        """Off the function mode stack of the thread that pushed it (from another thread: later, by that one);
        modes pushed after it stay, in their order."""
        guard = self._guard
        if guard is None or threading.get_ident() != self._guard_thread:
            return
        above = []
        while torch._C._len_torch_function_stack():
            mode = torch._C._pop_torch_function_stack()
            if mode is guard:
                break
            above.append(mode)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)
        self._guard = None
