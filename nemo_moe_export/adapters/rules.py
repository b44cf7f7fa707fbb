"""The declarative tables the adapter engine reads (docs/design.md#key-names): a :class:`KeyRule` says
how one in-memory tensor becomes one or more HF tensors, a :class:`ModelTable` holds a family's rules,
and :class:`InMemoryFormat` / :class:`LocalExperts` describe a framework's in-memory state dict. The
families' tables are in ``tables.py`` and ``tables_megatron.py``; the engine in ``engine.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["InMemoryFormat", "KeyRule", "LocalExperts", "ModelTable", "expert_rules"]


@dataclass(frozen=True)
class KeyRule:
    """How in-memory keys matching ``source`` become HF keys.

    ``source`` is a regex matched against the whole in-memory key; ``targets`` are ``str.format``
    templates over its named groups (plus ``{expert}`` for per-expert rules). With several
    targets, the tensor (per expert, if ``per_expert``) is split into equal parts along
    ``split_dim``, one per target, in order. ``transpose`` means the HF tensor is the transpose of
    the 2-D part. ``group`` names rules that must appear together for the same ``prefix`` group
    (an MoE layer needs both its gate/up and its down tensor).

    For layouts that are not transformers' (megatron-core, docs/design.md#megatron-core-models):

    * ``local_experts``: the tensor belongs to this rank's *local* experts. A named group ``local``
      in ``source`` is the local expert index (one tensor per expert), or with ``per_expert`` dim 0
      counts the local experts; the global ids are the model's own (:class:`LocalExperts` of the
      MoE module named by the group ``moe``), never re-derived from ranks.
    * ``experts_view``: with ``per_expert``, view the tensor as ``[experts, *experts_view]`` first
      (ints or config field names; one entry may be -1), as the model itself views it.
    * ``split_groups`` / ``split_units``: the split dim holds ``split_groups`` (a config field)
      interleaved blocks, each with every target's part in order, parts sized in proportion to
      ``split_units`` (config fields); the default is one block of equal parts.
    * ``parts``: key suffixes (a named group ``part`` in ``source``) that name one target's piece
      alone, in target order: such a key is that target, unsplit (megatron-core's GLU factory
      pieces ``linear_fc1.weight_w`` / ``_v`` are the gate and up rows a TP rank holds).
    * ``rows_field``: the HF tensor is the first ``config.<rows_field>`` rows of dim 0 (megatron
      pads its vocabulary; the padding rows are neither written nor loaded).
    """

    source: str
    targets: tuple[str, ...]
    per_expert: bool = False
    split_dim: int = 0
    transpose: bool = False
    group: str | None = None
    local_experts: bool = False
    experts_view: tuple[int | str, ...] | None = None
    split_groups: str | None = None
    split_units: tuple[str, ...] | None = None
    parts: tuple[str, ...] = ()
    rows_field: str | None = None

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

    ``rules`` are tried in order, first match wins; unmatched keys keep their name, unless
    ``require_rule`` (a framework whose names are never transformers') makes them an error.
    ``num_experts_fields`` are config attributes naming the routed-expert count, tried in order.
    ``tied_keys`` are in-memory keys that alias another tensor when the config ties word
    embeddings; transformers writes them once, so the engine skips them. ``fp8_weights`` are
    regexes (``re.search`` over HF keys) of the weights the family's official FP8 checkpoints store
    block-quantized; ``export.quantize=fp8_block`` quantizes those (docs/design.md#fp8-block-format).
    """

    model_types: tuple[str, ...]
    rules: tuple[KeyRule, ...]
    num_experts_fields: tuple[str, ...]
    tied_keys: tuple[str, ...] = ("lm_head.weight",)
    description: str = ""
    require_rule: bool = False
    fp8_weights: tuple[str, ...] = ()


@dataclass(frozen=True)
class LocalExperts:
    """The global ids of the routed experts one MoE module holds on every rank of its EP group, as
    the model numbers them (megatron-core's ``local_expert_indices``, gathered from each EP rank).

    ``by_ep_rank[r][i]`` is the global id of local expert ``i`` on EP rank ``r``; this rank is
    ``ep_rank``.
    """

    by_ep_rank: tuple[tuple[int, ...], ...]
    ep_rank: int

    @property
    def mine(self) -> tuple[int, ...]:
        return self.by_ep_rank[self.ep_rank]

    def at(self, slot: int) -> tuple[int, ...]:
        """The global id of local expert ``slot`` on every EP rank."""
        return tuple(ids[slot] for ids in self.by_ep_rank)


@dataclass(frozen=True)
class InMemoryFormat:
    """How a framework's in-memory state dict differs from transformers': the table namespace its
    keys are named in (``get_adapter`` looks up ``"{naming}:{model_type}"``) and the local experts
    of each MoE module. A config carries it as ``in_memory_format`` (``nemo_moe_export.megatron``)."""

    naming: str
    local_experts: Mapping[str, LocalExperts] = field(default_factory=dict)
