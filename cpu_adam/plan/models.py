"""What the planner needs of a model: the shapes of the params the optimizer trains, per param group.

A model is given as a parameter count, a Hugging Face ``config.json`` (GPT-2 and Llama-style
configs are read here; other ``model_type``s are built on the meta device by ``transformers``
where it is installed), or from Python as an ``nn.Module`` or what ``OffloadOptimizer`` takes
(params or param groups).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from torch import Tensor, nn

from ..offload.params import param_groups
from .sizes import PlanError, parse_count

__all__ = ["ModelSpec", "from_config", "model_spec"]

Shape = tuple[int, ...]
ModelLike = Union[int, str, os.PathLike, nn.Module, Iterable[Any], "ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    groups: list[list[Shape]]  # the trainable params (tied ones once) of each param group, in order
    frozen: int  # elements of params that are not trained: on the device, not in the optimizer
    source: str  # how the model was read, for the table's header
    count: int | None = None  # a bare count, without shapes (``groups`` is then empty)
    # Elements of each FSDP2 unit as frameworks wrap a causal LM (each decoder layer; the embedding; the final
    # norm with the head, and the embedding there too where it is tied; the root's leftovers); () where unknown.
    units: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        """False for a bare count: each param's padding, and how large the largest is, are unknown."""
        return self.count is None

    @property
    def params(self) -> int:
        return self.count if self.count is not None else sum(math.prod(s) for g in self.groups for s in g)


def model_spec(model: ModelLike) -> ModelSpec:
    """A count (int, or a string such as '1.3B'), a config.json path, an nn.Module, or params / param groups."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        return _from_params(model.parameters(), type(model).__name__)
    if isinstance(model, (int, str)) and not isinstance(model, bool):
        is_path = isinstance(model, str) and (model.endswith(".json") or os.sep in model or Path(model).exists())
        if not is_path:
            return ModelSpec([], 0, "a parameter count", count=parse_count(model))
    if isinstance(model, (str, os.PathLike)):
        return from_config(model)
    if isinstance(model, Iterable):
        return _from_params(model, "the given params")
    raise PlanError(
        f"cpu_adam.plan: a model is a parameter count (e.g. '1.3B'), a config.json path or an nn.Module, "
        f"got a {type(model).__name__}"
    )


def _from_params(params: Iterable[Any], name: str) -> ModelSpec:
    try:
        groups = param_groups(params)
    except (ValueError, TypeError, KeyError) as error:
        raise PlanError(f"cpu_adam.plan: {name} are not params or param groups: {error}") from None
    trainable, frozen, seen = [], 0, set()
    for group in groups:
        ps = [p for p in group["params"] if isinstance(p, Tensor)]
        if len(ps) != len(group["params"]):
            raise PlanError(f"cpu_adam.plan: {name} hold something that is not a tensor")
        trainable.append([tuple(p.shape) for p in ps if p.requires_grad])
        frozen += sum(p.numel() for p in ps if not p.requires_grad and id(p) not in seen)
        seen.update(id(p) for p in ps)
    spec = ModelSpec(trainable, frozen, name)
    if spec.params == 0:
        raise PlanError(f"cpu_adam.plan: {name} have no param that requires grad: nothing to train")
    return spec


# -- config.json ----------------------------------------------------------------------------

_GPT2_KEYS = ("n_embd", "n_layer", "vocab_size", "n_positions")
_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
LLAMA_LIKE = {"llama": False, "mistral": False, "qwen2": True}  # model_type: whether q, k, v have biases


def from_config(path: str | os.PathLike) -> ModelSpec:
    """The params of a Hugging Face causal LM from its config.json (a file, or the folder holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except OSError as error:
        raise PlanError(
            f"cpu_adam.plan: cannot read {file} ({error.strerror or error}); pass the path of a Hugging Face "
            "config.json or of the folder holding it"
        ) from None
    except json.JSONDecodeError as error:
        raise PlanError(f"cpu_adam.plan: {file} is not JSON ({error}); pass a Hugging Face config.json") from None
    if not isinstance(config, dict):
        raise PlanError(f"cpu_adam.plan: {file} holds a JSON {type(config).__name__}, not a config object")
    kind = config.get("model_type") or ("gpt2" if "n_embd" in config else "llama" if "hidden_size" in config else None)
    if kind == "gpt2":
        shapes, layers = _gpt2(_need(config, _GPT2_KEYS, file, kind), config), config["n_layer"]
        tied = config.get("tie_word_embeddings", True)
    elif kind in LLAMA_LIKE:
        shapes = _llama(_need(config, _LLAMA_KEYS, file, kind), config, LLAMA_LIKE[kind], file)
        layers, tied = config["num_hidden_layers"], config.get("tie_word_embeddings", False)
    else:
        return _from_transformers(file, kind)
    return ModelSpec([shapes], 0, f"{file.name} ({kind})", units=_units(shapes, layers, kind == "gpt2", tied))


def _units(shapes: list[Shape], layers: int, positions: bool, tied: bool) -> tuple[int, ...]:
    """The FSDP2 units of the shapes ``_gpt2`` / ``_llama`` list: [embedding, (position embedding,) layers...,
    final norm (and head)]. A tied embedding joins the final norm's unit (its weight is the head's)."""
    sizes = [math.prod(s) for s in shapes]
    first = 2 if positions else 1  # where the layers start
    tail_start = len(shapes) - (2 if positions else 1) - (0 if tied else 1)  # the final norm (GPT-2's has a bias)
    block = (tail_start - first) // layers
    per_layer = [sum(sizes[first + i * block : first + (i + 1) * block]) for i in range(layers)]
    tail = sum(sizes[tail_start:])
    root = [sizes[1]] if positions else []  # the position embedding stays with the root
    if tied:
        return (*per_layer, sizes[0] + tail, *root)
    return (sizes[0], *per_layer, tail, *root)


def _need(config: dict[str, Any], keys: tuple[str, ...], file: Path, kind: str) -> list[int]:
    missing = [k for k in keys if not _positive_int(config.get(k))]
    if missing:
        got = ", ".join(f"{k}={config[k]!r}" for k in missing if k in config)
        raise PlanError(
            f"cpu_adam.plan: {file} ({kind}) lacks {', '.join(missing)}{f' (has {got})' if got else ''}: a {kind} "
            f"config needs positive whole numbers for {', '.join(keys)}. Fix the file, or pass the parameter count "
            "instead (--params 1.3B)"
        )
    return [config[k] for k in keys]


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _gpt2(keys: list[int], config: dict[str, Any]) -> list[Shape]:
    d, layers, vocab, positions = keys
    inner = config.get("n_inner") or 4 * d
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, inner), (inner,), (inner, d), (d,)]
    head = [] if config.get("tie_word_embeddings", True) else [(vocab, d)]
    return [(vocab, d), (positions, d), *block * layers, (d,), (d,), *head]


def _llama(keys: list[int], config: dict[str, Any], qkv_bias: bool, file: Path) -> list[Shape]:
    d, inner, layers, heads, vocab = keys
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or d // heads
    if not (_positive_int(kv) and _positive_int(head_dim)) or (not config.get("head_dim") and d % heads):
        raise PlanError(
            f"cpu_adam.plan: {file}: hidden_size {d}, num_attention_heads {heads}, num_key_value_heads {kv} give "
            "no whole head size; fix the file (or give head_dim), or pass the parameter count (--params 7B)"
        )
    bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)

    def linear(out: int, inp: int, with_bias: bool) -> list[Shape]:
        return [(out, inp), (out,)] if with_bias else [(out, inp)]

    q, k = heads * head_dim, kv * head_dim
    attention = linear(q, d, bias or qkv_bias) + 2 * linear(k, d, bias or qkv_bias) + linear(d, q, bias)
    mlp = 2 * linear(inner, d, mlp_bias) + linear(d, inner, mlp_bias)
    head = [] if config.get("tie_word_embeddings", False) else [(vocab, d)]
    return [(vocab, d), *(attention + mlp + [(d,), (d,)]) * layers, (d,), *head]


def _from_transformers(file: Path, kind: str | None) -> ModelSpec:
    known = ", ".join(["gpt2", *LLAMA_LIKE])
    try:
        import torch
        import transformers
    except ImportError:
        raise PlanError(
            f"cpu_adam.plan: {file} has model_type {kind!r}, which the planner reads only through transformers "
            f"(it reads {known} itself): pip install transformers, pass the parameter count (--params 7B), or pass "
            "the model from Python, cpu_adam.plan.plan(model)"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(file))
        with torch.device("meta"):  # shapes only, no memory
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = transformers.AutoModel.from_config(config)
    except Exception as error:  # transformers' own refusal, whatever it raises
        raise PlanError(
            f"cpu_adam.plan: transformers cannot build a model from {file} ({type(error).__name__}: {error}); "
            "pass the parameter count (--params 7B) or the model from Python"
        ) from None
    spec = _from_params(model.parameters(), type(model).__name__)
    return ModelSpec(spec.groups, spec.frozen, f"{file.name} ({kind}, built by transformers)")
