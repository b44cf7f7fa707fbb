"""``nemo-moe-export convert SRC OUT [--config HF_CONFIG] [...]``: the conversion on the command line.

Runs on every rank torchrun (or srun, or the NeMo-Run launcher) started, or starts ``--nproc N``
local ranks itself through torchrun, as the recipe does (docs/convert.md). A refused input is one
line on stderr and exit status 1, from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nemo_moe_export.convert.engine import PROGRESS_S, convert_checkpoint
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.options import OVERWRITE_POLICIES, QUANTIZE_METHODS, ExportOptions
from nemo_moe_export.job.torchrun import leave_after_rank0, run_torchrun
from nemo_moe_export.parallel import PeerError, init_distributed
from nemo_moe_export.watchdog import finished, report_job_failure, watch_job

__all__ = ["convert_main", "convert_parser", "without_nproc"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nemo_moe_export/


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-moe-export convert",
                                     description="Convert a training checkpoint (megatron-core torch_dist, torchtitan "
                                                 "DCP, AutoModel) to an HF checkpoint on N CPU ranks, no model.")
    parser.add_argument("src", help="the checkpoint directory")
    parser.add_argument("out", help="the HF checkpoint directory to write (its parent must exist)")
    parser.add_argument("--config", default=None,
                        help="the model's HF config: a config.json or its directory (may be omitted for a "
                             "Megatron-LM torch_dist checkpoint whose common.pt holds its args)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="cast floating weights as transformers does (default: keep the stored dtypes)")
    parser.add_argument("--quantize", choices=QUANTIZE_METHODS,
                        help="fp8_block: DeepSeek's FP8 block format, as the export writes it (docs/convert.md#fp8)")
    parser.add_argument("--tokenizer", help="a directory whose tokenizer files are copied beside the weights")
    parser.add_argument("--overwrite", choices=OVERWRITE_POLICIES, default=ExportOptions.overwrite,
                        help="an existing OUT: refuse it (error) or replace it atomically once written")
    parser.add_argument("--max-shard-size", default=ExportOptions.max_shard_size,
                        help=f"per output file, as transformers' (default {ExportOptions.max_shard_size})")
    parser.add_argument("--nproc", type=int, default=None, help="start N local ranks (torchrun); under torchrun, omit")
    parser.add_argument("--progress-s", type=float, default=PROGRESS_S,
                        help=f"seconds between two progress lines of a rank (default {PROGRESS_S:g})")
    return parser


def _options(args: argparse.Namespace) -> dict:
    return dict(config=args.config, dtype=args.dtype, quantize=args.quantize, tokenizer=args.tokenizer,
                overwrite=args.overwrite, max_shard_size=args.max_shard_size, progress_s=args.progress_s)


def convert_main(argv: list[str]) -> int:
    args = convert_parser().parse_args(argv)
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        if args.nproc < 1:
            raise InputError("--nproc must be at least 1", key="--nproc", expected=">= 1", actual=args.nproc)
        return run_torchrun(args.nproc, ["convert", *without_nproc(argv)])
    return _convert_here(args)


def without_nproc(argv: list[str]) -> list[str]:
    """The command's arguments as each rank runs them: ``--nproc N`` is the launcher's."""
    return [a for i, a in enumerate(argv) if a != "--nproc" and not a.startswith("--nproc=")
            and (i == 0 or argv[i - 1] != "--nproc")]


def _convert_here(args: argparse.Namespace) -> int:
    """Convert on this rank (one of torchrun's, one of plain processes started as srun does with
    ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or alone); the exit status."""
    init_distributed("cpu", timeout_s=ExportOptions.timeout_s)  # the one default of every agreement's wait
    watch_job()  # as the recipe: without torchrun's agent, nothing else ends a rank when a peer failed
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        result = convert_checkpoint(args.src, args.out, **_options(args))
    except (InputError, PeerError) as exc:
        report_job_failure(exc)
        refused = _refused_input(exc)
        if refused is None:
            raise
        if rank0:
            print(f"nemo-moe-export: error: {refused}", file=sys.stderr, flush=True)
        leave_after_rank0()
        return 1
    finished()  # rank 0 ending first must not read as a failure to this rank's watchdog
    if rank0:
        print(json.dumps(dict(path=result.path, format=result.format, files=result.files, tensors=result.tensors,
                              source_bytes=result.source_bytes, checkpoint_bytes=result.checkpoint_bytes,
                              seconds=result.seconds, rank0_bytes_read=result.rank_bytes_read)))
    if _is_the_command():
        # End here, as the watchdog ends a rank: the interpreter's own exit tears down the gloo group
        # and the watchdog's store connection while their threads still wait, which ended launched
        # ranks in std::terminate (status -6) after a successful conversion.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _is_the_command() -> bool:
    """This process is ``nemo-moe-export`` itself (a launched rank), not a caller of ``main`` in-process."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return os.path.basename(argv0) == "nemo-moe-export" or argv0 == os.path.join(_PACKAGE_DIR, "__main__.py")


def _refused_input(exc: BaseException) -> BaseException | None:
    """What to print for a refused input: this rank's own InputError (raised, or the cause of the
    agreement that failed), or the agreement's report where only a peer failed (it names that rank
    and its error); None for a failure of another kind (re-raised, with its traceback)."""
    if isinstance(exc, InputError):
        return exc
    if isinstance(exc.__cause__, InputError):
        return exc.__cause__
    return exc if exc.__cause__ is None else None
