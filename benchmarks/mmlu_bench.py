"""MMLU evaluation throughput: single process vs ``expert_dp`` vs ``lockstep`` on N CPU ranks with EP.

What it shows: with expert parallelism over all ranks (EP = world, so there is no expert-DP
replica), ``expert_dp`` makes every rank run every batch (each EP peer recomputes the same dense
layers and sends duplicate tokens to the experts), while ``lockstep`` gives each rank its own
batches and only pads the last step with a dummy forward. Expected: lockstep about EP times the
expert_dp throughput, minus all-to-all and agreement overhead; padding waste stays low because
batches are length-sorted.

Everything is synthetic and offline: MMLU-format CSVs with mixed question lengths, a byte-level BPE
tokenizer trained on them, a random DeepSeek-V3 from ``tiny_models`` large enough that compute
dominates (hidden 256, 8 experts). Prints one JSON object. Run by hand:

    python benchmarks/mmlu_bench.py --world-size 4 --ep 4 --questions 256
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SUBJECTS = ("abstract_algebra", "anatomy", "philosophy", "prehistory", "sociology", "econometrics",
            "virology", "nutrition")
WORDS = ("matrix group ring field prime vector tensor proof lemma virus cell tissue organ law court "
         "treaty market price demand supply mind ethics virtue reason history empire war trade diet "
         "protein energy model error sample").split()


def write_data(root: str, n_questions: int, dev_per_subject: int, seed: int) -> None:
    """hendrycks CSV layout; question lengths 5-150 words so batches must be length-sorted."""
    rng = random.Random(seed)
    per_subject = [n_questions // len(SUBJECTS) + (i < n_questions % len(SUBJECTS)) for i in range(len(SUBJECTS))]
    for split, counts in (("dev", [dev_per_subject] * len(SUBJECTS)), ("test", per_subject)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for subject, n in zip(SUBJECTS, counts):
            with open(os.path.join(root, split, f"{subject}_{split}.csv"), "w", newline="") as f:
                writer = csv.writer(f)
                for _ in range(n):
                    length = int(rng.choice([rng.uniform(5, 30), rng.uniform(30, 150)]))
                    question = " ".join(rng.choice(WORDS) for _ in range(length)) + "?"
                    choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(4)]
                    writer.writerow([question, *choices, rng.choice("ABCD")])


def build_tokenizer(path: str, vocab_size: int) -> None:
    """Byte-level BPE trained on the benchmark's words; " A".." D" become single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 20 + [" A B C D", "Answer:",
                                      "The following are multiple choice questions (with answers) about"] * 50
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus + [s.replace("_", " ") for s in SUBJECTS] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(path)


def _model(args):
    from nemo_moe_export.tiny_models import tiny_model

    return tiny_model("deepseek_v3", n_experts=args.experts, hidden_size=args.hidden,
                      moe_intermediate_size=args.moe_inter, num_layers=args.layers,
                      vocab_size=args.model_vocab, seed=0, initializer_range=0.5)


def _worker(rank: int, world: int, args, data_dir: str, tok_dir: str, policies: list[str]) -> dict:
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu, phase_coordinator
    from nemo_moe_export.evaluate.prepare import prepare_questions
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import discover_layout, init_expert_parallel

    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    loaded = load_mmlu(data_dir)
    test, dev = [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]
    layout = init_expert_parallel(args.ep, timeout_s=300) if world > 1 else discover_layout()
    model = apply_expert_parallel(_model(args), layout)
    prepared = prepare_questions(tok, test, dev, k_shot=args.k_shot, max_length=args.max_length,
                                 vocab_size=model.config.vocab_size)
    coordinator = phase_coordinator(layout, timeout_s=300)
    warm = prepare_questions(tok, test[: 2 * world * args.batch_size], dev, k_shot=args.k_shot,
                             max_length=args.max_length)
    evaluate_mmlu(model, tok, warm, layout=layout, batch_size=args.batch_size, coordinator=coordinator,
                  progress=False)
    out = {}
    for policy in policies:
        started = time.perf_counter()
        result = evaluate_mmlu(model, tok, prepared, layout=layout, batch_size=args.batch_size, policy=policy,
                               coordinator=coordinator, progress=False)
        out[policy] = {"seconds": time.perf_counter() - started, "questions": len(result.records),
                       "steps": result.steps, "padding_waste": result.padding["waste"],
                       "padded_tokens": result.padding["padded_tokens"], "fed_tokens": result.padding["fed_tokens"],
                       "accuracy": result.metrics["overall"]["acc"], "predictions": result.predictions}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--k-shot", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokenizer-vocab", type=int, default=512)
    parser.add_argument("--model-vocab", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    args = parser.parse_args()

    from nemo_moe_export.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="mmlu-bench-") as tmp:
        data_dir, tok_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tok")
        write_data(data_dir, args.questions, dev_per_subject=max(args.k_shot, 1), seed=0)
        build_tokenizer(tok_dir, args.tokenizer_vocab)
        single = spawn(_worker, 1, args, data_dir, tok_dir, ["lockstep"], timeout_s=1800,
                       threads_per_rank=args.threads_per_rank)[0]["lockstep"]
        multi = spawn(_worker, args.world_size, args, data_dir, tok_dir, ["expert_dp", "lockstep"],
                      timeout_s=1800, threads_per_rank=args.threads_per_rank)
    runs = {"single_process": single, "expert_dp": multi[0]["expert_dp"], "lockstep": multi[0]["lockstep"]}
    same_on_all_ranks = all(m[p]["predictions"] == multi[0][p]["predictions"] for m in multi for p in m)
    reference = single["predictions"]
    report = {
        "config": {k: v for k, v in vars(args).items()},
        "cpu_cores": os.cpu_count(),
        "questions": single["questions"],
        **{name: {"questions_per_s": r["questions"] / r["seconds"], "seconds": r["seconds"], "steps": r["steps"],
                  "padding_waste": r["padding_waste"], "accuracy": r["accuracy"]} for name, r in runs.items()},
        "lockstep_vs_expert_dp": runs["expert_dp"]["seconds"] / runs["lockstep"]["seconds"],
        "predictions_identical": all(r["predictions"] == reference for r in runs.values()) and same_on_all_ranks,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
