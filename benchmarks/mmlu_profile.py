"""Where the MMLU evaluation's GPU time goes: torch.profiler tables (by CUDA and by CPU time) of
one shared-prefix and one full-prompt evaluation of ``mmlu_bench.py``'s workload on the 4.5 B GPU
model (``conf/model/deepseek_v3_9gb.yaml``), each after a warm-up run. A profiling aid beside the
benchmark, not a benchmark itself:

    python benchmarks/mmlu_profile.py > benchmarks/results/h200_mmlu_profile.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

MODES = ({}, {"shared_prefix": False, "tokens_per_batch": 16384})  # the defaults; full prompts at 16k


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import PreTrainedTokenizerFast

    import mmlu_bench
    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.evaluate.prepare import prepare_questions
    from nemo_moe_export.parallel import discover_layout

    args = argparse.Namespace(model_preset="deepseek_v3_9gb", dtype="bfloat16", init_range=0.5, experts=8,
                              hidden=256, moe_inter=256, layers=2, heads=4, head_dim=32)
    with tempfile.TemporaryDirectory() as tmp:
        mmlu_bench.write_workload(os.path.join(tmp, "data"), 12, 0)
        mmlu_bench.build_tokenizer(os.path.join(tmp, "tok"))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(tmp, "tok"))
        loaded = load_mmlu(os.path.join(tmp, "data"))
    test, dev = [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]
    model = mmlu_bench.build_model(args, len(tokenizer), torch.device("cuda"))
    prepared = prepare_questions(tokenizer, test, dev, k_shot=mmlu_bench.K_SHOT, max_length=4096,
                                 vocab_size=model.config.vocab_size)
    layout = discover_layout()
    for mode in MODES:
        evaluate_mmlu(model, tokenizer, prepared, layout=layout, progress=False, **mode)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = evaluate_mmlu(model, tokenizer, prepared, layout=layout, progress=False, **mode)
            torch.cuda.synchronize()
        print("=" * 30, mode, result.scoring)
        for key, rows in (("cuda_time_total", 22), ("cpu_time_total", 12)):
            print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
