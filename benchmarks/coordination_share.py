"""The planner's coordination share of a DeepSeek-V3 and a Kimi K2 export at 1,024 GPUs, on the
AutoModel and Megatron-Bridge meshes of their recipes (docs/design.md#planner).

Runs ``nemo-moe-export plan --json`` (of the package on ``sys.path``: point ``PYTHONPATH`` at an
older tree to compare) for each row, with the published ``config.json`` of each model
(``benchmarks/configs``), bf16, GPUs, 5 GB/s per node of 8, and prints per row the predicted
seconds, the write and the coordination (seconds and share), and the parts coordination is made of.

    python benchmarks/coordination_share.py --out /tmp/share.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--world", "1024", "--dtype", "bfloat16", "--node-bandwidth", "5GB", "--ranks-per-node", "8", "--json"]
# The reference's meshes at 1,024 GPUs (AutoModel's Kimi K2 recipe, PP8 x EP32 on 256, scaled by its FSDP axis).
ROWS = {
    "deepseek_v3 automodel PP4x2 virtual x EP64 x ep_shard 4": ("deepseek_v3", ["--layout", "ep_fsdp", "--ep", "64",
                                                                                "--pp", "4", "--stages-per-rank", "2"]),
    "kimi_k2 automodel PP8x2 virtual x EP32 x ep_shard 4": ("kimi_k2", ["--layout", "ep_fsdp", "--ep", "32", "--pp", "8",
                                                                        "--stages-per-rank", "2"]),
    "deepseek_v3 megatron-bridge TP2+SP x PP16 x EP64 (DP32)": ("deepseek_v3", ["--layout", "ep", "--ep", "64", "--tp",
                                                                                 "2", "--sp", "--pp", "16"]),
    "kimi_k2 megatron-bridge TP2+SP x PP16 x EP32 (DP32)": ("kimi_k2", ["--layout", "ep", "--ep", "32", "--tp", "2",
                                                                        "--sp", "--pp", "16"]),
}
PARTS = ("coordinator_setup_s", "agreements_s", "coverage_s", "replica_check_s", "row_exchange_s", "object_gathers_s",
         "agreement_polling_s", "declared_check_s")


def plan(model: str, flags: list[str]) -> dict:
    config = os.path.join(HERE, "configs", f"{model}.json")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "nemo_moe_export", "plan", "--config", config, *flags, *COMMON],
                         check=True, capture_output=True, text=True).stdout
    t = json.loads(out)["time"]
    row = dict(seconds=t["seconds"], write_s=t["write_s"], coordination_s=t["coordination_s"],
               coordination_share=t["coordination_share"], command_s=round(time.perf_counter() - started, 1))
    row.update({k: t[k] for k in PARTS if k in t})
    row.update({k: v for k, v in t.get("pipeline", {}).items() if k != "by_pipeline_rank"})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rows", nargs="*", help="substrings of the rows to run (default: all)")
    args = parser.parse_args()
    rows = {name: spec for name, spec in ROWS.items() if not args.rows or any(r in name for r in args.rows)}
    results = {name: plan(model, flags) for name, (model, flags) in rows.items()}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
