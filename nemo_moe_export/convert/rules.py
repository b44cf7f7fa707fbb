"""A key table built from rules: each stored key's pattern names the HF key(s) its boxes fill.

Shared by the torchtitan and AutoModel tables (docs/design.md#checkpoint-conversion). A rule is
``same`` (one stored tensor is one HF tensor, boxes map to the same boxes) or ``experts`` (a
grouped ``(E, ...)`` tensor whose leading axis is the expert: each expert row of a box is a box of
that expert's HF tensor). Keys are matched by whole-key regexes, never by suffix: an optimizer
moment of ``layers.0.attention.wq.weight`` is ``optimizer.state.layers.0...`` and matches no rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from nemo_moe_export.adapters import HFShard, TensorMeta
from nemo_moe_export.convert.index import CheckpointIndex, StoredTensor
from nemo_moe_export.errors import InputError

__all__ = ["Rule", "RuleTable"]


@dataclass(frozen=True)
class Rule:
    pattern: str  # a whole-key regex over the stored key
    hf: str  # the HF key, ``str.format``-ed with the match's groups (and ``expert=`` for experts)
    kind: str = "same"  # same | experts
    # maps the match's groups before formatting (e.g. an MTP layer's index -> its HF layer number)
    groups: Callable[[tuple[str, ...]], tuple] | None = None

    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.pattern)


class RuleTable:
    """A :class:`~nemo_moe_export.convert.tables.CheckpointTable` from ``rules`` (first match wins),
    ``skip`` (whole-key regexes of stored tensors never read: optimizer, train state) and ``drop``
    (model tensors the HF format has no place for, never read)."""

    def __init__(self, format: str, rules: Iterable[Rule], skip: Iterable[str] = (), drop: Iterable[str] = ()) -> None:
        self.format = format
        self._rules = [(rule, rule.compiled()) for rule in rules]
        self._skip = re.compile("|".join(f"(?:{p})" for p in (*skip, *drop)) or r"(?!)")
        self._cache: dict[str, tuple[Rule, tuple]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def skipped(self, key: str) -> bool:
        return self._skip.fullmatch(key) is not None

    def _rule_of(self, key: str) -> tuple[Rule, tuple] | None:
        if key not in self._cache:
            for rule, regex in self._rules:
                match = regex.fullmatch(key)
                if match:
                    groups = match.groups()
                    self._cache[key] = (rule, rule.groups(groups) if rule.groups else groups)
                    break
            else:
                return None
        return self._cache[key]

    def hf_metadata(self, index: CheckpointIndex) -> dict[str, TensorMeta]:
        metadata: dict[str, TensorMeta] = {}
        unknown = []
        for key, stored in sorted(index.tensors.items()):
            if self.skipped(key):
                continue
            found = self._rule_of(key)
            if found is None:
                unknown.append(key)
                continue
            self._shapes[key] = stored.shape
            for hf_key, shape in self._hf_tensors(found, stored):
                if hf_key in metadata:
                    raise InputError("two stored tensors map to one HF tensor", key=hf_key,
                                     expected="one stored tensor per HF tensor", actual=key)
                metadata[hf_key] = TensorMeta(shape, stored.dtype)
        if unknown:
            raise InputError(f"{len(unknown)} stored tensor(s) no {self.format} key table maps", key=unknown[0],
                             expected="a model key of this format, or an optimizer / train-state key",
                             actual=unknown[:8], hint="is this checkpoint of another framework or model?")
        return metadata

    def _hf_tensors(self, found: tuple[Rule, tuple], stored: StoredTensor) -> list[tuple[str, tuple[int, ...]]]:
        rule, groups = found
        if rule.kind == "same":
            return [(rule.hf.format(*groups), stored.shape)]
        return [(rule.hf.format(*groups, expert=e), stored.shape[1:]) for e in range(stored.shape[0])]

    def pieces(self, key: str, offsets: tuple[int, ...], tensor: torch.Tensor) -> list[HFShard]:
        rule, groups = self._rule_of(key)
        shape = self._shapes[key]
        if rule.kind == "same":
            return [HFShard(rule.hf.format(*groups), shape, offsets, tensor, True, key)]
        return [HFShard(rule.hf.format(*groups, expert=offsets[0] + i), shape[1:], offsets[1:], tensor[i], True, key,
                        expert=offsets[0] + i) for i in range(tensor.shape[0])]
