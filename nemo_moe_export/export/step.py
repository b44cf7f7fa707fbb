"""The collective export step: sharded model -> HF checkpoint directory, with no gather.

Steps, each closed by ``Coordinator.agree`` (a monitored barrier under a timeout plus a status
exchange, so a failure or stall on any rank becomes the same clear error on every rank):

1. ``validate``  every rank resolves its inputs, builds the plan (pure, identical everywhere) and
                 its pieces; the plan digest and per-key element coverage are compared across
                 ranks (an all-reduce of one counter per key): every element must have exactly one
                 writer. Options that cannot be honoured are refused here, before any byte is
                 written.
2. ``prepare``   rank 0 creates a fresh temporary sibling directory ``.{name}.partial``.
3. ``headers``   the owner of each file (file i -> rank i % world) creates it at full size and writes
                 its header; rank 0 writes the index, ``config.json``, the generation config and
                 tokenizer files.
4. ``write``     every rank writes its primary pieces straight to their final offsets, then fsyncs.
5. ``verify``    rank 0 checks the structure from the bytes on disk (``verify_checkpoint``) and
                 fsyncs the directory.
6. ``publish``   rank 0 renames the directory into place atomically (and, with
                 ``overwrite="replace"``, swaps the old one out) and fsyncs the parent.

On any failure rank 0 removes the temporary directory; the target is never touched until step 6.

Filesystems: ``filesystem="shared"`` (default; Lustre/NFS/GPFS, every rank sees the target) has
every rank write its own bytes. ``filesystem="local"`` is for a target only some ranks can see
(node-local disk): the files are owned by ``writer_ranks`` (default: the ranks on rank 0's host)
and every other rank streams its slices to the owner of each file (``exchange.py``), still with
no gather and bounded buffers.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nemo_moe_export.adapters import StateDictAdapter, get_adapter
from nemo_moe_export.errors import ExportInputError
from nemo_moe_export.export.plan import INDEX_NAME, ExportPlan, plan_export
from nemo_moe_export.export.verify import verify_checkpoint
from nemo_moe_export.export.writer import write_headers, write_pieces
from nemo_moe_export.parallel import Coordinator

__all__ = ["ExportResult", "ExportStep", "export_hf_checkpoint"]

OVERWRITE_POLICIES = ("error", "replace")
FILESYSTEMS = ("shared", "local")


@dataclass
class ExportResult:
    path: str
    files: int
    tensors: int
    checkpoint_bytes: int
    rank_bytes_written: int
    seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    # This rank's write step: bytes staged (cast or device-to-host), seconds copying into staging
    # buffers and seconds in pwrite (summed over writer threads), against the step's wall time.
    io: dict[str, float] = field(default_factory=dict)


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ExportInputError("unknown dtype", key="dtype", expected="e.g. bfloat16, float16, float32",
                               actual=repr(dtype))
    return value


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plan_digest(plan: ExportPlan) -> str:
    h = hashlib.sha256()
    for f in plan.files:
        h.update(f.name.encode())
        h.update(f.header)
    return h.hexdigest()


def export_hf_checkpoint(
    output_dir: str | os.PathLike[str],
    model: Any = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    config: Any = None,
    adapter: StateDictAdapter | None = None,
    tokenizer: Any = None,
    generation_config: Any = None,
    dtype: torch.dtype | str | None = None,
    keep_dtype: tuple[str, ...] = (),
    max_shard_size: int | str = "5GB",
    group: Any = None,
    overwrite: str = "error",
    timeout_s: float = 600.0,
    staging_bytes: int = 64 << 20,
    writer_threads: int = 1,
    verify: bool = True,
    filesystem: str = "shared",
    writer_ranks: list[int] | None = None,
) -> ExportResult:
    """Export a (possibly sharded) model to a Hugging Face checkpoint; call on every rank of ``group``.

    Pass ``model`` (a transformers model, sharded or not) or ``state_dict`` + ``config``. No rank
    gathers the model: each writes its own shards into the final files. ``dtype`` casts floating
    weights (``keep_dtype`` regexes exempt keys); ``overwrite`` is ``"error"`` (refuse an existing
    target) or ``"replace"`` (swap it atomically). ``filesystem="local"`` routes every byte to
    ``writer_ranks`` (default: the ranks on rank 0's host) for targets other ranks cannot see.
    """
    t_start = time.perf_counter()
    coord = Coordinator(group, timeout_s=timeout_s, name="export")
    target = os.path.abspath(os.fspath(output_dir))
    parent, name = os.path.dirname(target), os.path.basename(target)
    partial = os.path.join(parent, f".{name}.partial")
    times: dict[str, float] = {}
    step_start = time.perf_counter()

    @contextmanager
    def step(name: str) -> Iterator[None]:
        """Run one step's body on this rank, then agree with every rank on how it went: an
        exception here, or on any peer, becomes the same PeerError on every rank."""
        nonlocal step_start
        error = None
        try:
            yield
        except BaseException as exc:  # reported to every rank by agree
            error = exc
        coord.agree(name, error)
        now = time.perf_counter()
        times[name] = round(now - step_start, 4)
        step_start = now

    # 1. validate -------------------------------------------------------------------------------
    with step("validate"):
        if overwrite not in OVERWRITE_POLICIES:
            raise ExportInputError("unknown overwrite policy", key="overwrite", expected=OVERWRITE_POLICIES,
                                   actual=repr(overwrite))
        if filesystem not in FILESYSTEMS:
            raise ExportInputError("unknown filesystem mode", key="filesystem", expected=FILESYSTEMS,
                                   actual=repr(filesystem))
        if staging_bytes <= 0 or staging_bytes % 8:
            raise ExportInputError("staging buffer size must be a positive multiple of 8 bytes",
                                   key="staging_bytes", expected="e.g. 64 << 20", actual=staging_bytes)
        if not isinstance(writer_threads, int) or writer_threads < 1:
            raise ExportInputError("writer_threads must be a positive integer", key="writer_threads",
                                   expected=">= 1", actual=repr(writer_threads))
        if writer_ranks is not None and (
            not writer_ranks or any(not 0 <= r < max(coord.world_size, 1) for r in writer_ranks)
        ):
            raise ExportInputError("writer_ranks must name ranks of the group", key="writer_ranks",
                                   expected=f"a non-empty subset of 0..{coord.world_size - 1}",
                                   actual=writer_ranks)
        if os.path.exists(target) and overwrite == "error":
            raise ExportInputError("export target already exists", key=target, expected="no directory there",
                                   actual="an existing path", hint='pass overwrite="replace" to swap it atomically')
        if not os.path.isdir(parent):
            raise ExportInputError("parent of the export target does not exist", key=parent,
                                   expected="an existing directory on a filesystem shared by all ranks",
                                   actual="missing")
        if state_dict is None:
            if model is None:
                raise ExportInputError("nothing to export", key="model", expected="a model or a state_dict",
                                       actual="neither")
            state_dict = model.state_dict()
        config = config if config is not None else getattr(model, "config", None)
        if config is None:
            raise ExportInputError("no HF config", key="config", expected="model.config or config=",
                                   actual=None)
        if generation_config is None and model is not None and getattr(model, "can_generate", lambda: False)():
            generation_config = getattr(model, "generation_config", None)
        adapter = adapter or get_adapter(config)
        export_dtype = _parse_dtype(dtype)
        plan = plan_export(adapter.hf_metadata(state_dict), dtype=export_dtype, keep_dtype=keep_dtype,
                           max_shard_size=max_shard_size)
        pieces = [p for p in adapter.to_hf(state_dict).values() if p.primary]
        keys = list(plan.tensors)
        position = {k: i for i, k in enumerate(keys)}
        coverage = torch.zeros(len(keys), dtype=torch.int64)
        for p in pieces:
            coverage[position[p.key]] += p.tensor.numel()

    digests = [None] * coord.world_size
    if coord.active:
        import torch.distributed as dist

        dist.all_gather_object(digests, _plan_digest(plan), group=coord.group)
        if len(set(digests)) != 1:
            raise ExportInputError("ranks computed different export plans", key="plan", expected="one plan",
                                   actual=f"{len(set(digests))} distinct plans",
                                   hint="every rank must export the same model with the same options")
    coord.all_reduce_sum(coverage)
    expected = torch.tensor([math.prod(plan.tensors[k].shape) for k in keys], dtype=torch.int64)
    wrong = (coverage != expected).nonzero().flatten().tolist()
    if wrong:
        first = keys[wrong[0]]
        raise ExportInputError(
            f"{len(wrong)} tensors would not be written exactly once", key=first,
            expected=f"{int(expected[wrong[0]])} elements with one writer each",
            actual=f"{int(coverage[wrong[0]])} written by primaries across ranks",
            hint="replicated tensors must have a single primary; check the mesh and placements",
        )

    if filesystem == "local":
        from nemo_moe_export.export.exchange import same_host_ranks

        writers = sorted(writer_ranks) if writer_ranks else same_host_ranks(coord)
    else:
        writers = [coord.global_rank(r) for r in range(coord.world_size)]
    owners = {f.name: writers[i % len(writers)] for i, f in enumerate(plan.files)}
    my_global_rank = coord.global_rank(coord.rank)

    try:
        # 2. prepare ----------------------------------------------------------------------------
        with step("prepare"):
            if coord.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # a stale attempt
                os.makedirs(partial)

        # 3. headers and small files ------------------------------------------------------------
        with step("headers"):
            write_headers(plan, partial, [name for name, owner in owners.items() if owner == my_global_rank])
            if coord.rank == 0:
                _write_metadata_files(partial, plan, config, export_dtype, generation_config, tokenizer)

        # 4. tensor bytes ----------------------------------------------------------------------
        with step("write"):
            if filesystem == "local":
                from nemo_moe_export.export.exchange import exchange_and_write

                stats = exchange_and_write(plan, pieces, partial, owners, coord, staging_bytes=staging_bytes,
                                           writer_threads=writer_threads)
            else:
                stats = write_pieces(plan, pieces, partial, staging_bytes=staging_bytes,
                                     writer_threads=writer_threads)

        # 5. verify ----------------------------------------------------------------------------
        with step("verify"):
            if coord.rank == 0:
                if verify:
                    report = verify_checkpoint(partial)
                    if not report.ok:
                        raise RuntimeError("the written checkpoint failed verification:\n" + report.summary())
                _fsync_path(partial)

        # 6. publish ---------------------------------------------------------------------------
        with step("publish"):
            if coord.rank == 0:
                _publish(partial, target, overwrite)
    except BaseException:
        if coord.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return ExportResult(
        path=target, files=len(plan.files), tensors=len(plan.tensors), checkpoint_bytes=plan.total_tensor_bytes,
        rank_bytes_written=stats.bytes_written, seconds=round(time.perf_counter() - t_start, 4),
        step_seconds=times,
        io={k: v for k, v in asdict(stats).items() if k != "files_touched"},
    )


def _write_metadata_files(directory: str, plan: ExportPlan, config: Any, dtype: torch.dtype | None,
                          generation_config: Any, tokenizer: Any) -> None:
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        f.write(plan.index_json())
        f.flush()
        os.fsync(f.fileno())
    config = copy.deepcopy(config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.endswith(".safetensors") and os.path.isfile(path):
            _fsync_path(path)


def _publish(partial: str, target: str, overwrite: str) -> None:
    parent = os.path.dirname(target)
    if os.path.exists(target):
        if overwrite != "replace":
            raise ExportInputError("export target appeared while exporting", key=target,
                                   expected="no directory there", actual="an existing path")
        trash = os.path.join(parent, f".{os.path.basename(target)}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(target, trash)
        os.rename(partial, target)
        _fsync_path(parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(partial, target)
        _fsync_path(parent)


@dataclass
class ExportStep:
    """The export as a recipe step: configure once, call at the end of training on every rank."""

    output_dir: str
    dtype: str | None = None
    max_shard_size: int | str = "5GB"
    overwrite: str = "error"
    timeout_s: float = 600.0
    keep_dtype: tuple[str, ...] = ()
    verify: bool = True
    filesystem: str = "shared"
    writer_threads: int = 1

    def __call__(self, model: Any = None, **kwargs: Any) -> ExportResult:
        return export_hf_checkpoint(
            self.output_dir, model, dtype=self.dtype, max_shard_size=self.max_shard_size,
            overwrite=self.overwrite, timeout_s=self.timeout_s, keep_dtype=tuple(self.keep_dtype),
            verify=self.verify, filesystem=self.filesystem, writer_threads=self.writer_threads, **kwargs,
        )
