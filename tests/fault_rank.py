"""One rank of the recipe with one fault injected, as ``python tests/fault_rank.py ARGS...`` (plain
processes, the way srun starts them) or ``torchrun ... tests/fault_rank.py ARGS...``: the recipe's
own command line (``nemo_moe_export.cli.main``), after wrapping one product function so that the
rank named in ``NME_FAULT`` stalls or raises where the fault says (tests/test_stage_faults.py).

``NME_FAULT`` is JSON: ``rank``; ``kind`` ("stall": sleep 600 s, "raise": a RuntimeError);
``where`` ("mmlu": inside this rank's first decoder layer, at its ``call``-th forward of the
evaluation at the end of training;
"export": as the export's write step starts); ``record``: a file the fault's wall time is written to.
"""

from __future__ import annotations

import json
import os
import sys
import time

FAULT = json.loads(os.environ["NME_FAULT"])
RANK = int(os.environ["RANK"])


def _fault() -> None:
    with open(FAULT["record"], "w") as f:
        f.write(repr(time.time()))
    if FAULT["kind"] == "stall":
        time.sleep(600)
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
        if not seen["evaluating"]:  # a training forward: the fault is the evaluation's
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


if RANK == FAULT["rank"]:
    _inject_in_forward() if FAULT["where"] == "mmlu" else _inject_in_export()

if __name__ == "__main__":
    from nemo_moe_export.cli import main

    sys.exit(main(sys.argv[1:]))
