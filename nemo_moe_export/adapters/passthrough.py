"""Pass-through tensors: checkpoint tensors the model has no parameter for, kept sliced, written back.

An official DeepSeek-V3 checkpoint carries its multi-token-prediction (MTP) layer as
``model.layers.{num_hidden_layers}.*``; transformers has no module for it and ignores those keys,
so load -> train -> export would drop the layer vLLM and SGLang use for speculative decoding.
``StateDictAdapter.from_hf`` keeps such tensors instead: each rank of the export group reads only
its ``torch.chunk`` slice of dim 0 (:func:`read_passthrough`, through the same sliced reads as the
model's tensors), so no rank holds a whole tensor, and the export writes the slices back under
their names, bit-exact in their own dtype (docs/design.md#pass-through-tensors).

:func:`extra_pieces` is the export's side: it turns what a caller hands ``export_hf_checkpoint(...,
extra=)`` (these slices, or plain tensors / DTensors that live outside the model's state dict) into
pieces the plan and writer treat like the model's own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.adapters.protocol import HFShard, TensorMeta
from nemo_moe_export.errors import InputError
from nemo_moe_export.placement import get_sharded_expert_range, local_box

__all__ = ["extra_metadata", "extra_pieces", "group_place", "read_passthrough", "split_extra_keys"]

_EXPERT_KEY = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.")


def split_extra_keys(extra: Iterable[str], expected: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(kept, misfits)`` of the checkpoint keys the model has no place for.

    A misfit is a per-expert key of an MoE layer the model has (an expert id beyond the config's
    count): the config is wrong, so it is never passed through. Everything else is kept.
    """
    layers = {m["layer"] for key in expected if (m := _EXPERT_KEY.match(key))}
    kept, misfits = [], []
    for key in sorted(extra):
        m = _EXPERT_KEY.match(key)
        (misfits if m is not None and m["layer"] in layers else kept).append(key)
    return kept, misfits


def group_place(group: Any = None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (default: the world; ``(0, 1)`` alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _stored_meta(src: Any, key: str) -> TensorMeta:
    """Shape and the dtype a read returns: FP8 block-quantized weights come back dequantized (fp32)."""
    meta = src.meta(key)
    if getattr(src, "dequantizes", lambda _: False)(key):
        return TensorMeta(meta.shape, torch.float32)
    return meta


def read_passthrough(src: Any, keys: Iterable[str], place: tuple[int, int]) -> dict[str, HFShard]:
    """``{key: HFShard}``: this rank's chunk-rule slice of dim 0 of each tensor (``place`` is
    ``(rank, size)`` in the export group). A 0-dim tensor is held by rank 0; a rank whose slice is
    empty holds an empty tensor of the right dtype, so every rank knows every key's dtype."""
    rank, size = place
    out = {}
    for key in sorted(keys):
        meta = _stored_meta(src, key)
        if not meta.shape:
            tensor = src.read(key, (), ()) if rank == 0 else torch.empty(0, dtype=meta.dtype)
            out[key] = HFShard(key, (), (), tensor, True, key)
            continue
        start, end = get_sharded_expert_range(meta.shape[0], size, rank)
        offsets, shape = (start,) + (0,) * (len(meta.shape) - 1), (end - start, *meta.shape[1:])
        tensor = (src.read(key, offsets, shape).to(meta.dtype) if end > start
                  else torch.empty(shape, dtype=meta.dtype))
        out[key] = HFShard(key, tuple(meta.shape), offsets, tensor, True, key)
    return out


def extra_pieces(extra: Mapping[str, Any], plain_replica: tuple[int, int]) -> dict[str, HFShard]:
    """``{hf_key: HFShard}`` for tensors handed to the export beside the model's state dict.

    An ``HFShard`` (what ``from_hf`` kept) is taken as it is; a plain tensor is a whole tensor held
    by every rank of the export group (``plain_replica``: this rank's place in it); a DTensor is
    read through its own placements. Names are HF names, written as they are.
    """
    out = {}
    for key, value in extra.items():
        if isinstance(value, HFShard):
            if value.key != key:
                raise InputError("an extra tensor is filed under another name", key=key,
                                 expected=f"the piece's own key {value.key!r}", actual=repr(key))
            out[key] = value
        elif torch.is_tensor(value):
            box = local_box(value, key=key, plain_replica=plain_replica)
            out[key] = HFShard(key, box.global_shape, box.offsets, box.local, box.primary, key,
                               replica=box.replica, replicas=box.replicas)
        else:
            raise InputError("extra tensors must be tensors, DTensors or HFShards", key=key,
                             expected="torch.Tensor | DTensor | HFShard", actual=type(value).__name__)
    return out


def extra_metadata(pieces: Mapping[str, HFShard]) -> dict[str, TensorMeta]:
    """Global shape and dtype of each extra piece (the same on every rank)."""
    return {key: TensorMeta(tuple(p.global_shape), p.tensor.dtype) for key, p in pieces.items()}
