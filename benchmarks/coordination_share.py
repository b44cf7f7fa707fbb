"""The planner's rows of the README: DeepSeek-V3, Kimi K2 and Qwen3-235B exports on their recipes'
meshes (EP 64 at 256 and 1,024 GPUs; AutoModel's and Megatron-Bridge's), with the coordination
share of each (docs/design.md#planner).

Runs ``nemo-moe-export plan --json`` (of the package in the working directory or on ``sys.path``:
run it from an older tree's folder to compare) for each row, in parallel processes, with the
published ``config.json`` of each model (``benchmarks/configs``), bf16, GPUs, 5 GB/s per node of 8,
and prints per row the checkpoint, bytes per rank, the predicted seconds, the write and the
coordination (seconds and share), and the parts coordination is made of.

    python benchmarks/coordination_share.py --out /tmp/rows.json
    python benchmarks/coordination_share.py --rows automodel megatron      # rows whose name has these
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from output import emit  # noqa: E402  (benchmarks/output.py)

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--dtype", "bfloat16", "--node-bandwidth", "5GB", "--ranks-per-node", "8", "--json"]
EP64 = ["--strategy", "ep", "--ep", "64"]
# The reference's meshes (AutoModel's Kimi K2 recipe, PP8 x EP32 on 256, scaled to 1,024 by its FSDP axis).
ROWS = {
    "deepseek_v3 EP64 256": ("deepseek_v3", 256, EP64),
    "deepseek_v3 EP64 1024": ("deepseek_v3", 1024, EP64),
    "kimi_k2 EP64 256": ("kimi_k2", 256, EP64),
    "kimi_k2 EP64 1024": ("kimi_k2", 1024, EP64),
    "deepseek_v3 automodel PP4x2 virtual x EP64 x ep_shard 4, 1024": (
        "deepseek_v3", 1024, ["--strategy", "ep_fsdp", "--ep", "64", "--pp", "4", "--stages-per-rank", "2"]),
    "kimi_k2 automodel PP8x2 virtual x EP32 x ep_shard 4, 1024": (
        "kimi_k2", 1024, ["--strategy", "ep_fsdp", "--ep", "32", "--pp", "8", "--stages-per-rank", "2"]),
    "deepseek_v3 megatron-bridge TP2+SP x PP16 x EP64 (DP32), 1024": (
        "deepseek_v3", 1024, ["--strategy", "ep", "--ep", "64", "--tp", "2", "--sp", "--pp", "16"]),
    "kimi_k2 megatron-bridge TP2+SP x PP16 x EP32 (DP32), 1024": (
        "kimi_k2", 1024, ["--strategy", "ep", "--ep", "32", "--tp", "2", "--sp", "--pp", "16"]),
    "kimi_k2 megatron-bridge TP2+SP x PP16 x EP32 (DP16), 512": (
        "kimi_k2", 512, ["--strategy", "ep", "--ep", "32", "--tp", "2", "--sp", "--pp", "16"]),
    "qwen3_235b megatron-bridge TP4+SP x PP16 x EP8 x CP2 (DP2), 256": (
        "qwen3_235b", 256, ["--strategy", "ep", "--ep", "8", "--tp", "4", "--sp", "--pp", "16", "--cp", "2"]),
}
PARTS = ("coordinator_setup_s", "agreements_s", "coverage_s", "replica_check_s", "row_exchange_s", "object_gathers_s",
         "agreement_polling_s", "declared_check_s")


def start(model: str, world: int, flags: list[str]) -> tuple[subprocess.Popen, float]:
    config = os.path.join(HERE, "configs", f"{model}.json")
    command = [sys.executable, "-m", "nemo_moe_export", "plan", "--config", config, "--world", str(world), *flags,
               *COMMON]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), time.perf_counter()


def row_of(report: dict, command_s: float) -> dict:
    t, s, c = report["time"], report["summary"], report["checkpoint"]
    row = dict(checkpoint_bytes=c["bytes"], files=c["files"], bytes_per_rank_max=s["bytes"]["max"],
               bytes_per_rank_mean=s["bytes"]["mean"], staging_peak_bytes=s["staging_peak_bytes"]["max"],
               replica_bytes_checked_max=s["replica_bytes_checked"]["max"],
               exchanged_bytes_max=s["exchanged_bytes"]["max"], exchanged_bytes_mean=s["exchanged_bytes"]["mean"],
               row_exchanges_max=s["row_exchanges"]["max"], seconds=t["seconds"], write_s=t["write_s"],
               coordination_s=t["coordination_s"], coordination_share=t["coordination_share"],
               command_s=round(command_s, 1))
    row.update({k: t[k] for k in PARTS if k in t})
    row.update({k: v for k, v in t.get("pipeline", {}).items() if k != "by_pipeline_rank"})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rows", nargs="*", help="substrings of the rows to run (default: all)")
    parser.add_argument("--jobs", type=int, default=0, help="rows planned at a time (default: all at once)")
    args = parser.parse_args()
    rows = {name: spec for name, spec in ROWS.items() if not args.rows or any(r in name for r in args.rows)}
    names, results = list(rows), {}
    for first in range(0, len(names), args.jobs or len(names)):  # --jobs processes at a time
        running = {name: start(*rows[name]) for name in names[first:first + (args.jobs or len(names))]}
        for name, (process, started) in running.items():
            out, err = process.communicate()
            if process.returncode:
                raise SystemExit(f"{name}: {err.strip().splitlines()[-1] if err.strip() else process.returncode}")
            results[name] = row_of(json.loads(out), time.perf_counter() - started)
    emit(results, args.out, indent=2)


if __name__ == "__main__":
    main()
