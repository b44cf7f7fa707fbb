"""Packed shared-prefix attention: each prefix's keys computed once and read by every row that
continues it, never copied per row, and no padding (docs/design.md#shared-prefix-evaluation).

The copying way to continue a prefix (transformers' cache, its rows repeated over the batch) costs
a copy of the prefix's keys per row and per layer, an attention over ``prefix + suffix`` with an
explicit mask (which keeps the fused kernels away), and the padding of every row to the batch's
longest. Here a forward is *packed*: its sequences (prefixes in a prefix forward, suffixes in a
suffix forward) are laid end to end as one ``[1, tokens]`` row, position ids restarting or
continuing per sequence, and attention is split at the prefix:

* **own part**: each sequence's queries against its own keys, causal; one variable-length fused
  call (flash ``cu_seqlens``) where torch has one, else one call per sequence;
* **prefix part** (suffix forwards): the queries of all rows continuing one prefix (adjacent in
  the packed row) against that prefix's keys, no mask (every suffix token sees the whole
  prefix): one fused call per prefix, its keys read once, not copied;
* the two combined exactly by their log-sum-exps, as split-KV attention kernels do.

A prefix forward also *captures* every layer's keys and values for the suffix forwards. It all
goes through transformers' attention-function hook: :data:`ATTENTION_NAME` is registered in
``AttentionInterface`` (and deliberately not in the mask interface, so transformers builds no
mask), and :func:`packed` switches the model's ``config._attn_implementation`` to it for one
forward. Which models qualify is a table (:data:`PACKED_MODEL_TYPES`): those whose every attention
layer is softmax attention through that hook. Kimi Linear's linear-attention layers keep a
recurrent state instead of keys, so it continues from transformers' cache (:mod:`.runner`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

__all__ = ["ATTENTION_NAME", "PACKED_MODEL_TYPES", "PrefixKeys", "attention_with_lse", "packed", "packed_support",
           "shares_prefix_keys"]

ATTENTION_NAME = "nemo_moe_export_packed_prefix"

PACKED_MODEL_TYPES = frozenset({"deepseek_v3", "qwen3_moe"})
"""``config.model_type`` of models whose every attention layer is softmax attention through
transformers' attention-function hook, with ``module.layer_idx`` (DeepSeek-V3 and Kimi K2 share
``deepseek_v3``). Sliding-window configurations are excluded (:func:`packed_support`)."""


@dataclass
class PrefixKeys:
    """Keys and values a packed prefix forward computed, per attention layer (``[1, kv_heads,
    tokens, dim]``); prefix ``s`` is tokens ``starts[s]:starts[s + 1]``."""

    starts: tuple[int, ...]
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def of(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layers[layer]
        start, stop = self.starts[slot], self.starts[slot + 1]
        return keys[:, :, start:stop], values[:, :, start:stop]


@dataclass(frozen=True)
class _Packed:
    """One packed forward: sequence ``i`` is tokens ``starts[i]:starts[i + 1]``; ``groups`` are
    ``(first token, stop token, slot)`` runs that continue prefix ``slot`` of ``prefix``."""

    starts: tuple[int, ...]
    capture: PrefixKeys | None
    prefix: PrefixKeys | None
    groups: tuple[tuple[int, int, int], ...]


_ACTIVE: contextvars.ContextVar[_Packed | None] = contextvars.ContextVar("packed_prefix", default=None)


def shares_prefix_keys(model: Any) -> bool:
    """Whether shared prefixes of ``model`` are evaluated packed, their keys shared (else the cache is copied)."""
    return packed_support(model) is None


def packed_support(model: Any) -> str | None:
    """Why ``model`` cannot run packed forwards with shared prefix keys, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKED_MODEL_TYPES:
        return f"model_type {model_type!r} is not in PACKED_MODEL_TYPES"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    return _register()


@contextmanager
def packed(model: Any, lengths: Sequence[int], *, capture: PrefixKeys | None = None,
           prefix: PrefixKeys | None = None, slots: Sequence[int] = ()) -> Iterator[None]:
    """One forward of sequences of ``lengths`` tokens packed into one row: with ``capture``, a
    prefix forward keeping its keys; with ``prefix``, a suffix forward whose sequence ``i``
    continues prefix ``slots[i]`` (one prefix's sequences adjacent: the runner orders them so)."""
    starts = tuple(accumulate(lengths, initial=0))
    groups: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if groups and groups[-1][2] == slot:
            groups[-1] = (groups[-1][0], starts[i + 1], slot)
        else:
            groups.append((starts[i], starts[i + 1], slot))
    if len({g[2] for g in groups}) != len(groups):
        raise RuntimeError(f"sequences of one prefix are not adjacent: slots {list(slots)}; runner bug")
    config = model.config
    before = config._attn_implementation
    token = _ACTIVE.set(_Packed(starts, capture, prefix, tuple(groups)))
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        _ACTIVE.reset(token)


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [1, H, T, D]`` -> ``([1, T, H, Dv], None)``."""
    state = _ACTIVE.get()
    if state is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran outside packed()")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise RuntimeError("packed shared-prefix attention does no sliding windows or softcapping; "
                           "evaluate with shared_prefix=False")
    if state.capture is not None:
        state.capture.layers[module.layer_idx] = (key, value)
    heads = query.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, lse = _own_attention(query, _heads(key, heads), _heads(value, heads), state.starts, scale)
    for start, stop, slot in state.groups:
        prefix_keys, prefix_values = state.prefix.of(module.layer_idx, slot)
        p_out, p_lse = attention_with_lse(query[:, :, start:stop].contiguous(), _heads(prefix_keys, heads),
                                          _heads(prefix_values, heads), scale, causal=False)
        out[:, :, start:stop] = _merged(out[:, :, start:stop], lse[:, :, start:stop], p_out, p_lse)
    return out.transpose(1, 2).contiguous(), None


def _own_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: tuple[int, ...],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed sequence's causal attention over itself: ``([1, H, T, Dv], [1, H, T])``."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return _varlen_flash(query, key, value, starts, scale)
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
    for start, stop in zip(starts, starts[1:]):
        out[:, :, start:stop], lse[:, :, start:stop] = attention_with_lse(
            query[:, :, start:stop].contiguous(), key[:, :, start:stop], value[:, :, start:stop], scale, causal=True)
    return out, lse


def _varlen_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: tuple[int, ...],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention's variable-length form (``cu_seqlens``): one kernel for every sequence."""
    v_dim = value.shape[-1]
    value = _padded_to(value, key.shape[-1])
    cu = torch.tensor(starts, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, D]
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                       scale=scale)[:2]
    return out[..., :v_dim].transpose(0, 1).unsqueeze(0), lse.float().reshape(1, *lse.shape[-2:])


def _merged(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys ``a + b`` from the parts over ``a`` and over ``b`` (fp32 weights)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)
    return ((out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)).to(out_a.dtype)


def _heads(states: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values repeated to the query's heads (as transformers' ``repeat_kv``)."""
    kv_heads = states.shape[1]
    if kv_heads == heads:
        return states
    b, _, length, dim = states.shape
    return states[:, :, None].expand(b, kv_heads, heads // kv_heads, length, dim).reshape(b, heads, length, dim)


def _padded_to(value: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero columns up to the keys' head size (flash kernels want one head size; zeros add nothing)."""
    return torch.nn.functional.pad(value, (0, dim - value.shape[-1])) if value.shape[-1] < dim else value


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, Lq, Dv], logsumexp [B, H, Lq] fp32)`` of softmax attention, from a fused kernel
    where torch has one that returns the log-sum-exp (flash on CUDA in half precision, flash on CPU),
    else computed in plain torch. ``causal`` aligns query ``i`` with key ``i`` (``Lq == Lk``)."""
    v_dim = value.shape[-1]
    value = _padded_to(value, key.shape[-1])
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                      scale=scale)[:2]
    elif query.device.type == "cpu" and value.shape[-1] == key.shape[-1]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                              scale=scale)
    else:
        out, lse = _math_attention_with_lse(query, key, value, scale, causal)
    return out[..., :v_dim], lse.float()


def _math_attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if causal:
        length = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1),
                                    float("-inf"))
    lse = scores.logsumexp(-1)
    return (torch.exp(scores - lse.unsqueeze(-1)) @ value.float()).to(query.dtype), lse


def _register() -> str | None:
    """Register the attention function under :data:`ATTENTION_NAME` (idempotent); why it cannot be, or None."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:  # a transformers without the attention-function hook
        return f"transformers has no attention-function registry ({exc})"
    AttentionInterface.register(ATTENTION_NAME, _packed_attention)
    return None
