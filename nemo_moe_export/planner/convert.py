"""The conversion's prediction: bytes each rank reads and writes, and the time, before converting.

``plan_conversion(hf_config, world, ...)`` runs the conversion's own layout code on what the
checkpoint of ``hf_config``'s model holds (docs/design.md#checkpoint-conversion):

* **What is read.** Every HF tensor the in-job export writes (``convert/checks.expected_metadata``:
  transformers' model on the meta device, the family's adapter), plus the MTP layers the config
  declares (transformers builds none; a checkpoint holds them), stored in ``source_dtype``
  (megatron-core and Megatron-Bridge save the model's bf16 weights; the optimizer's float32 copies
  sit beside them and are never read). Each tensor is taken as one stored box: a checkpoint's
  boxes are smaller (an expert, a TP shard), which only makes the shares more even.
* **Who reads it.** ``convert/assign.assign_work``, the conversion's own assignment by source bytes.
* **What is written.** ``convert/engine.conversion_plan`` of the same keys in the export ``dtype``
  (the conversion's own plan: what transformers keeps float32 stays float32).
* **Time.** Ranks sit on nodes in order (``rank // ranks_per_node``). A node's I/O is its ranks'
  bytes read at ``read_bandwidth`` plus their bytes written at ``write_bandwidth``, one after the
  other (each a node's total, however many of its ranks use it at once: one device serves both).
  Each rank decodes and casts its bytes at ``decode_bandwidth`` (per rank, on its own core) while
  its reader thread reads ahead and its writer threads write (``convert/reader.ChunkReader``), so a
  node takes the longer of its I/O and its slowest rank's decoding. The conversion lasts as long as
  its slowest node. The bandwidths are assumptions to state for your cluster;
  ``benchmarks/convert_bench.py`` measures them on a machine.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from nemo_moe_export.adapters import TensorMeta
from nemo_moe_export.convert.assign import assign_work
from nemo_moe_export.convert.checks import expected_metadata
from nemo_moe_export.convert.index import StoredChunk
from nemo_moe_export.convert.engine import conversion_plan
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import natural_key
from nemo_moe_export.planner.report import format_bytes

__all__ = ["ConversionModel", "format_conversion", "plan_conversion", "with_mtp_layers"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


class ConversionModel:
    """The stated assumptions of the conversion's time (module docstring), bytes per second."""

    def __init__(self, read_bandwidth: float = 2e9, write_bandwidth: float = 2e9, decode_bandwidth: float = 6e8,
                 ranks_per_node: int = 16) -> None:
        self.read_bandwidth, self.write_bandwidth = read_bandwidth, write_bandwidth
        self.decode_bandwidth, self.ranks_per_node = decode_bandwidth, ranks_per_node


def with_mtp_layers(metadata: Mapping[str, TensorMeta], config: Any) -> dict[str, TensorMeta]:
    """``metadata`` and the MTP layers ``config`` declares: each a copy of the last decoder layer
    plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head`` (the export's names for them)."""
    layers = int(getattr(config, "num_hidden_layers", 0))
    mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    out = dict(metadata)
    last = {m.group(2): meta for key, meta in metadata.items() if (m := _LAYER.match(key)) and
            int(m.group(1)) == layers - 1}
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    norm = metadata.get("model.norm.weight", TensorMeta((hidden,), torch.bfloat16))
    for layer in range(layers, layers + mtp):
        prefix = f"model.layers.{layer}."
        out.update({prefix + rest: meta for rest, meta in last.items()})
        out.update({prefix + "enorm.weight": norm, prefix + "hnorm.weight": norm,
                    prefix + "shared_head.norm.weight": norm,
                    prefix + "eh_proj.weight": TensorMeta((hidden, 2 * hidden), norm.dtype),
                    prefix + "shared_head.head.weight": TensorMeta((vocab, hidden), norm.dtype)})
    return out


def _source_chunks(metadata: Mapping[str, TensorMeta], source_dtype: torch.dtype) -> list[StoredChunk]:
    """One stored box per HF tensor, in ``source_dtype``, laid out in key order."""
    size, chunks, offset = torch.empty((), dtype=source_dtype).element_size(), [], 0
    for key in sorted(metadata, key=natural_key):
        shape = tuple(metadata[key].shape)
        length = math.prod(shape) * size
        chunks.append(StoredChunk(key, (0,) * len(shape), shape, "checkpoint", offset, length))
        offset += length
    return chunks


def plan_conversion(hf_config: Any, world: int, model: ConversionModel | None = None, *,
                    source_dtype: torch.dtype = torch.bfloat16, dtype: str = "bfloat16") -> dict:
    """What ``world`` ranks read and write converting a checkpoint of ``hf_config``'s model, and how long."""
    model = model or ConversionModel()
    metadata = with_mtp_layers(expected_metadata(hf_config), hf_config)
    plan = conversion_plan(metadata, hf_config, ExportOptions(dtype=dtype))
    work = assign_work(_source_chunks(metadata, source_dtype), world)
    read = [sum(c.length for c in chunks) for chunks in work]
    written = [sum(plan.tensors[c.key].nbytes for c in chunks) for chunks in work]
    nodes = math.ceil(world / model.ranks_per_node)
    node_seconds = []
    for node in range(nodes):
        ranks = range(node * model.ranks_per_node, min(world, (node + 1) * model.ranks_per_node))
        io = (sum(read[r] for r in ranks) / model.read_bandwidth + sum(written[r] for r in ranks)
              / model.write_bandwidth)
        node_seconds.append(max(io, max(read[r] for r in ranks) / model.decode_bandwidth))
    return dict(model_type=getattr(hf_config, "model_type", None), world=world, nodes=nodes,
                tensors=len(metadata), files=len(plan.files), bytes_read=sum(read),
                bytes_written=plan.total_tensor_bytes, max_rank_bytes_read=max(read),
                max_rank_bytes_written=max(written), balance=round(max(read) * world / max(sum(read), 1), 4),
                predicted_seconds=round(max(node_seconds), 3),
                assumptions=dict(read_bandwidth=model.read_bandwidth, write_bandwidth=model.write_bandwidth,
                                 decode_bandwidth=model.decode_bandwidth, ranks_per_node=model.ranks_per_node,
                                 source_dtype=str(source_dtype).removeprefix("torch."), dtype=dtype))


def format_conversion(report: Mapping[str, Any]) -> str:
    """``plan --convert``'s table: the totals, the busiest rank and the predicted time."""
    gb, size = 1e9, format_bytes
    assumed = report["assumptions"]
    return "\n".join([
        f"conversion of a {report['model_type']} checkpoint ({assumed['source_dtype']}) to HF {assumed['dtype']} "
        f"on {report['world']} ranks, {report['nodes']} node(s)",
        f"  read    {size(report['bytes_read'])} in all, {size(report['max_rank_bytes_read'])} on the "
        f"busiest rank (max / mean {report['balance']})",
        f"  written {size(report['bytes_written'])} in {report['files']} files, "
        f"{size(report['max_rank_bytes_written'])} on the busiest rank",
        f"  predicted {report['predicted_seconds']:,.4g} s at {assumed['read_bandwidth'] / gb:g} GB/s read and "
        f"{assumed['write_bandwidth'] / gb:g} GB/s write per node of {assumed['ranks_per_node']} ranks, "
        f"{assumed['decode_bandwidth'] / gb:g} GB/s decoding per rank",
    ])
