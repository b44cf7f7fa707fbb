"""``convert_checkpoint``: a stored training checkpoint -> an HF checkpoint, on every rank, no model.

Called on every rank of ``group`` (docs/design.md#checkpoint-conversion):

1. ``validate``  every rank reads the index from the checkpoint's own metadata (no communication),
                 picks the format's key table, maps every stored tensor to HF keys (unknown keys
                 refused, optimizer / train state skipped by rule), checks them against the HF
                 config's model, checks the data files, lays out the export's plan and its own
                 share of the reading (``assign.py``), whose reads start before the model check
                 (read ahead, bounded: nothing is written yet); the ranks agree on one plan and rank 0's
                 job id. Then each rank maps its boxes (as meta tensors, nothing read) to pieces
                 and the ranks agree that every HF element has exactly one writer.
2-6.             the export's own steps (``export/steps.py``): prepare, headers, write, verify,
                 publish, with its fault handling and overwrite policy. ``write`` streams: a rank
                 reads a run of its boxes (``reader.py``), maps each to its HF pieces and hands
                 them to the export's writer, which writes them in place (cast through its staging
                 buffers) before the next run is read: memory is bounded by the read and staging
                 buffers, not by the model. With ``quantize="fp8_block"`` the boxes feeding one
                 128 x 128 block are one unit, assigned and read whole, then quantized by the
                 export's own FP8 code (``fp8.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_moe_export.collectives import FINGERPRINT_WORDS, fingerprint_words
from nemo_moe_export.convert.assign import assign_units, model_chunks
from nemo_moe_export.convert.checks import check_shapes, hf_config_of
from nemo_moe_export.convert.fp8 import Fp8Layout, fp8_layout, units_of, write_units
from nemo_moe_export.convert.index import CheckpointIndex, StoredChunk, read_index
from nemo_moe_export.convert.reader import ChunkReader, ReadStats, check_files
from nemo_moe_export.convert.formats import recorded_config, table_for
from nemo_moe_export.convert.tables import CheckpointTable, meta_pieces
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.casting import float32_keys, fp32_patterns
from nemo_moe_export.export.options import ExportOptions
from nemo_moe_export.export.plan import ExportPlan, check_coverage, element_counts, plan_export
from nemo_moe_export.export.quantize import quantization_config
from nemo_moe_export.export.steps import StepJob, Steps, cyclic_gc_paused, run_after_validate
from nemo_moe_export.export.storage import SharedFilesystemWriter, StorageWriter, writer_for
from nemo_moe_export.export.target import ExportTarget, export_id_of, new_export_id, write_metadata_files
from nemo_moe_export.export.writer import WriteStats
from nemo_moe_export.parallel import Coordinator

__all__ = ["ConvertResult", "TOKENIZER_FILES", "conversion_plan", "convert_checkpoint"]

# The tokenizer files copied from a tokenizer directory (those transformers' tokenizers write).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
PROGRESS_S = 10.0  # the least seconds between two progress lines of a rank


@dataclass
class ConvertResult:
    path: str
    format: str
    files: int
    tensors: int
    checkpoint_bytes: int  # the HF checkpoint's tensor bytes
    source_bytes: int  # the stored model bytes every rank together reads
    rank_bytes_read: int
    rank_bytes_written: int
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    io: dict[str, float] = field(default_factory=dict)
    reads: int = 0
    items: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _ConvertJob(StepJob):
    """A validated conversion: what the export's steps after validate read (``steps.StepJob``)."""

    coordinator: Coordinator
    options: ExportOptions
    target: ExportTarget
    plan: ExportPlan
    index: CheckpointIndex
    table: CheckpointTable
    config: Any
    tokenizer: Any
    units: list[list[StoredChunk]]  # this rank's boxes, in read order, in units read whole (FP8: fp8.py)
    fp8: Fp8Layout | None
    writer: StorageWriter
    owners: dict[str, int]
    reader: ChunkReader | None  # reading ahead since validate (unquantized; FP8 reads unit by unit)

    def close_reader(self) -> None:
        if self.reader is not None:
            self.reader.close()

    @property
    def work(self) -> list[StoredChunk]:
        return [c for unit in self.units for c in unit]

    def write_small_files(self, directory: str) -> None:
        tokenizer = None if _is_path(self.tokenizer) else self.tokenizer
        write_metadata_files(directory, self.plan, self.config, self.options.torch_dtype, tokenizer=tokenizer,
                             quantization=quantization_config(self.options))
        if _is_path(self.tokenizer):
            _copy_tokenizer(os.fspath(self.tokenizer), directory)


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _copy_tokenizer(source: str, directory: str) -> None:
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path) and not (name == "generation_config.json" and os.path.exists(os.path.join(directory, name))):
            shutil.copyfile(path, os.path.join(directory, name))


def convert_checkpoint(src: str | os.PathLike[str], out: str | os.PathLike[str], *, config: Any = None,
                       dtype: str | None = None, quantize: str | None = None, tokenizer: Any = None,
                       group: Any = None, progress_s: float | None = PROGRESS_S, **overrides: Any) -> ConvertResult:
    """Convert the checkpoint at ``src`` (megatron-core ``torch_dist``, torchtitan DCP or AutoModel's)
    to an HF checkpoint at ``out``; call on every rank of ``group`` (any number of ranks).

    ``config`` is the model's HF config (a ``PretrainedConfig``, a ``config.json`` or its directory;
    None: the one the checkpoint records, megatron's ``common.pt`` ``args``, else refused);
    ``dtype`` casts as the export does (what transformers keeps in float32 stays float32);
    ``tokenizer`` (a directory or a tokenizer) is written beside; ``overrides`` are
    :class:`~nemo_moe_export.export.options.ExportOptions` fields (``overwrite``, ``max_shard_size``,
    ``staging_bytes``, ``timeout_s``, ...). Nothing is written until every rank has validated. Each
rank prints a progress line (bytes read / its total, rate) every ``progress_s`` seconds (None: none).
    """
    started = time.perf_counter()
    try:
        options, refused = ExportOptions.of(None, dtype=dtype, quantize=quantize, **overrides), None
    except (TypeError, ValueError) as exc:
        options, refused = ExportOptions(), exc
    steps = Steps(Coordinator(group, timeout_s=options.timeout_s, name="convert"))
    with cyclic_gc_paused():
        stats, reads = WriteStats(), ReadStats()
        job = _validate(steps, src, out, options, refused, config, tokenizer, reads)

        def write() -> WriteStats:
            nonlocal stats
            stats = _stream(job, reads, progress_s)
            return stats

        try:
            run_after_validate(steps, job, write)
        finally:
            job.close_reader()
    return ConvertResult(
        path=job.target.path, format=job.index.format, files=len(job.plan.files), tensors=len(job.plan.tensors),
        checkpoint_bytes=job.plan.total_tensor_bytes, source_bytes=sum(c.length for c in model_chunks(
            job.index, job.table.skipped)), rank_bytes_read=reads.bytes_read, rank_bytes_written=stats.bytes_written,
        seconds=round(time.perf_counter() - started, 4), step_seconds=steps.seconds,
        io={**stats.as_io(), "read_seconds": round(reads.seconds, 4)}, reads=reads.reads, items=reads.items,
        notes=list(job.target.notes))


PLAN_WORDS = FINGERPRINT_WORDS + 1  # the plan's fingerprint words and rank 0's job id


def _plan_words(plan: ExportPlan, rank: int) -> torch.Tensor:
    job_id = torch.tensor([new_export_id() if rank == 0 else 0], dtype=torch.int64)
    return torch.cat([fingerprint_words(plan.digest()), job_id])


def _refuse_unsupported(options: ExportOptions) -> None:
    if options.filesystem != "shared":
        raise InputError("the conversion writes to a filesystem every rank sees", key="filesystem",
                         expected="shared", actual=options.filesystem)


def _validate(steps: Steps, src: Any, out: Any, options: ExportOptions, refused: Exception | None,
              config: Any, tokenizer: Any, reads: ReadStats) -> _ConvertJob:
    """Step 1 (module docstring): rank-local checks and plan, agreed; then coverage, agreed."""
    local: dict[str, Any] = {}
    try:
        return _validated(steps, src, out, options, refused, config, tokenizer, reads, local)
    except BaseException:
        if local.get("reader") is not None:  # a refusal here or on a peer: stop reading ahead
            local["reader"].close()
        raise


def _validated(steps: Steps, src: Any, out: Any, options: ExportOptions, refused: Exception | None,
               config: Any, tokenizer: Any, reads: ReadStats, local: dict[str, Any]) -> _ConvertJob:
    coordinator = steps.coordinator
    with steps.timed("validate"):
        with steps.agreed("validate", PLAN_WORDS) as shared:
            if refused is not None:
                raise refused
            _refuse_unsupported(options)
            _lay_out(src, out, options, config, tokenizer, coordinator, reads, local)
            shared.sums = _plan_words(local["plan"], coordinator.rank)
        plan = local["plan"]
        coordinator.require_same("conversion plans", plan.digest(), key="plan", summed=shared.totals[:-1],
                                 hint="every rank must convert the same checkpoint with the same config and options")
        export_id = export_id_of(int(shared.totals[-1]))
        with steps.agreed("validate coverage", len(plan.tensors)) as shared:
            pieces = list(meta_pieces(local["table"], local["index"], [c for u in local["units"] for c in u]))
            shared.sums = element_counts(plan, local["fp8"].with_scales(pieces) if local["fp8"] else pieces)
        check_coverage(plan, shared.totals)
        writer = writer_for(options, coordinator)
        plan = plan.stamped(export_id)
    return _ConvertJob(coordinator, options, local["target"].for_job(export_id), plan, local["index"], local["table"],
                       local["config"], tokenizer, local["units"], local["fp8"], writer, writer.file_owners(plan),
                       local["reader"])


def _lay_out(src: Any, out: Any, options: ExportOptions, config: Any, tokenizer: Any, coordinator: Coordinator,
            reads: ReadStats, local: dict[str, Any]) -> None:
    """What each rank works out alone, into ``local``: the index, table, checks, plan and its share
    of the reading. Unquantized, this rank's reads start before the checks that build transformers'
    model (the longest of them): they read ahead, bounded (``ChunkReader``), and nothing is
    written until every rank has validated."""
    target = ExportTarget.at(out)
    target.check(options.overwrite)
    index = read_index(src)
    hf_config = hf_config_of(config if config is not None else recorded_config(index))
    if _is_path(tokenizer) and not os.path.isdir(tokenizer):
        raise InputError("the tokenizer directory does not exist", key="tokenizer", expected="a directory",
                         actual=os.fspath(tokenizer))
    table = table_for(index, hf_config)
    metadata = table.hf_metadata(index)
    chunks = model_chunks(index, table.skipped)
    check_files(index, chunks)
    world = max(coordinator.world_size, 1)
    local.update(target=target, config=hf_config, index=index, table=table, fp8=None, reader=None)
    if options.quantize is None:
        local["units"] = assign_units([[c] for c in chunks], world)[coordinator.rank]
        local["reader"] = ChunkReader(index, [c for unit in local["units"] for c in unit], reads)
    check_shapes(metadata, hf_config)
    local["plan"] = conversion_plan(metadata, hf_config, options)
    if options.quantize is not None:  # the export's FP8 plan; boxes feeding one block in one unit (fp8.py)
        local["plan"], local["fp8"] = fp8_layout(local["plan"], options, hf_config)
        local["units"] = assign_units(units_of(chunks, table, index, local["fp8"]), world)[coordinator.rank]


def conversion_plan(metadata: dict[str, Any], hf_config: Any, options: ExportOptions) -> ExportPlan:
    """The HF checkpoint's layout for ``metadata`` (the table's HF keys) before any quantization: the
    export's plan, cast as the export casts (what transformers keeps float32 for ``hf_config`` stays
    float32)."""
    float32 = float32_keys(fp32_patterns(options.torch_dtype, hf_config), {k: k for k in metadata})
    return plan_export(metadata, dtype=options.torch_dtype, keep_dtype=options.keep_dtype,
                       max_shard_size=options.max_shard_bytes, keep_float32=float32)


def _stream(job: _ConvertJob, reads: ReadStats, progress_s: float | None) -> WriteStats:
    """Step 4 (module docstring): read this rank's boxes run by run, write their pieces in place."""
    if not isinstance(job.writer, SharedFilesystemWriter):
        raise AssertionError("the conversion writes through the shared-filesystem writer")
    writer = job.writer.batch_writer(job.plan, job.target.partial, pinned=False)
    line = _ProgressLine(job.coordinator.rank, sum(c.length for c in job.work), progress_s)
    try:
        if job.fp8 is not None:  # quantized once a unit is whole (fp8.py)
            write_units(job.index, job.table, job.units, job.fp8, reads, writer.write, line.update)
        else:
            for chunk, tensor in job.reader:
                writer.write(job.table.pieces(chunk.key, chunk.offsets, tensor))
                line.update(chunk.length)
    except BaseException:
        writer.abandon()
        raise
    stats = writer.close()
    line.close()
    return stats


class _ProgressLine:
    """A line per rank on stderr every ``interval_s`` seconds: bytes read / its total and the rate,
    and a last one at the end once any was printed (a short conversion prints none)."""

    def __init__(self, rank: int, total: int, interval_s: float | None) -> None:
        self.rank, self.total, self.interval_s = rank, total, interval_s
        self.done, self.printed = 0, False
        self.started = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.interval_s is not None and now - self.last >= self.interval_s:
            self._print(now)

    def _print(self, now: float) -> None:
        rate = self.done / 2**20 / max(now - self.started, 1e-9)
        print(f"convert rank {self.rank}: {self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB read "
              f"({rate:.1f} MiB/s)", file=sys.stderr, flush=True)
        self.printed, self.last = True, now

    def close(self) -> None:
        if self.printed:
            self._print(time.perf_counter())
