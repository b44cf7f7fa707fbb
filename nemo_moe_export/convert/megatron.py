"""The key table of megatron-core ``torch_dist`` checkpoints (docs/design.md#megatron-torch_dist-keys).

A megatron-core checkpoint stores each tensor under its ``sharded_state_dict()`` key, with axes
megatron prepends to the module's own tensor:

* a layer axis for homogeneous layers, stacked: ``decoder.layers.mlp.router.weight`` [L, E, H]
  (heterogeneous ones, DeepSeek-V3's dense first layers, are one key per layer:
  ``decoder.layers.{l}.*``, global layer numbers);
* a global expert axis for routed experts: ``...mlp.experts.experts.linear_fc1.weight`` [E, 2F, H];
* ``mtp.layers.{i}.*``: multi-token-prediction layer ``i`` (HF's ``model.layers.{num_layers + i}``).

Checkpoints of megatron-core before 0.14 (its ``singleton_local_shards`` metadata) store every layer
per key, each expert under its own key (``...experts.experts.{e}.linear_fc1.weight_w``) and a GLU
``linear_fc1`` as its gate (``_w``) and up (``_v``) halves: the same table reads both.

Behind the prepended axes each box is a box of the tensor the model holds in memory, so the table
names it as the in-memory key (``decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight``,
with every expert "local" to one rank) and maps it through the megatron-core tables of
``adapters/tables_megatron.py`` (GLU gate/up rows, QKV groups, MLA, vocabulary padding cut,
local-spec norm names, MTP). Boxes are what megatron recorded (the checkpoint's chunks), whatever
parallelism saved them; nothing re-derives a layout.

The optimizer's state (``optimizer.*``, of the weights' own shapes), the RNG states, modules'
``_extra_state`` and the rerun state machine are skipped by rule and never read; any other key no
rule maps is refused by name.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nemo_moe_export.adapters import HFShard, LocalExperts, StateDictAdapter, TensorMeta, get_table
from nemo_moe_export.adapters.tables_megatron import NAMING
from nemo_moe_export.convert.megatron_config import config_from_checkpoint
from nemo_moe_export.errors import InputError
from nemo_moe_export.placement import LocalBox

__all__ = ["FORMAT", "MegatronTorchDistTable", "skipped_key"]

FORMAT = "megatron_torch_dist"

# What a Megatron-LM / Megatron-Bridge checkpoint holds besides the model's weights, by rule:
# the optimizer's state dict (its keys under "optimizer.", whatever the optimizer), the per-rank RNG
# and rerun-state-machine objects, and every module's _extra_state (one per linear layer).
_SKIPPED = (
    re.compile(r"optimizer\..+"),
    re.compile(r"(rng_state|rerun_state_machine(_state)?)(/.*)?"),
    re.compile(r"(.+\.)?_extra_state(/.*)?"),
)
_STACKED = re.compile(r"decoder\.layers\.(?P<rest>[a-z_].*)")  # no layer number: a stacked layer axis
_PER_LAYER = re.compile(r"decoder\.layers\.(?P<layer>\d+)\..+")
_MTP = re.compile(r"mtp\.layers\.(?P<index>\d+)\.(?P<rest>.+)")
# routed experts: a global expert axis, or (megatron-core before 0.14, ``singleton_local_shards``)
# one key per global expert, its GLU gate and up apart (``_w`` / ``_v``)
_EXPERTS = re.compile(r"(?P<moe>.+\.mlp)\.experts\.experts\.(?:(?P<expert>\d+)\.)?"
                      r"(?P<linear>linear_fc[12])\.weight(?P<part>_w|_v)?")
_VIEW_EXPERT = re.compile(r"(?P<moe>.+\.mlp)\.experts\.local_experts\.(?P<expert>\d+)\.")
_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def skipped_key(key: str) -> bool:
    """Whether ``key`` is training state, not a weight: skipped by rule, never read."""
    return any(rule.fullmatch(key) for rule in _SKIPPED)


@dataclass(frozen=True)
class _Stored:
    """One stored key: its global shape, its prepended axes (``"layer"`` / ``"expert"``, outermost
    first), the in-memory key template over ``{layer}`` / ``{expert}`` and any further in-memory
    keys the same box also is (an MTP layer's head is the output layer)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    templates: tuple[str, ...]

    @property
    def inner_shape(self) -> tuple[int, ...]:
        """The in-memory tensor's shape (behind the prepended axes)."""
        return self.shape[len(self.axes):]

    def axis(self, name: str) -> int:
        return self.shape[self.axes.index(name)]

    def every_view_key(self) -> Iterator[str]:
        for numbers in itertools.product(*(range(s) for s in self.shape[:len(self.axes)])):
            yield from self.view_keys(numbers)

    def view_keys(self, numbers: tuple[int, ...]) -> list[str]:
        values = dict(zip(self.axes, numbers))
        return [t.format(**values) for t in self.templates]


class MegatronTorchDistTable:
    """The ``CheckpointTable`` of a megatron-core ``torch_dist`` checkpoint (module doc), for the
    model family of ``hf_config`` (DeepSeek-V3 or Qwen3-MoE, megatron-core's names)."""

    format = FORMAT

    def __init__(self, index: Any, hf_config: Any) -> None:
        self.config = hf_config
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.num_layers = int(text.num_hidden_layers)
        self._refuse_unknown_other(index)
        tensors = {k: t for k, t in index.tensors.items() if not skipped_key(k)}
        mtp = sorted({int(m["index"]) for k in tensors if (m := _MTP.fullmatch(k))})
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._stored = {k: self._describe(k, tuple(t.shape), mtp, tied) for k, t in tensors.items()}
        self._dtypes = {k: t.dtype for k, t in tensors.items()}
        self._check_layers()
        model_type = getattr(text, "model_type", None) or getattr(hf_config, "model_type", None)
        self.adapter = StateDictAdapter(hf_config, get_table(f"{NAMING}:{model_type}"),
                                        local_experts=self._local_experts())
        self._sources = {t: k for k, s in self._stored.items() for t in s.templates}
        for moe, experts in self.adapter.local_experts.items():
            if experts.mine != tuple(range(self.adapter.num_experts)):
                raise InputError("the checkpoint's experts disagree with the config", key=moe,
                                 expected=f"experts 0..{self.adapter.num_experts - 1} (the config's count)",
                                 actual=f"experts {list(experts.mine)} stored",
                                 hint="a config of another model: pass the model's own --config")

    # ---- the CheckpointTable protocol -------------------------------------------------------------

    def skipped(self, key: str) -> bool:
        return skipped_key(key)

    def hf_metadata(self, index: Any = None) -> dict[str, TensorMeta]:
        """Every HF key with its global shape and stored dtype (the in-memory tables' checks:
        expert counts, GLU halves, QKV groups, the vocabulary against the config)."""
        view = {name: torch.empty(s.inner_shape, dtype=self._dtypes[key], device="meta")
                for key, s in self._stored.items() for name in s.every_view_key()}
        try:
            return self.adapter.hf_metadata(view)
        except InputError as exc:
            raise self._named_as_stored(exc) from None

    def pieces(self, key: str, offsets: tuple[int, ...], tensor: torch.Tensor) -> list[HFShard]:
        """The HF pieces one stored box holds (views of ``tensor``, ``source_key=key``): each
        index along the prepended axes is one in-memory tensor's box, mapped by the megatron-core
        tables."""
        stored = self._stored.get(key)
        if stored is None:
            raise InputError("no rule maps this checkpoint key", key=key,
                             expected="a model weight of the megatron-core table", actual="not a mapped key",
                             hint="docs/design.md#megatron-torch_dist-keys")
        n = len(stored.axes)
        out: list[HFShard] = []
        for index in itertools.product(*(range(s) for s in tensor.shape[:n])):
            numbers = tuple(o + i for o, i in zip(offsets, index))
            box = LocalBox(stored.inner_shape, tuple(offsets[n:]), tensor[index], True)
            for name in stored.view_keys(numbers):
                out.extend(dataclasses.replace(p, source_key=key) for p in self.adapter.box_pieces(name, box))
        return out

    # ---- stored key -> in-memory keys ---------------------------------------------------------------

    def _describe(self, key: str, shape: tuple[int, ...], mtp: list[int], tied: bool) -> _Stored:
        axes: list[str] = []
        name = key.replace("{", "{{").replace("}", "}}")
        if m := _STACKED.fullmatch(name):
            axes.append("layer")
            name = "decoder.layers.{layer}." + m["rest"]
        elif m := _MTP.fullmatch(name):
            name = f"mtp.layers.{self.num_layers + int(m['index'])}.{m['rest']}"
        if m := _EXPERTS.fullmatch(name):
            if m["expert"] is None:
                axes.append("expert")
            expert = m["expert"] or "{expert}"
            name = f"{m['moe']}.experts.local_experts.{expert}.{m['linear']}.weight{m['part'] or ''}"
        if len(shape) <= len(axes):
            raise InputError("a checkpoint tensor lacks the axes its key names", key=key,
                             expected=f"the prepended axes {axes} and the module's own dims",
                             actual=f"shape {shape}", hint="docs/design.md#megatron-torch_dist-keys")
        templates = [name]
        head = _EMBEDDING if tied else _OUTPUT  # what the MTP layers project through
        if key == head:
            templates += [f"mtp.layers.{self.num_layers + i}.{_OUTPUT}" for i in mtp]
        return _Stored(shape, tuple(axes), tuple(templates))

    def _check_layers(self) -> None:
        """The decoder layers the checkpoint numbers are exactly the config's."""
        found: set[int] = set()
        for key, s in self._stored.items():
            if "layer" in s.axes:
                found.update(range(s.axis("layer")))
            elif m := _PER_LAYER.fullmatch(key):
                found.add(int(m["layer"]))
        if found and found != set(range(self.num_layers)):
            raise InputError("the checkpoint's decoder layers are not the config's", key="num_hidden_layers",
                             expected=f"layers 0..{self.num_layers - 1}", actual=f"layers {sorted(found)}",
                             hint="a config of another model: pass the model's own --config")

    def _local_experts(self) -> dict[str, LocalExperts]:
        """Every MoE module's experts as one rank's (the checkpoint numbers them globally)."""
        found: dict[str, set[int]] = {}
        for s in self._stored.values():
            for name in s.every_view_key():
                if m := _VIEW_EXPERT.match(name):
                    found.setdefault(m["moe"], set()).add(int(m["expert"]))
        return {moe: LocalExperts((tuple(sorted(ids)),), 0) for moe, ids in found.items()}

    def _named_as_stored(self, exc: InputError) -> InputError:
        """An in-memory table's error, naming the checkpoint's key the in-memory key came from."""
        for template, key in self._sources.items():
            if exc.key is not None and _fits(template, exc.key):
                return InputError(f"{exc.problem} (as the in-memory key '{exc.key}')", key=key,
                                  expected=exc.expected, actual=exc.actual,
                                  hint=f"{exc.hint}; or the config is of another model family" if exc.hint else None)
        return exc

    def _refuse_unknown_other(self, index: Any) -> None:
        unknown = sorted(k for k in index.other if not skipped_key(k))
        if unknown:
            raise InputError("a checkpoint entry that is neither a weight nor training state", key=unknown[0],
                             expected="model tensors, optimizer.*, rng_state, *._extra_state",
                             actual=f"{len(unknown)} such entries: {unknown[:4]}",
                             hint="docs/design.md#megatron-torch_dist-keys lists what is skipped")


def _fits(template: str, name: str) -> bool:
    pattern = re.escape(template).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")
    return re.fullmatch(pattern.replace("{{", "{").replace("}}", "}"), name) is not None

