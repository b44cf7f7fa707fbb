"""Which pipeline stage holds each tensor, as ``pipeline.stages.split_stages`` builds stages
(docs/design.md#planner).

A job with ``pp_size`` > 1 runs ``pp_size x S`` ranks, "pp" the outermost mesh dim: ranks
``p * S ... p * S + S - 1`` are pipeline rank ``p``, holding stages ``p, p + pp_size, ...``
(``stages_per_rank`` > 1: virtual stages, "loop" order). A stage keeps its decoder layers under
their global names (consecutive runs, ``layers_per_stage`` or as even as possible with earlier
stages taking the remainder), the embedding on stage 0, the final norm and ``lm_head`` on the last.
The rule is read here from the keys' names, without building the stage modules: the same split
as ``split_stages`` (its ``_layer_counts``), and for any model whose keys follow that shape.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from nemo_moe_export.errors import InputError
from nemo_moe_export.pipeline.stages import _layer_counts, stage_ids

__all__ = ["Pipeline", "pipeline_of"]

_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")
_FIRST = re.compile(r"^(?:model\.)?embed_tokens\.")  # split_stages keeps the embedding on stage 0 only
_LAST = re.compile(r"^(?:(?:model\.)?norm\.|lm_head\.)")  # the final norm and lm_head on the last stage only


@dataclass(frozen=True)
class Pipeline:
    """The stages of a job and the layers each holds."""

    pp_size: int
    stages_per_rank: int
    layers: tuple[tuple[int, ...], ...]  # by stage: the global decoder-layer ids it holds

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def stages_of(self, pp_rank: int) -> list[int]:
        return stage_ids(pp_rank, self.pp_size, self.stages_per_rank)

    def stage_of(self, key: str) -> int:
        """The stage holding ``key`` (an in-memory or HF name). A key outside the layers, the
        embedding, the final norm and ``lm_head`` would be copied to every stage by
        ``split_stages``: the export refuses that (two stages hold the same tensor), so do we."""
        m = _LAYER.match(key)
        if m is not None:
            return self._stage_of_layer[int(m.group(1))]
        if _FIRST.match(key):
            return 0
        if _LAST.match(key):
            return self.n_stages - 1
        raise InputError("two pipeline stages hold the same tensor", key=key,
                         expected="a decoder layer's, the embedding's, the final norm's or lm_head's",
                         actual="a tensor outside them, which every stage keeps",
                         hint="the export refuses a tensor held by several stages")

    def pp_rank_of(self, key: str) -> int:
        return self.stage_of(key) % self.pp_size

    @functools.cached_property
    def _stage_of_layer(self) -> dict[int, int]:
        return {layer: s for s, layers in enumerate(self.layers) for layer in layers}

    def describe(self) -> dict[str, Any]:
        return dict(pp_size=self.pp_size, stages_per_rank=self.stages_per_rank, stages=self.n_stages,
                    layers_per_stage=[len(ls) for ls in self.layers])


def pipeline_of(parallel: Any, meta: Any) -> Pipeline | None:
    """The job's stages (None without pipeline parallelism), checked as ``split_stages`` checks them."""
    pp_size = int(getattr(parallel, "pp_size", 1) or 1)
    stages_per_rank = int(getattr(parallel, "stages_per_rank", 1) or 1)
    if pp_size < 1 or stages_per_rank < 1:
        raise InputError("invalid pipeline layout", key="parallel.pp_size",
                         expected="pp_size >= 1 and stages_per_rank >= 1",
                         actual=f"pp_size={pp_size}, stages_per_rank={stages_per_rank}")
    if pp_size == 1:  # one pipeline rank holds every stage: the export's plain path (no pipeline group)
        return None
    n_stages = pp_size * stages_per_rank
    text = meta.config.get_text_config() if hasattr(meta.config, "get_text_config") else meta.config
    if n_stages > 1 and getattr(text, "tie_word_embeddings", False):
        raise InputError("tied input and output embeddings cannot be split over pipeline stages",
                         key="tie_word_embeddings", expected=False, actual=True,
                         hint="the first stage holds the embedding, the last lm_head: untie them")
    n_layers = int(text.num_hidden_layers)
    counts = _layer_counts(n_layers, n_stages, getattr(parallel, "layers_per_stage", None))
    layers, start = [], 0
    for count in counts:
        layers.append(tuple(range(start, start + count)))
        start += count
    return Pipeline(pp_size, stages_per_rank, tuple(layers))
