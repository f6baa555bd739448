"""A tiny random GPT-2 (built here, nothing downloaded) and token data, for the framework tests."""

from __future__ import annotations

import torch
from torch import Tensor

VOCAB = 64
SEQ = 16


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: a resumed run draws no random numbers the straight one did not
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(dtype)


def token_batches(count: int, batch: int = 4, seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (batch, SEQ), generator=g) for _ in range(count)]


class TokenDataset(torch.utils.data.Dataset):
    """Language-model examples: the labels are the inputs (the model shifts them)."""

    def __init__(self, count: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(VOCAB, (count, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}
