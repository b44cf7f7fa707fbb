"""Reload an exported checkpoint in a fresh single process and re-evaluate MMLU on it.

    python -m nemo_moe_export.job.reload HF_DIR DATA_DIR OUT.json --options OPTIONS.json

This is the recipe's end-to-end proof that the export is the trained model: ``transformers``
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read the directory
with no plugin code involved in loading, and the same evaluation must give the same answers
(``evaluate/agreement.py``: equal wherever the trained model decides them beyond rounding).
``OPTIONS.json`` holds the training run's ``MMLUOptions`` whole (``job/stages.py`` writes it), and
the evaluation goes through the same :class:`~nemo_moe_export.evaluate.callback.MMLUCallback`, so
the questions, the few-shot examples and every other option are the trained run's by construction.
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
    parser.add_argument("--options", required=True, help="the training run's MMLUOptions, as JSON")
    args = parser.parse_args(argv)

    # Imported here, after HF_HUB_OFFLINE is set above: huggingface_hub reads it when first imported.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_moe_export.evaluate.callback import MMLUCallback

    torch.set_num_threads(1)  # the same kernels as a training rank
    model, info = AutoModelForCausalLM.from_pretrained(args.checkpoint, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"checkpoint does not match the model: {info}")
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    with open(args.options) as f:
        options = json.load(f)
    # Results go to OUT.json alone: no charts or progress bar from this check.
    callback = MMLUCallback(args.data, options, output_dir=os.path.join(os.path.dirname(args.out), "reload_mmlu"),
                            plot=False, progress=False)
    model.eval()
    callback.evaluate(model, tokenizer)
    result = callback.last_result
    with open(args.out, "w") as f:
        json.dump({**result.metrics, "predictions": result.predictions,
                   "scores": [r["scores"] for r in result.records]}, f, indent=2)
    print(f"reloaded {args.checkpoint}: overall acc {result.metrics['overall']['acc']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
