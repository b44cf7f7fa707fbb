"""Reload an exported checkpoint in a fresh single process and re-evaluate MMLU on it.

    python -m nemo_moe_export.recipe.reload HF_DIR DATA_DIR OUT.json [--k-shot K] [--batch-size B]

This is the recipe's end-to-end proof that the export is the trained model: ``transformers``
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read the directory
with no plugin code involved in loading, and the same MMLU evaluation must give the same answers.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--k-shot", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-questions", type=int, default=None)
    parser.add_argument("--subjects", nargs="*", default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_moe_export.evaluate.callback import spread_subset
    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    torch.set_num_threads(1)  # the same kernels as a training rank: predictions compare exactly
    model, info = AutoModelForCausalLM.from_pretrained(args.checkpoint, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"checkpoint does not match the model: {info}")
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    questions = load_mmlu(args.data, splits=("dev", "test"), subjects=args.subjects)
    dev = [q for q in questions if q.split == "dev"]
    test = [q for q in questions if q.split == "test"]
    test = spread_subset(test, args.max_questions)  # the same subset the training-time callback used
    model.eval()
    result = evaluate_mmlu(model, tokenizer, test, dev, k_shot=args.k_shot, batch_size=args.batch_size,
                           progress=False)
    with open(args.out, "w") as f:
        json.dump({**result.metrics, "predictions": result.predictions}, f, indent=2)
    print(f"reloaded {args.checkpoint}: overall acc {result.metrics['overall']['acc']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
