"""The recipe with one fault injected on one rank (tests/test_stage_faults.py): the recipe's own
command line (``nemo_moe_export.cli.main``) after wrapping one product function so that the rank
named in ``NME_FAULT`` stalls or raises where the fault says.

* ``torchrun ... tests/fault_rank.py ARGS...``: one rank, started by torchrun.
* ``python tests/fault_rank.py --plain N OUT ARGS...``: N plain processes, as srun starts them (no
  agent that ends the job; rank 0 hosts the rendezvous store), forked from this one once it has
  imported the package, and megatron-core for a megatron recipe (a rank then starts in a fraction
  of a second, not 9 s of imports on a busy machine). It only reaps them: ``OUT/rank<r>.out`` is
  rank r's output, ``OUT/ended.json`` when each ended (wall time) and its exit status.
* ``python tests/fault_rank.py --agent N OUT ARGS...``: N ranks under torchrun's own elastic agent
  (``torch.distributed.run``'s config for ``--standalone --nproc-per-node=N``: the agent hosts the
  store and ends every rank once one failed), started with the ``fork`` method from this process
  once it has imported the package; the same two outputs.

``NME_FAULT`` is JSON: ``rank``; ``kind`` ("stall": sleep 600 s, "raise": a RuntimeError, "kill":
SIGKILL of its own process); ``where`` ("mmlu": inside this rank's first decoder layer, at its
``call``-th forward of the evaluation at the end of training; "train": the same, at its ``call``-th
forward of training; "export": as the export's write step starts); ``record``: a file the fault's
wall time is written to.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import signal
import sys
import time
import traceback
import uuid

FAULT = json.loads(os.environ["NME_FAULT"])
RANK = int(os.environ.get("RANK", "-1"))  # set in each forked rank (--plain) before the fault is injected


def _fault() -> None:
    with open(FAULT["record"], "w") as f:
        f.write(repr(time.time()))
    if FAULT["kind"] == "stall":
        time.sleep(600)
    if FAULT["kind"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure on rank {RANK}")


def _first_layer(model):
    """This rank's first decoder layer: a torch stage's, or a megatron-core stage's."""
    parts = getattr(model, "parts", None)
    if parts is not None:
        return next(iter(parts[0].model.layers.values()))
    return model.gpt.decoder.layers[0]


def _inject_in_forward() -> None:
    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.job import stages

    build, evaluate = stages.build_sharded_model, MMLUCallback.on_train_end
    seen = {"evaluating": False, "calls": 0}

    def hook(*_args):
        if seen["evaluating"] != (FAULT["where"] == "mmlu"):  # a forward of the other phase
            return
        seen["calls"] += 1
        if seen["calls"] == FAULT.get("call", 2):
            _fault()

    def built(*args, **kwargs):
        model, layout = build(*args, **kwargs)
        _first_layer(model).register_forward_pre_hook(hook)
        return model, layout

    def evaluated(self, ctx):
        seen["evaluating"] = True
        return evaluate(self, ctx)

    stages.build_sharded_model, MMLUCallback.on_train_end = built, evaluated


def _inject_in_export() -> None:
    from nemo_moe_export.export.storage import SharedFilesystemWriter

    write = SharedFilesystemWriter.write

    def faulty(self, *args, **kwargs):
        _fault()
        return write(self, *args, **kwargs)

    SharedFilesystemWriter.write = faulty


def _inject() -> None:
    if RANK == FAULT["rank"]:
        _inject_in_export() if FAULT["where"] == "export" else _inject_in_forward()


def _rank(rank: int, world: int, out: str, args: list[str]) -> None:
    """In a forked child: become rank ``rank`` and run the recipe; never returns."""
    global RANK
    RANK = rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    fd = os.open(os.path.join(out, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _inject()
    from nemo_moe_export.cli import main

    try:
        status = main(args)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what a normal exit runs (the store's host waits there for its peers)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _preload(args: list[str]) -> None:
    """What every rank imports, imported once before forking: the package, and megatron-core for a
    megatron recipe (its modules are imported when the model is built: seconds per rank, 4 ranks)."""
    import nemo_moe_export.cli  # noqa: F401

    if any(arg.startswith("recipe=megatron") for arg in args):
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import nemo_moe_export.megatron.recipe  # noqa: F401


def _plain(world: int, out: str, args: list[str]) -> None:
    _preload(args)
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, out, args)
        ranks[pid] = rank
    ended = {}
    while ranks:
        pid, status = os.wait()
        ended[ranks.pop(pid)] = (time.time(), os.waitstatus_to_exitcode(status))
    with open(os.path.join(out, "ended.json"), "w") as f:
        json.dump(ended, f)


def _agent_rank(out: str, args: list[str]) -> None:
    """A rank the agent forked: the recipe, then its end time (a rank the agent stops has none)."""
    global RANK
    RANK = int(os.environ["RANK"])
    _inject()
    from nemo_moe_export.cli import main

    try:
        status = main(args)
    except BaseException:  # as a script under torchrun: the traceback on stderr, status 1
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    with open(os.path.join(out, f"ended{RANK}"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(status)


def _agent(world: int, out: str, args: list[str]) -> None:
    _preload(args)  # before the agent forks
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    parsed = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={world}", "--start-method=fork",
                                           "--redirects=3", f"--log-dir={out}/agent", "unused"])
    # what torch.distributed.run.run does for --standalone before building the same config
    parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(parsed)
    status = 0
    try:
        elastic_launch(config, _agent_rank)(out, args)
    except ChildFailedError:
        status = 1
    stopped = time.time()  # every rank had ended by now: the agent stops the rest once one failed
    ended = {}
    for rank in range(world):
        own = os.path.join(out, f"ended{rank}")
        ended[rank] = (float(open(own).read()) if os.path.exists(own) else stopped, status)
        logs = glob.glob(os.path.join(out, "agent", "*", "attempt_0", str(rank), "std*.log"))
        with open(os.path.join(out, f"rank{rank}.out"), "w") as f:
            f.write("".join(open(log).read() for log in sorted(logs)))
    with open(os.path.join(out, "ended.json"), "w") as f:
        json.dump(ended, f)


if __name__ == "__main__":
    if sys.argv[1] in ("--plain", "--agent"):
        launch = _plain if sys.argv[1] == "--plain" else _agent
        launch(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        from nemo_moe_export.cli import main

        _inject()
        sys.exit(main(sys.argv[1:]))
