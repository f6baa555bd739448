"""A small transformer-like model and an fp32 torch.optim.AdamW oracle, for the offload tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpu_adam.offload.device import DeviceOps

VOCAB = 61

# The offload kernel computes in fp32 in torch AdamW's order; torch's CPU kernels may contract
# an FMA where ours does not, so each step may differ by an ulp or two per operation. Over a few
# dozen steps that stays below 1e-5 relative, while one step's update (~lr = 1e-3) is 1000x
# larger than the absolute floor: a missed, doubled or mis-scaled step cannot hide in these.
MASTER_RTOL = 1e-5
MASTER_ATOL = 1e-6


class TinyLM(nn.Module):
    """Embedding tied with the output head, a pre-norm MLP block and a final LayerNorm."""

    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens)
        x = x + self.fc2(F.gelu(self.fc1(self.ln1(x))))
        return self.head(self.ln_f(x))


def make_model(seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():  # LayerNorms away from their (1, 0) init, so weight decay shows on them
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(device=device, dtype=dtype)


def batches(
    count: int, batch: int = 8, seq: int = 12, seed: int = 1, device: str | torch.device = "cpu"
) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (batch, seq), generator=g).to(device) for _ in range(count)]


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def unique_trainable(groups: list[list[Tensor]]) -> list[Tensor]:
    seen: set[int] = set()
    out = []
    for ps in groups:
        for p in ps:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class GradTap:
    """Records each param's grad (summed in fp32 over backward passes) before the optimizer takes it.

    Post-accumulate-grad hooks run in registration order: build this before the optimizer.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.sums: dict[int, Tensor] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, p: Tensor) -> None:
        g = p.grad.detach().float()
        self.sums[id(p)] = self.sums[id(p)] + g if id(p) in self.sums else g.clone()

    def take(self) -> dict[int, Tensor]:
        sums, self.sums = self.sums, {}
        return sums


class AdamWOracle:
    """fp32 master copies of the bf16 params, stepped by torch.optim.AdamW(foreach=False)."""

    def __init__(self, groups: list[dict[str, Any]], **defaults: Any) -> None:
        self.masters: dict[int, Tensor] = {}
        torch_groups = []
        for group in groups:
            ps = []
            for p in group["params"]:
                if p.requires_grad and id(p) not in self.masters:
                    self.masters[id(p)] = p.detach().cpu().float().clone().requires_grad_()
                    ps.append(self.masters[id(p)])
            torch_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ps})
        self.opt = torch.optim.AdamW(torch_groups, foreach=False, **defaults)

    def step(self, grads: dict[int, Tensor], max_norm: float | None = None) -> float | None:
        for key, master in self.masters.items():
            master.grad = grads[key].cpu().clone()
        norm = None
        if max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(list(self.masters.values()), max_norm))
        self.opt.step()
        return norm

    def step_some(self, grads: dict[int, Tensor]) -> None:
        """A step in which only the params in ``grads`` have a grad (the others are skipped, as torch does)."""
        for key, master in self.masters.items():
            master.grad = grads[key].cpu().clone() if key in grads else None
        self.opt.step()

    def master(self, p: Tensor) -> Tensor:
        return self.masters[id(p)].detach()


def assert_matches_oracle(opt: Any, params: list[Tensor], oracle: AdamWOracle) -> None:
    """Masters within the derived tolerance; device weights = the masters rounded to bf16."""
    mismatched = total = 0
    for p, mine in zip(params, opt.master_weights()):
        ref = oracle.master(p)
        torch.testing.assert_close(mine.float(), ref, rtol=MASTER_RTOL, atol=MASTER_ATOL)
        weights = p.detach().cpu()
        assert torch.equal(weights, mine.to(torch.bfloat16)), "device weights are not the masters rounded to bf16"
        mismatched += int((weights != ref.to(torch.bfloat16)).sum())
        total += p.numel()
    # A master within 1e-5 of a bf16 rounding boundary may round the other way; that is rare.
    assert mismatched <= total * 1e-3, f"{mismatched} of {total} bf16 weights differ from the oracle's"


class FailingBackward(torch.autograd.Function):
    """Identity whose backward calls ``FailingBackward.fail(grad)`` while it is set: a backward that raises half-way."""

    fail: Callable[[Tensor], None] | None = None

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if FailingBackward.fail is not None:
            FailingBackward.fail(grad)
        return grad


def loss_failing_midway(model: TinyLM, tokens: Tensor) -> Tensor:
    """``lm_loss`` with a ``FailingBackward`` after the embedding: the grads above it are packed before it fails."""
    x = FailingBackward.apply(model.emb(tokens[:, :-1]))
    x = x + model.fc2(F.gelu(model.fc1(model.ln1(x))))
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reentrant_checkpointed_loss(model: TinyLM, tokens: Tensor) -> Tensor:
    """The MLP block run twice under reentrant checkpointing: its params get grads in two nested backwards."""
    from torch.utils.checkpoint import checkpoint

    def block(x: Tensor) -> Tensor:
        return x + model.fc2(F.gelu(model.fc1(model.ln1(x))))

    x = model.emb(tokens[:, :-1])
    x = checkpoint(block, x, use_reentrant=True)
    x = checkpoint(block, x, use_reentrant=True)
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class CopyingCPU(DeviceOps):
    """The CPU treated like a GPU: separate staging areas, copies down, weights uploaded."""

    @property
    def host_addressable(self) -> bool:
        return False
