"""The one engine that maps a (possibly sharded) in-memory state dict to Hugging Face keys and back.

Everything model-specific lives in a :class:`ModelTable` (see ``tables.py``; the rule types in
``rules.py``): an ordered list of :class:`KeyRule` s. A rule says how one in-memory tensor becomes one or more HF tensors: renamed,
split into equal parts along one dim, split per expert along dim 0, and/or transposed. Keys no rule
matches keep their name (transformers 5 saves most keys as they are in memory).

The engine works on *boxes*: the part of a global tensor a rank holds (``placement.local_box``). A
rule maps an in-memory box to at most one box per HF tensor, and the local tensor of that HF box is
a view of the rank's shard (``pieces.py``). The same mapping serves both directions:

* ``to_hf``  returns those views (nothing is copied);
* ``from_hf`` copies exactly those boxes out of the HF files into the views (``get_slice`` reads
  only the bytes a rank needs).

The global key list and shapes (``hf_metadata``) derive from global shapes only, so every rank
computes the same answer without communicating; validation uses it, so every rank raises the same
error before anything is touched.

:class:`StateDictAdapter` implements the adapter protocol of ``protocol.py``
(:class:`~nemo_moe_export.adapters.protocol.BaseStateDictAdapter`, whose records ``HFShard``,
``LoadReport`` and ``TensorMeta`` live there too).
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nemo_moe_export.adapters.fp8 import open_source
from nemo_moe_export.adapters.passthrough import group_place, read_passthrough, split_extra_keys
from nemo_moe_export.adapters.pieces import interleaved_pieces, leading_rows, one_part, rule_pieces, target_key, viewed
from nemo_moe_export.adapters.protocol import BaseStateDictAdapter, HFShard, LoadReport, TensorMeta
from nemo_moe_export.adapters.rules import InMemoryFormat, KeyRule, LocalExperts, ModelTable, expert_rules
from nemo_moe_export.adapters.sources import TensorDictSource
from nemo_moe_export.errors import InputError, current_rank
from nemo_moe_export.placement import LocalBox, local_box

__all__ = ["InMemoryFormat", "KeyRule", "LocalExperts", "ModelTable", "StateDictAdapter", "expert_rules",
           "model_parts", "state_dict_of"]


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


def model_parts(model: Any) -> list[Any]:
    """A rank's model as a list of modules: its pipeline stage modules ("model parts", several with
    virtual stages, each keeping the original names) or the one model (``[]`` for None). A wrapper
    that runs stages (``nemo_moe_export.pipeline``) is one model: its ``state_dict()`` is its parts'."""
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def state_dict_of(model: Any) -> Mapping[str, torch.Tensor]:
    """The state dict of a model, of a list of stage modules (their union, every key once), or a
    state dict as it is: what ``to_hf`` / ``from_hf`` and the export read."""
    if isinstance(model, Mapping):
        return model
    merged: dict[str, torch.Tensor] = {}
    for i, part in enumerate(model_parts(model)):
        for key, tensor in part.state_dict().items():
            if key in merged:
                raise InputError(
                    "two stage modules of this rank hold the same key", key=key,
                    expected="each key in one stage module", actual=f"also in stage module {i}",
                    hint="each stage keeps only its own layers (embeddings on the first, norm and lm_head "
                         "on the last)")
            merged[key] = tensor
    return merged


def world_replica() -> tuple[int, int]:
    """``(rank, world size)``: a plain tensor's place among its holders when every rank of the
    world holds it (the default of ``to_hf``: rank 0 is the primary)."""
    rank = current_rank()
    if rank is None:
        return 0, 1
    return rank, dist.get_world_size()


class StateDictAdapter(BaseStateDictAdapter):
    """Maps a model family's in-memory state dict to HF per-expert keys and back, for any sharding.

    Build it from the model's HF config (``get_adapter(config)`` picks the table by
    ``model_type``). DTensors are read through their own placements; plain tensors are taken as
    whole tensors present on every rank (rank 0 is their primary). ``passthrough`` holds what the
    last ``from_hf`` kept of checkpoint tensors the model has no parameter for; an export with this
    adapter writes them back (docs/design.md#pass-through-tensors).
    """

    def __init__(self, config: Any, table: ModelTable,
                 local_experts: Mapping[str, LocalExperts] | None = None) -> None:
        self.config = config
        self.table = table
        self.passthrough: dict[str, HFShard] = {}
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.text_config = text
        self.num_experts = self._read_num_experts(text)
        self.local_experts = dict(local_experts or {})  # MoE module -> LocalExperts (megatron-core)
        self._numbered: set[str] = set()  # MoE modules whose local experts were checked
        self.tie_word_embeddings = bool(_cfg_get(config, "tie_word_embeddings", False))

    def _read_num_experts(self, config: Any) -> int:
        for name in self.table.num_experts_fields:
            value = _cfg_get(config, name, None)
            if value is not None:
                return int(value)
        raise InputError(
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
                return one_part(rule, m), m
        return None, None

    def _skipped(self, key: str) -> bool:
        return self.tie_word_embeddings and key in self.table.tied_keys

    def _entries(self, state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, KeyRule | None, re.Match[str] | None]]:
        for key, tensor in state_dict.items():
            if self._skipped(key):
                continue
            rule, m = self._rule_for(key)
            if rule is None and self.table.require_rule:
                raise InputError(
                    "no rule maps this in-memory key to an HF name", key=key,
                    expected=f"a key of the table '{self.table.description}'", actual="no rule matched",
                    hint="the model has a module the table does not cover (see docs/design.md#megatron-core-models)",
                )
            yield key, tensor, rule, m

    def hf_metadata(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        """Every HF key the model maps to, with its global shape and dtype.

        Uses global shapes only, so it is the same on every rank with no communication. Raises on
        malformed expert tensors (wrong count, odd gate/up size, mismatched siblings).
        """
        return {hf_key: meta for hf_key, (meta, _) in self._hf_layout(state_dict).items()}

    def hf_source_keys(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """``{hf_key: in-memory key}``: which state-dict tensor each HF tensor comes from."""
        return {hf_key: source for hf_key, (_, source) in self._hf_layout(state_dict).items()}

    def _hf_layout(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[TensorMeta, str]]:
        self._validate(state_dict)
        out: dict[str, tuple[TensorMeta, str]] = {}
        for key, tensor, rule, m in self._entries(state_dict):
            shape = tuple(tensor.shape)
            if rule is None:
                self._add_meta(out, key, TensorMeta(shape, tensor.dtype), key)
                continue
            for hf_key, part_shape in self._targets(key, rule, m, shape):
                self._add_meta(out, hf_key, TensorMeta(part_shape, tensor.dtype), key)
        return out

    @staticmethod
    def _add_meta(out: dict[str, tuple[TensorMeta, str]], hf_key: str, meta: TensorMeta, source_key: str) -> None:
        if hf_key in out:
            raise InputError(
                "two in-memory tensors map to the same HF key", key=hf_key,
                expected="one source", actual=f"a second one, '{source_key}'",
                hint="the state dict likely holds the same weight under two layouts (fused and grouped)",
            )
        out[hf_key] = (meta, source_key)

    def _validate(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Refuse malformed expert tensors and MoE layers missing part of their layout."""
        layers: dict[tuple[str, str], dict[str, tuple[str, re.Match[str], torch.Tensor]]] = defaultdict(dict)
        for key, tensor, rule, m in self._entries(state_dict):
            if rule is None:
                continue
            self._check_rule_shape(key, rule, m, tuple(tensor.shape))
            if rule.group is not None:
                layers[(rule.group, m.group("prefix"))][rule.source] = (key, m, tensor)
        for (group, prefix), found in layers.items():
            self._check_layer_complete(group, prefix, found)
            self._check_expert_siblings(group, prefix, found)

    def _check_rule_shape(self, key: str, rule: KeyRule, m: re.Match[str], shape: tuple[int, ...]) -> None:
        """A tensor can take its rule: 3-D with the config's expert count (this rank's local experts
        for local rules) when per expert, divisible into the rule's parts, 2-D per part when
        transposed."""
        local = self._local_experts_of(key, rule, m)
        shape = self._rule_shape(key, rule, m, shape)
        if rule.per_expert:
            if len(shape) != 3:
                raise InputError(
                    "stacked expert tensor must be 3-D [experts, rows, cols]", key=key,
                    expected="3 dims", actual=f"shape {shape}",
                )
            count = self.num_experts if local is None else len(local.mine)
            if shape[0] != count:
                raise InputError(
                    "expert count in the tensor disagrees with the config", key=key,
                    expected=f"{count} experts ({'config' if local is None else 'local_expert_indices'})",
                    actual=f"{shape[0]} (shape {shape})",
                    hint="build the adapter from the config the model was created with",
                )
        elif local is not None and int(m.group("local")) >= len(local.mine):
            raise InputError("local expert index beyond the experts this rank holds", key=key,
                             expected=f"< {len(local.mine)} (local_expert_indices {list(local.mine)})",
                             actual=m.group("local"))
        inner = shape[1:] if rule.per_expert else shape
        if len(rule.targets) > 1 and len(inner) <= rule.split_dim:
            raise InputError(f"cannot split along dim {rule.split_dim}", key=key,
                             expected=f"more than {rule.split_dim} dims", actual=f"shape {shape}")
        self._split_sizes(key, rule, inner)
        if (rule.split_groups or rule.split_units) and (rule.per_expert or rule.transpose):
            raise InputError("an interleaved split applies to plain, untransposed tensors", key=key,
                             expected="per_expert=False, transpose=False", actual=rule)
        if rule.transpose and len(inner) != 2:
            raise InputError("transposed tensor must be 2-D per part", key=key,
                             expected="2 dims", actual=f"shape {inner}")
        if rule.rows_field is not None and not 0 < self._config_int(rule.rows_field) <= shape[0]:
            raise InputError(f"the config's {rule.rows_field} does not fit the tensor's rows", key=key,
                             expected=f"1..{shape[0]} (the rows, padding included)",
                             actual=self._config_int(rule.rows_field))

    def _check_layer_complete(self, group: str, prefix: str, found: dict[str, Any]) -> None:
        """An MoE layer has every tensor of its layout (both gate/up and down)."""
        needed = [r.source for r in self.table.rules if r.group == group]
        if any(s not in found for s in needed):
            raise InputError(
                "MoE layer is missing an expert tensor", key=prefix,
                expected=f"keys matching {needed}", actual=f"only {sorted(found)}",
            )

    def _check_expert_siblings(self, group: str, prefix: str, found: dict[str, Any]) -> None:
        metas = []
        for source, (key, m, tensor) in found.items():
            rule = next(r for r in self.table.rules if r.source == source)
            own = self._rule_for(key)[0]  # one target when the key is one piece (``parts``)
            metas.append((rule, next(self._targets(key, own, m, tuple(tensor.shape)))[1], tensor.dtype))
        gate_shape = next(s for r, s, _ in metas if len(r.targets) == 2)
        down_shape = next(s for r, s, _ in metas if len(r.targets) == 1)
        if tuple(reversed(down_shape)) != gate_shape:
            raise InputError(
                "expert down projection does not match gate/up", key=prefix,
                expected=f"down {tuple(reversed(gate_shape))} for gate/up {gate_shape} (HF orientation)",
                actual=f"down {down_shape}",
            )
        dtypes = {d for _, _, d in metas}
        if len(dtypes) > 1:
            raise InputError("expert tensors of one layer differ in dtype", key=prefix,
                             expected="one dtype", actual=sorted(map(str, dtypes)))

    # ---- rule geometry: local experts, expert views, interleaved splits (megatron-core) ------------

    def _config_int(self, name: int | str) -> int:
        if isinstance(name, int):
            return name
        value = _cfg_get(self.text_config, name, None)
        if not isinstance(value, int):
            raise InputError("the table needs a config field the config does not set", key=name,
                             expected="an integer", actual=repr(value))
        return value

    def _local_experts_of(self, key: str, rule: KeyRule, m: re.Match[str]) -> LocalExperts | None:
        """The model's local experts for a local-expert rule (checked to number every expert once)."""
        if not rule.local_experts:
            return None
        found = self.local_experts.get(m.group("moe"))
        if found is None:
            raise InputError(
                "the adapter does not know which experts this rank holds", key=key,
                expected=f"the local_expert_indices of MoE module '{m.group('moe')}'",
                actual=f"known for {sorted(self.local_experts) or 'no module'}",
                hint="build the adapter from the config of a nemo_moe_export.megatron.MegatronCausalLM",
            )
        if m.group("moe") in self._numbered:  # checked once per module (a conversion asks per box)
            return found
        every = sorted(e for ids in found.by_ep_rank for e in ids)
        if every != list(range(self.num_experts)) or len({len(ids) for ids in found.by_ep_rank}) != 1:
            raise InputError(
                "the EP ranks' local experts do not number every expert exactly once", key=m.group("moe"),
                expected=f"equal blocks covering 0..{self.num_experts - 1}",
                actual=f"local_expert_indices by EP rank {[list(i) for i in found.by_ep_rank]}",
            )
        self._numbered.add(m.group("moe"))
        return found

    def _rule_shape(self, key: str, rule: KeyRule, m: re.Match[str], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the rule splits: ``[experts, *experts_view]`` when it views the tensor."""
        if rule.experts_view is None:
            return shape
        local = self._local_experts_of(key, rule, m)
        n = self.num_experts if local is None else len(local.mine)
        view = [self._config_int(v) for v in rule.experts_view]
        known = n * math.prod(v for v in view if v != -1)
        if len(shape) != 2 or math.prod(shape) % known or view.count(-1) > 1:
            raise InputError(f"cannot view the tensor as {n} experts of {tuple(view)}", key=key,
                             expected=f"a 2-D tensor of a multiple of {known} elements",
                             actual=f"shape {shape}")
        return (n, *(math.prod(shape) // known if v == -1 else v for v in view))

    def _split_sizes(self, key: str, rule: KeyRule, inner: list[int] | tuple[int, ...]) -> tuple[int, list[int]]:
        """``(groups, rows of each target per group)`` along the rule's split dim."""
        n = len(rule.targets)
        if n == 1:
            return 1, [inner[rule.split_dim] if len(inner) > rule.split_dim else 0]
        groups = self._config_int(rule.split_groups) if rule.split_groups else 1
        units = [self._config_int(u) for u in rule.split_units] if rule.split_units else [1] * n
        total = inner[rule.split_dim]
        if total % groups or (total // groups) % sum(units):
            raise InputError(
                f"cannot split dim {rule.split_dim} into {groups} groups of parts in proportion {units}",
                key=key, expected=f"a size divisible by {groups * sum(units)}", actual=f"shape {tuple(inner)}",
            )
        per_unit = total // groups // sum(units)
        return groups, [per_unit * u for u in units]

    def _targets(self, key: str, rule: KeyRule, m: re.Match[str], shape: tuple[int, ...]
                 ) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every HF key a tensor of global ``shape`` maps to, with its global shape: the same on
        every rank (local experts list every EP rank's ids)."""
        shape = self._rule_shape(key, rule, m, shape)
        inner = list(shape[1:] if rule.per_expert else shape)
        groups, sizes = self._split_sizes(key, rule, inner)
        local = self._local_experts_of(key, rule, m)
        if local is None:
            experts = range(shape[0]) if rule.per_expert else [None]
        else:
            experts = [e for ids in local.by_ep_rank for e in ids] if rule.per_expert else local.at(int(m.group("local")))
        if rule.rows_field is not None:
            inner[0] = self._config_int(rule.rows_field)
        for expert in experts:
            for template, size in zip(rule.targets, sizes):
                part = list(inner)
                if len(rule.targets) > 1:
                    part[rule.split_dim] = groups * size
                yield target_key(template, m, expert), tuple(reversed(part)) if rule.transpose else tuple(part)

    def _pieces_of(self, key: str, rule: KeyRule, m: re.Match[str], box: LocalBox, merge: bool) -> Iterator[HFShard]:
        """This rank's HF pieces of one matched tensor (views; ``merge`` joins an interleaved split's
        per-group views of one HF tensor into one copy, as ``to_hf`` returns one piece per key)."""
        local = self._local_experts_of(key, rule, m)
        if rule.experts_view is not None:
            box = viewed(key, box, self._rule_shape(key, rule, m, box.global_shape))
        if rule.rows_field is not None:
            box = leading_rows(box, self._config_int(rule.rows_field))
        experts = None if local is None else (local.mine if rule.per_expert else (local.mine[int(m.group("local"))],))
        if rule.split_groups is None and rule.split_units is None:
            yield from rule_pieces(key, rule, m, box, experts)
            return
        groups, sizes = self._split_sizes(key, rule, box.global_shape)
        yield from interleaved_pieces(key, rule, m, box, groups, sizes, merge)

    def box_pieces(self, key: str, box: LocalBox) -> list[HFShard]:
        """The HF pieces of one box of the in-memory tensor ``key`` (views of ``box.local``, an
        interleaved split's per-group runs apart): what a checkpoint converter maps a stored box
        through (docs/design.md#megatron-torch_dist-keys). A tied alias gives none."""
        if self._skipped(key):
            return []
        (_, _, rule, m), = self._entries({key: box.local})
        if rule is None:
            return [HFShard(key, box.global_shape, box.offsets, box.local, box.primary, key,
                            replica=box.replica, replicas=box.replicas)]
        return list(self._pieces_of(key, rule, m, box, merge=False))

    # ---- to_hf / from_hf ------------------------------------------------------------------------

    def _pieces(self, state_dict: Mapping[str, torch.Tensor],
                 plain_replica: tuple[int, int] | None = None, merge: bool = False) -> Iterator[HFShard]:
        plain_replica = plain_replica or world_replica()
        for key, tensor, rule, m in self._entries(state_dict):
            box = local_box(tensor, key=key, plain_replica=plain_replica)
            if rule is None:
                if not box.is_empty or (box.primary and math.prod(box.global_shape) == 0):
                    yield HFShard(key, box.global_shape, box.offsets, box.local, box.primary, key,
                                  replica=box.replica, replicas=box.replicas)
                continue
            yield from self._pieces_of(key, rule, m, box, merge)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor] | Any, *,
              plain_replica: tuple[int, int] | None = None) -> dict[str, HFShard]:
        """The HF tensors (or parts of them) this rank holds, keyed by HF name, as views.

        Per-expert keys carry global expert ids. Nothing is copied: each ``HFShard.tensor`` is a
        view of the local shard, except for an interleaved split (megatron-core's ``linear_qkv``),
        whose per-group views of one HF tensor are joined into one copy. Ranks holding no part of a
        tensor (empty trailing FSDP shards) return no entry for it. Plain (non-DTensor) tensors are held by every rank of a group;
        ``plain_replica`` is this rank's ``(index, count)`` in it (default: the world's).
        ``state_dict`` may also be a model or this rank's list of pipeline stage modules.
        """
        state_dict = state_dict_of(state_dict)
        self._validate(state_dict)
        out: dict[str, HFShard] = {}
        for piece in self._pieces(state_dict, plain_replica, merge=True):
            if piece.key in out:
                raise InputError("two in-memory tensors map to the same HF key", key=piece.key,
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
        passthrough: bool = True,
        group: Any = None,
        pp_group: Any = None,
    ) -> LoadReport:
        """Fill ``state_dict`` (the model's own, possibly sharded, tensors) in place from HF weights.

        ``source`` is a checkpoint directory, a ``.safetensors`` file or an HF-keyed dict. Each rank
        reads only the slices it holds. Everything is checked first (missing keys, unexpected keys
        when ``strict``, shapes, dtypes unless ``allow_dtype_cast``); on any problem nothing is
        changed. Tied aliases (``lm_head.weight`` with tied embeddings) are filled through the
        tensor they alias. Official FP8 block-quantized checkpoints (``quantization_config`` in
        ``config.json``) are dequantized slice by slice into the model's dtype (``fp8.py``).

        With ``passthrough`` (the default), checkpoint tensors the model has no parameter for (the
        DeepSeek-V3 multi-token-prediction layer, any other extra key) are kept, not refused: each
        rank of ``group`` (default: the world) reads its ``torch.chunk`` slice of dim 0, and the
        slices are returned in ``LoadReport.passthrough`` and kept in ``self.passthrough``, where the
        export finds them (docs/design.md#pass-through-tensors). Extra experts of the model's own
        MoE layers are never passed through: they mean the config is wrong.

        ``state_dict`` may be a model or this rank's pipeline stage modules; with ``pp_group`` (the
        pipeline group, a collective over it) a checkpoint key that another stage holds is neither
        unexpected nor passed through (docs/design.md#pipeline-stages).
        """
        state_dict = state_dict_of(state_dict)
        expected = self.hf_metadata(state_dict)
        other_stages = _other_stages_keys(expected, pp_group)
        src = TensorDictSource(source) if isinstance(source, Mapping) else open_source(source)
        try:
            kept = self._check_source(expected, src, strict=strict, allow_dtype_cast=allow_dtype_cast,
                                      passthrough=passthrough, elsewhere=other_stages)
            report = _copy_boxes(list(self._pieces(state_dict)), src)
            if kept:
                before = src.bytes_read
                report.passthrough = read_passthrough(src, kept, group_place(group))
                report.passthrough_bytes_read = src.bytes_read - before
            self.passthrough = report.passthrough
            return report
        finally:
            src.close()

    def _check_source(self, expected: dict[str, TensorMeta], src: Any, *, strict: bool,
                      allow_dtype_cast: bool, passthrough: bool = False,
                      elsewhere: frozenset[str] = frozenset()) -> list[str]:
        """Refuse, before anything is copied, a checkpoint whose keys, shapes or dtypes do not fit;
        return the extra keys to pass through. ``elsewhere``: keys other pipeline stages load."""
        have = src.keys() - elsewhere
        missing = sorted(set(expected) - have)
        if missing:
            raise InputError(
                f"{len(missing)} HF keys the model needs are missing from the checkpoint",
                key=missing[0], expected="present", actual=f"missing (all missing: {_preview(missing)})",
                hint="check that the checkpoint matches the config (expert count, layer count)",
            )
        kept, extra = split_extra_keys(have - set(expected), expected) if passthrough else ([], sorted(have - set(expected)))
        if extra and strict:
            raise InputError(
                f"{len(extra)} checkpoint keys have no place in the model",
                key=extra[0], expected=f"only the model's {len(expected)} keys",
                actual=f"also {_preview(extra)}",
                hint="an expert id beyond the config's count means the config is wrong; "
                "pass strict=False to ignore keys the model does not use",
            )
        for key, meta in expected.items():
            _check_stored_tensor(key, meta, src, allow_dtype_cast=allow_dtype_cast)
        return kept


def _other_stages_keys(expected: Mapping[str, TensorMeta], pp_group: Any) -> frozenset[str]:
    """The HF keys the other ranks of the pipeline group load (one object all-gather over it)."""
    if pp_group is None:
        return frozenset()
    every: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, sorted(expected), group=pp_group)
    return frozenset(k for keys in every for k in keys) - set(expected)


def _check_stored_tensor(key: str, meta: TensorMeta, src: Any, *, allow_dtype_cast: bool) -> None:
    """The stored tensor has the model's shape, and its dtype or one ``from_hf`` may convert from."""
    got = src.meta(key)
    if got.shape != meta.shape:
        raise InputError("checkpoint tensor has the wrong shape", key=key,
                         expected=meta.shape, actual=got.shape)
    dequantized = getattr(src, "dequantizes", lambda _: False)(key)
    if dequantized and not meta.dtype.is_floating_point:
        raise InputError("an FP8 weight can only fill a floating-point tensor", key=key,
                         expected="a floating-point model tensor", actual=meta.dtype)
    if got.dtype != meta.dtype and not dequantized and not (
        allow_dtype_cast and got.dtype.is_floating_point and meta.dtype.is_floating_point
    ):
        raise InputError(
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
