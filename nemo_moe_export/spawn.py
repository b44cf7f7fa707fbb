"""Run a function on N local CPU ranks with a real gloo process group (tests, benchmarks, demos).

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises
``torch.distributed`` (gloo, a file store), calls ``fn(rank, world_size, *args)`` and returns the
per-rank results. Ranks are forked from one server process that has already imported torch,
transformers and this package (``_PRELOAD``): a freshly spawned rank would import them again, seconds
of CPU each, times the ranks, on every call. Each rank still gets the caller's environment and
``sys.path`` as they are at the call. A rank that raises makes every rank's result an error report in the parent
(with the failing rank's traceback); a run that outlives ``timeout_s`` is killed and reported with
the ranks that had not finished, so a deadlock never hangs the caller.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["SpawnError", "spawn"]

# What the fork server imports once (a module that fails to import is skipped): everything the ranks
# of the tests, benchmarks and demos import, so a rank starts in a fraction of a second.
_PRELOAD = (
    "torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
    "safetensors.torch", "transformers",
    "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.kimi_linear.modeling_kimi_linear",
    "nemo_moe_export.export", "nemo_moe_export.evaluate", "nemo_moe_export.tiny_models",
    "megatron.core", "megatron.core.models.gpt",  # where installed (the tests' megatron-core)
)


class SpawnError(RuntimeError):
    """One or more ranks failed or did not finish in time."""


def _child(rank: int, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], workdir: str,
           pg_timeout_s: float, threads: int, environ: dict[str, str] | None = None) -> None:
    torch.set_num_threads(threads)
    if environ is not None:  # the fork server's environment is the one it started with, not the caller's now
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            outcome = ("ok", fn(rank, world_size, *args))
        finally:
            if dist.is_initialized():  # ``fn`` may have ended the group itself (a worker that re-forms worlds)
                dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which raises
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(result_path + ".tmp", result_path)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises :class:`SpawnError` if
    any rank raised (message includes every failing rank's traceback) or if the run exceeds
    ``timeout_s`` (message names the ranks still running).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # read when the server starts: the first call in this process
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="nme-spawn-") as workdir:
        procs = [
            ctx.Process(target=_child, args=(r, world_size, fn, args, workdir, pg_timeout_s, threads_per_rank, environ),
                        daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        outcomes: list[tuple[str, Any]] = []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            elif r in stuck:
                outcomes.append(("error", f"still running after {timeout_s:.0f} s (killed)"))
            else:
                outcomes.append(("error", f"exited with code {procs[r].exitcode} and no result"))
    errors = [(r, msg) for r, (status, msg) in enumerate(outcomes) if status != "ok"]
    if errors:
        head = f"{len(errors)} of {world_size} ranks failed"
        if stuck:
            head += f"; ranks {stuck} did not finish within {timeout_s:.0f} s"
        raise SpawnError(head + "\n" + "\n".join(f"--- rank {r}: {msg}" for r, msg in errors))
    return [value for _, value in outcomes]
