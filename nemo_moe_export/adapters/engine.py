"""The one engine that maps a (possibly sharded) in-memory state dict to Hugging Face keys and back.

Everything model-specific lives in a :class:`ModelTable` (see ``tables.py``): an ordered list of
:class:`KeyRule` s. A rule says how one in-memory tensor becomes one or more HF tensors: renamed,
split into equal parts along one dim, split per expert along dim 0, and/or transposed. Keys no rule
matches keep their name (transformers 5 saves most keys as they are in memory).

The engine works on *boxes*: the part of a global tensor a rank holds (``layout.local_box``). A
rule maps an in-memory box to at most one box per HF tensor, and the local tensor of that HF box is
a view of the rank's shard. The same mapping serves both directions:

* ``to_hf``  returns those views (nothing is copied);
* ``from_hf`` copies exactly those boxes out of the HF files into the views (``get_slice`` reads
  only the bytes a rank needs).

The global key list and shapes (``hf_metadata``) derive from global shapes only, so every rank
computes the same answer without communicating; validation uses it, so every rank raises the same
error before anything is touched.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_moe_export.adapters.fp8 import open_source
from nemo_moe_export.adapters.sources import TensorDictSource, TensorMeta
from nemo_moe_export.errors import ExportInputError, current_rank
from nemo_moe_export.layout import LocalBox, local_box

__all__ = ["HFShard", "KeyRule", "LoadReport", "ModelTable", "StateDictAdapter", "expert_rules"]


# --------------------------------------------------------------------------------------------------
# Declarative tables
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyRule:
    """How in-memory keys matching ``source`` become HF keys.

    ``source`` is a regex matched against the whole in-memory key; ``targets`` are ``str.format``
    templates over its named groups (plus ``{expert}`` for per-expert rules). With several
    targets, the tensor (per expert, if ``per_expert``) is split into equal parts along
    ``split_dim``, one per target, in order. ``transpose`` means the HF tensor is the transpose of
    the 2-D part. ``group`` names rules that must appear together for the same ``prefix`` group
    (an MoE layer needs both its gate/up and its down tensor).
    """

    source: str
    targets: tuple[str, ...]
    per_expert: bool = False
    split_dim: int = 0
    transpose: bool = False
    group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", re.compile(self.source))

    def match(self, key: str) -> re.Match[str] | None:
        return self._pattern.fullmatch(key)  # type: ignore[attr-defined]


def expert_rules(
    experts: str, hf_experts: str, *, gate: str, up: str, down: str
) -> tuple[KeyRule, ...]:
    """Rules for one experts module in both in-memory layouts, to per-expert HF keys.

    ``experts`` is a regex for the in-memory module path with a named group ``prefix``;
    ``hf_experts`` the HF module path template. Layouts:

    * transformers 5 fused: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I];
    * NeMo AutoModel grouped: ``gate_and_up_projs`` [E, H, 2I] (gate columns first; HF
      ``gate = [e, :, :I].T``), ``down_projs`` [E, I, H] (HF ``down = [e].T``).
    """
    per = f"{hf_experts}.{{expert}}"
    gate_t, up_t, down_t = f"{per}.{gate}.weight", f"{per}.{up}.weight", f"{per}.{down}.weight"
    return (
        KeyRule(rf"{experts}\.gate_up_proj", (gate_t, up_t), per_expert=True, split_dim=0, group="fused"),
        KeyRule(rf"{experts}\.down_proj", (down_t,), per_expert=True, group="fused"),
        KeyRule(
            rf"{experts}\.gate_and_up_projs", (gate_t, up_t), per_expert=True, split_dim=1,
            transpose=True, group="grouped",
        ),
        KeyRule(rf"{experts}\.down_projs", (down_t,), per_expert=True, transpose=True, group="grouped"),
    )


@dataclass(frozen=True)
class ModelTable:
    """Everything the engine needs to know about one model family.

    ``rules`` are tried in order, first match wins; unmatched keys keep their name.
    ``num_experts_fields`` are config attributes naming the routed-expert count, tried in order.
    ``tied_keys`` are in-memory keys that alias another tensor when the config ties word
    embeddings; transformers writes them once, so the engine skips them.
    """

    model_types: tuple[str, ...]
    rules: tuple[KeyRule, ...]
    num_experts_fields: tuple[str, ...]
    tied_keys: tuple[str, ...] = ("lm_head.weight",)
    description: str = ""


# --------------------------------------------------------------------------------------------------
# What the engine returns
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFShard:
    """One rank's part of one HF tensor.

    ``tensor`` is a view of the rank's own shard (HF orientation; possibly non-contiguous when
    the in-memory layout is transposed relative to HF). It covers ``offsets[d] : offsets[d] +
    tensor.shape[d]`` of a tensor of ``global_shape``. ``primary`` is True on exactly one of the
    ranks holding this same part, so writing only primaries writes each byte once.
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    primary: bool
    source_key: str
    expert: int | None = None

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.global_shape


@dataclass
class LoadReport:
    """What ``from_hf`` read on this rank."""

    bytes_read: int = 0
    expert_bytes_read: int = 0
    slices_read: int = 0
    keys_filled: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


def _plain_is_primary() -> bool:
    rank = current_rank()
    return rank is None or rank == 0


class StateDictAdapter:
    """Maps a model family's in-memory state dict to HF per-expert keys and back, for any sharding.

    Build it from the model's HF config (``get_adapter(config)`` picks the table by
    ``model_type``). DTensors are read through their own placements; plain tensors are taken as
    whole tensors present on every rank (rank 0 is their primary).
    """

    def __init__(self, config: Any, table: ModelTable) -> None:
        self.config = config
        self.table = table
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_experts = self._read_num_experts(text)
        self.tie_word_embeddings = bool(_cfg_get(config, "tie_word_embeddings", False))

    def _read_num_experts(self, config: Any) -> int:
        for name in self.table.num_experts_fields:
            value = _cfg_get(config, name, None)
            if value is not None:
                return int(value)
        raise ExportInputError(
            "config does not say how many routed experts the model has",
            key=str(_cfg_get(config, "model_type", "?")),
            expected=f"one of the config fields {list(self.table.num_experts_fields)}",
            actual="none set",
        )

    # ---- the pure part: rules, global metadata, validation ------------------------------------

    def _rule_for(self, key: str) -> tuple[KeyRule | None, re.Match[str] | None]:
        for rule in self.table.rules:
            m = rule.match(key)
            if m is not None:
                return rule, m
        return None, None

    def _skipped(self, key: str) -> bool:
        return self.tie_word_embeddings and key in self.table.tied_keys

    def _entries(self, state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, KeyRule | None, re.Match[str] | None]]:
        for key, tensor in state_dict.items():
            if self._skipped(key):
                continue
            rule, m = self._rule_for(key)
            yield key, tensor, rule, m

    def hf_metadata(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        """Every HF key the model maps to, with its global shape and dtype.

        Uses global shapes only, so it is the same on every rank with no communication. Raises on
        malformed expert tensors (wrong count, odd gate/up size, mismatched siblings).
        """
        self._validate(state_dict)
        out: dict[str, TensorMeta] = {}
        for key, tensor, rule, m in self._entries(state_dict):
            shape = tuple(tensor.shape)
            if rule is None:
                self._add_meta(out, key, TensorMeta(shape, tensor.dtype), key)
                continue
            part_shape = _part_shape(rule, shape)
            experts = range(shape[0]) if rule.per_expert else [None]
            for e in experts:
                for template in rule.targets:
                    self._add_meta(out, _target(template, m, e), TensorMeta(part_shape, tensor.dtype), key)
        return out

    @staticmethod
    def _add_meta(out: dict[str, TensorMeta], hf_key: str, meta: TensorMeta, source_key: str) -> None:
        if hf_key in out:
            raise ExportInputError(
                "two in-memory tensors map to the same HF key", key=hf_key,
                expected="one source", actual=f"a second one, '{source_key}'",
                hint="the state dict likely holds the same weight under two layouts (fused and grouped)",
            )
        out[hf_key] = meta

    def _validate(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Refuse malformed expert tensors and MoE layers missing part of their layout."""
        layers: dict[tuple[str, str], dict[str, torch.Tensor]] = defaultdict(dict)
        for key, tensor, rule, m in self._entries(state_dict):
            if rule is None:
                continue
            self._check_rule_shape(key, rule, tuple(tensor.shape))
            if rule.group is not None:
                layers[(rule.group, m.group("prefix"))][rule.source] = tensor
        for (group, prefix), found in layers.items():
            self._check_layer_complete(group, prefix, found)
            self._check_expert_siblings(group, prefix, found)

    def _check_rule_shape(self, key: str, rule: KeyRule, shape: tuple[int, ...]) -> None:
        """A tensor can take its rule: 3-D with the config's expert count when per expert, divisible
        into the rule's parts, 2-D per part when transposed."""
        if rule.per_expert:
            if len(shape) != 3:
                raise ExportInputError(
                    "stacked expert tensor must be 3-D [experts, rows, cols]", key=key,
                    expected="3 dims", actual=f"shape {shape}",
                )
            if shape[0] != self.num_experts:
                raise ExportInputError(
                    "expert count in the tensor disagrees with the config", key=key,
                    expected=f"{self.num_experts} experts (config)", actual=f"{shape[0]} (shape {shape})",
                    hint="build the adapter from the config the model was created with",
                )
        inner = shape[1:] if rule.per_expert else shape
        parts = len(rule.targets)
        if parts > 1 and (len(inner) <= rule.split_dim or inner[rule.split_dim] % parts):
            raise ExportInputError(
                f"cannot split into {parts} equal parts along dim {rule.split_dim}",
                key=key, expected=f"a size divisible by {parts}", actual=f"shape {shape}",
            )
        if rule.transpose and len(inner) != 2:
            raise ExportInputError("transposed tensor must be 2-D per part", key=key,
                                   expected="2 dims", actual=f"shape {inner}")

    def _check_layer_complete(self, group: str, prefix: str, found: dict[str, torch.Tensor]) -> None:
        """An MoE layer has every tensor of its layout (both gate/up and down)."""
        needed = [r.source for r in self.table.rules if r.group == group]
        if any(s not in found for s in needed):
            raise ExportInputError(
                "MoE layer is missing an expert tensor", key=prefix,
                expected=f"keys matching {needed}", actual=f"only {sorted(found)}",
            )

    def _check_expert_siblings(self, group: str, prefix: str, found: dict[str, torch.Tensor]) -> None:
        metas = []
        for source, tensor in found.items():
            rule = next(r for r in self.table.rules if r.source == source)
            metas.append((rule, _part_shape(rule, tuple(tensor.shape)), tensor.dtype))
        gate_shape = next(s for r, s, _ in metas if len(r.targets) == 2)
        down_shape = next(s for r, s, _ in metas if len(r.targets) == 1)
        if tuple(reversed(down_shape)) != gate_shape:
            raise ExportInputError(
                "expert down projection does not match gate/up", key=prefix,
                expected=f"down {tuple(reversed(gate_shape))} for gate/up {gate_shape} (HF orientation)",
                actual=f"down {down_shape}",
            )
        dtypes = {d for _, _, d in metas}
        if len(dtypes) > 1:
            raise ExportInputError("expert tensors of one layer differ in dtype", key=prefix,
                                   expected="one dtype", actual=sorted(map(str, dtypes)))

    # ---- to_hf / from_hf ------------------------------------------------------------------------

    def _pieces(self, state_dict: Mapping[str, torch.Tensor]) -> Iterator[HFShard]:
        plain_primary = _plain_is_primary()
        for key, tensor, rule, m in self._entries(state_dict):
            box = local_box(tensor, key=key, plain_is_primary=plain_primary)
            if rule is None:
                if not box.is_empty or (box.primary and math.prod(box.global_shape) == 0):
                    yield HFShard(key, box.global_shape, box.offsets, box.local, box.primary, key)
                continue
            yield from _rule_pieces(key, rule, m, box)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, HFShard]:
        """The HF tensors (or parts of them) this rank holds, keyed by HF name, as views.

        Per-expert keys carry global expert ids. Nothing is copied: each ``HFShard.tensor`` is a
        view of the local shard. Ranks holding no part of a tensor (empty trailing FSDP shards)
        return no entry for it.
        """
        self._validate(state_dict)
        out: dict[str, HFShard] = {}
        for piece in self._pieces(state_dict):
            if piece.key in out:
                raise ExportInputError("two in-memory tensors map to the same HF key", key=piece.key,
                                       expected=out[piece.key].source_key, actual=piece.source_key)
            out[piece.key] = piece
        return out

    def from_hf(
        self,
        state_dict: Mapping[str, torch.Tensor],
        source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
        *,
        strict: bool = True,
        allow_dtype_cast: bool = False,
    ) -> LoadReport:
        """Fill ``state_dict`` (the model's own, possibly sharded, tensors) in place from HF weights.

        ``source`` is a checkpoint directory, a ``.safetensors`` file or an HF-keyed dict. Each rank
        reads only the slices it holds. Everything is checked first (missing keys, unexpected keys
        when ``strict``, shapes, dtypes unless ``allow_dtype_cast``); on any problem nothing is
        changed. Tied aliases (``lm_head.weight`` with tied embeddings) are filled through the
        tensor they alias. Official FP8 block-quantized checkpoints (``quantization_config`` in
        ``config.json``) are dequantized slice by slice into the model's dtype (``fp8.py``).
        """
        expected = self.hf_metadata(state_dict)
        src = TensorDictSource(source) if isinstance(source, Mapping) else open_source(source)
        try:
            self._check_source(expected, src, strict=strict, allow_dtype_cast=allow_dtype_cast)
            return _copy_boxes(list(self._pieces(state_dict)), src)
        finally:
            src.close()

    def _check_source(self, expected: dict[str, TensorMeta], src: Any, *, strict: bool,
                      allow_dtype_cast: bool) -> None:
        """Refuse, before anything is copied, a checkpoint whose keys, shapes or dtypes do not fit."""
        have = src.keys()
        missing = sorted(set(expected) - have)
        if missing:
            raise ExportInputError(
                f"{len(missing)} HF keys the model needs are missing from the checkpoint",
                key=missing[0], expected="present", actual=f"missing (all missing: {_preview(missing)})",
                hint="check that the checkpoint matches the config (expert count, layer count)",
            )
        extra = sorted(have - set(expected))
        if extra and strict:
            raise ExportInputError(
                f"{len(extra)} checkpoint keys have no place in the model",
                key=extra[0], expected=f"only the model's {len(expected)} keys",
                actual=f"also {_preview(extra)}",
                hint="an expert id beyond the config's count means the config is wrong; "
                "pass strict=False to ignore keys the model does not use",
            )
        for key, meta in expected.items():
            _check_stored_tensor(key, meta, src, allow_dtype_cast=allow_dtype_cast)


def _check_stored_tensor(key: str, meta: TensorMeta, src: Any, *, allow_dtype_cast: bool) -> None:
    """The stored tensor has the model's shape, and its dtype or one ``from_hf`` may convert from."""
    got = src.meta(key)
    if got.shape != meta.shape:
        raise ExportInputError("checkpoint tensor has the wrong shape", key=key,
                               expected=meta.shape, actual=got.shape)
    dequantized = getattr(src, "dequantizes", lambda _: False)(key)
    if dequantized and not meta.dtype.is_floating_point:
        raise ExportInputError("an FP8 weight can only fill a floating-point tensor", key=key,
                               expected="a floating-point model tensor", actual=meta.dtype)
    if got.dtype != meta.dtype and not dequantized and not (
        allow_dtype_cast and got.dtype.is_floating_point and meta.dtype.is_floating_point
    ):
        raise ExportInputError(
            "checkpoint tensor has the wrong dtype", key=key, expected=meta.dtype, actual=got.dtype,
            hint="pass allow_dtype_cast=True to cast floating-point weights to the model's dtype",
        )


def _copy_boxes(pieces: list[HFShard], src: Any) -> LoadReport:
    """Copy each piece's box out of ``src`` into the piece's view of the model's shard."""
    report = LoadReport()
    with torch.no_grad():
        for piece in pieces:
            before = src.bytes_read
            piece.tensor.copy_(src.read(piece.key, piece.offsets, tuple(piece.tensor.shape)))
            nbytes = src.bytes_read - before  # bytes taken from the checkpoint (FP8 + scales)
            report.bytes_read += nbytes
            report.slices_read += 1
            if piece.expert is not None:
                report.expert_bytes_read += nbytes
            report.keys_filled.append(piece.key)
    return report


# --------------------------------------------------------------------------------------------------
# Box arithmetic
# --------------------------------------------------------------------------------------------------


def _cfg_get(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _preview(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _target(template: str, m: re.Match[str], expert: int | None) -> str:
    return template.format(**m.groupdict(), expert=expert)


def _part_shape(rule: KeyRule, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Global shape of each HF tensor a rule makes from an in-memory tensor of ``shape``."""
    inner = list(shape[1:] if rule.per_expert else shape)
    if len(rule.targets) > 1:
        inner[rule.split_dim] //= len(rule.targets)
    return tuple(reversed(inner)) if rule.transpose else tuple(inner)


def _rule_pieces(key: str, rule: KeyRule, m: re.Match[str], box: LocalBox) -> Iterator[HFShard]:
    """Intersect this rank's box with each HF tensor the rule makes; yield views, not copies."""
    if rule.per_expert:
        first = box.offsets[0]
        items = [(first + i, box.local[i]) for i in range(box.local.shape[0])]
        inner_offsets = box.offsets[1:]
        inner_shape = box.global_shape[1:]
    else:
        items = [(None, box.local)]
        inner_offsets, inner_shape = box.offsets, box.global_shape
    n_parts, d = len(rule.targets), rule.split_dim
    part = inner_shape[d] // n_parts if inner_shape else 0
    for expert, local in items:
        if local.numel() == 0:
            continue
        for i, template in enumerate(rule.targets):
            if n_parts == 1:
                view, offsets, shape = local, inner_offsets, inner_shape
            else:
                lo = max(i * part, inner_offsets[d])
                hi = min((i + 1) * part, inner_offsets[d] + local.shape[d])
                if lo >= hi:
                    continue
                view = local.narrow(d, lo - inner_offsets[d], hi - lo)
                offsets = tuple(lo - i * part if k == d else o for k, o in enumerate(inner_offsets))
                shape = tuple(part if k == d else s for k, s in enumerate(inner_shape))
            if rule.transpose:
                view, offsets, shape = view.t(), tuple(reversed(offsets)), tuple(reversed(shape))
            yield HFShard(_target(template, m, expert), tuple(shape), tuple(offsets), view,
                          box.primary, key, expert)
