"""MMLU throughput on an MMLU-shaped workload: the model's plain forward vs the evaluator's modes.

The workload has MMLU's shape: 57 subjects (lm-eval's names), 5-shot prompts from 5 dev
questions per subject, question lengths drawn so that the prompts have MMLU's length distribution
(mean ~587 tokens, p99 ~810, ~84% of all tokens in each subject's k-shot prefix; the JSON reports
what was drawn). A word-level tokenizer makes token counts exact. One run measures, on the same
prepared rows, one after the other:

* ``plain_forward_b{8,16,32,64}``: the model's own batched forward of the sorted, right-padded
  rows with ``logits_to_keep=1`` (no scoring, no agreements): the speed limit of full prompts;
* ``evaluator_b{8,16,32,64}``: ``evaluate_mmlu`` with fixed batches of that many rows
  (``tokens_per_batch=0, shared_prefix=False``), run back to back with the plain forward at the
  same batching (alternating which goes first), and ``vs_plain`` = the median over repeats of
  plain seconds / evaluator seconds of each such pair;
* ``evaluator_tokens_{N}`` / ``evaluator_tokens_default``: batches sized by a token budget
  (``tokens_per_batch=N``; ``default`` = derived from the device's memory);
* ``shared_prefix`` (and ``shared_prefix_tokens_{N}``): each subject's k-shot prefix once, its KV
  cache reused (the default mode), with the agreement of its predictions with full prompts and the
  largest loglikelihood difference;
* ``policy_lockstep`` / ``policy_expert_dp`` (only with ``--policies``): the evaluator's defaults
  under each sharding policy, with expert parallelism over ``--ep`` ranks (default: all of them),
  run back to back (alternating which goes first); ``policies`` reports
  ``lockstep_speedup_over_expert_dp_x`` = the median over repeats of expert_dp seconds / lockstep
  seconds (expert_dp gives each EP group's ranks the same batches, lockstep every rank its own) and
  the two policies' agreement. ``--only-policies`` runs just this comparison.

Each entry has questions/s, prompt tokens/s (the full prompts' tokens), computed tokens/s (what the
model was fed, without padding) and achieved TFLOP/s = 2 x active parameters x computed tokens / s
(active: every parameter a token passes through, the routed experts counted top_k / n_experts;
embeddings and the output head, run at scored positions only, are left out). Every configuration
runs ``--repeat`` times, each repeat starting at another configuration; medians are reported beside
every run. Prints one JSON object.

    # CPU ranks (gloo, EP over all ranks; a small DeepSeek-V3):
    python benchmarks/mmlu_bench.py --world-size 2 --repeat 3
    # lockstep vs expert_dp under EP=4 (the comparison alone):
    python benchmarks/mmlu_bench.py --world-size 4 --ep 4 --policies lockstep expert_dp --only-policies
    # one GPU, the 4.5 B DeepSeek-V3-style model of conf/model/deepseek_v3_9gb.yaml:
    python benchmarks/mmlu_bench.py --device cuda --model-preset deepseek_v3_9gb --questions-per-subject 24
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FIXED_BATCHES = (8, 16, 32, 64)
K_SHOT = 5
# Lengths in tokens, drawn per subject (prefix: description + 5 examples) and per question.
PREFIX_MEAN, PREFIX_SD, PREFIX_RANGE = 493, 75, (330, 700)
QUESTION_MEAN, QUESTION_SD, QUESTION_RANGE = 94, 45, (30, 320)
ANSWER_WORDS = 4  # words per choice


# --------------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------------


def _subjects() -> list[str]:
    from nemo_moe_export.evaluate.data import SUBJECT_CATEGORIES

    return sorted(SUBJECT_CATEGORIES)


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(max(1, n_words)))


def _draw(rng: random.Random, mean: float, sd: float, bounds: tuple[int, int]) -> int:
    return int(min(max(rng.gauss(mean, sd), bounds[0]), bounds[1]))


def _question(rng: random.Random, tokens: int) -> list[str]:
    """A CSV row whose ``doc_to_text`` is about ``tokens`` word-level tokens (13 are the template's)."""
    stem = tokens - 13 - 4 * ANSWER_WORDS
    return [_text(rng, stem) + " ?", *(_text(rng, ANSWER_WORDS) for _ in range(4)), rng.choice("ABCD")]


def write_workload(root: str, per_subject: int, seed: int) -> None:
    """hendrycks CSVs: 5 dev questions per subject sized to the subject's prefix, ``per_subject``
    test questions sized to MMLU's question lengths."""
    import csv

    rng = random.Random(seed)
    for split in ("dev", "test"):
        os.makedirs(os.path.join(root, split), exist_ok=True)
    for subject in _subjects():
        shot = (_draw(rng, PREFIX_MEAN, PREFIX_SD, PREFIX_RANGE) - 18) // K_SHOT - 2  # description; " X\n\n"
        for split, rows in (("dev", [_question(rng, shot) for _ in range(K_SHOT)]),
                            ("test", [_question(rng, _draw(rng, QUESTION_MEAN, QUESTION_SD, QUESTION_RANGE))
                                      for _ in range(per_subject)])):
            with open(os.path.join(root, split, f"{subject}_{split}.csv"), "w", newline="") as f:
                csv.writer(f).writerows(rows)


def build_tokenizer(path: str) -> None:
    """Word-level: every word and punctuation mark one token; " A".." D" single tokens; BOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}" for i in range(2000)} | set("?.:ABCD()") | {"Answer", "The", "following", "are", "multiple",
                                                               "choice", "questions", "with", "answers", "about"}
    for subject in _subjects():
        words |= set(subject.split("_"))
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def workload_stats(prepared: Any) -> dict[str, Any]:
    from nemo_moe_export.evaluate.prefixes import find_shared_prefixes

    lengths = sorted(len(r.input_ids) for r in prepared.rows)
    shared = sum(p.length * len(p.rows) for p in find_shared_prefixes(prepared))
    return {"questions": len(prepared.questions), "subjects": len({q.subject for q in prepared.questions}),
            "k_shot": prepared.k_shot, "prompt_tokens": sum(lengths),
            "mean_tokens": sum(lengths) / len(lengths), "p50_tokens": lengths[len(lengths) // 2],
            "p99_tokens": lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))], "max_tokens": lengths[-1],
            "prefix_share": shared / sum(lengths)}


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, vocab_size: int, device: Any) -> Any:
    """``--model-preset`` (a YAML of nemo_moe_export/conf/model), else the CPU model of the flags."""
    import torch

    from nemo_moe_export.tiny_models import tiny_model

    kw: dict[str, Any] = dict(n_experts=args.experts, hidden_size=args.hidden, moe_intermediate_size=args.moe_inter,
                              num_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                              qk_nope_head_dim=args.head_dim, qk_rope_head_dim=args.head_dim // 2,
                              v_head_dim=args.head_dim, seed=0)
    family, dtype = "deepseek_v3", args.dtype
    if args.model_preset:
        import yaml

        import nemo_moe_export

        path = os.path.join(os.path.dirname(nemo_moe_export.__file__), "conf", "model", f"{args.model_preset}.yaml")
        with open(path) as f:
            preset = {k: v for k, v in yaml.safe_load(f).items() if k != "defaults"}
        family, dtype = preset.pop("family"), preset.pop("dtype", dtype)
        kw = {"n_experts": preset.pop("n_experts", 6), "hidden_size": preset.pop("hidden_size", 64),
              "moe_intermediate_size": preset.pop("moe_intermediate_size", 32),
              "num_layers": preset.pop("num_layers", 2), "seed": preset.pop("seed", 0)}
    with torch.device(device):
        model = tiny_model(family, vocab_size=vocab_size, dtype=getattr(torch, dtype),
                           initializer_range=args.init_range, **kw)
    return model.eval()


def active_parameters(model: Any) -> int:
    """Parameters one token passes through: routed experts counted ``top_k / n_experts``;
    embeddings and the output head left out."""
    from nemo_moe_export.expert_parallel import experts_modules

    config = model.config
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "num_experts_per_token", 1)
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    experts = {id(p): m for m in experts_modules(model).values() for p in m.parameters(recurse=False)}
    total = 0.0
    for p in model.parameters():
        if id(p) in skip:
            continue
        n = p.numel() if not hasattr(p, "full_tensor") else p.shape.numel()
        total += n * (top_k / experts[id(p)].num_experts if id(p) in experts else 1)
    return int(total)


# --------------------------------------------------------------------------------------------------
# What is timed
# --------------------------------------------------------------------------------------------------


def plain_forward(model: Any, prepared: Any, batch_size: int, layout: Any, pad_id: int) -> dict[str, float]:
    """The model's own forward of the same rows, length-sorted, right-padded, ``logits_to_keep=1``;
    batch ``b`` on rank ``b % world``, the last step filled with 1-token forwards (as EP needs)."""
    import torch

    from nemo_moe_export.evaluate.batching import plan_batches

    device = next(model.parameters()).device
    batches = plan_batches(prepared.rows, batch_size)
    world, rank = layout.dp.size, layout.dp.rank
    steps = -(-len(batches) // world)
    computed = 0
    with torch.no_grad():
        for s in range(steps):
            b = s * world + rank
            rows = [prepared.rows[i].input_ids for i in batches[b].rows] if b < len(batches) else [[pad_id]]
            width = max(len(r) for r in rows)
            ids = torch.tensor([list(r) + [pad_id] * (width - len(r)) for r in rows], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
            computed += sum(len(r) for r in rows) if b < len(batches) else 0
    return {"computed_tokens": computed * world}  # every rank computes about the same share


def _sync(model: Any) -> None:
    import torch
    import torch.distributed as dist

    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _timed(fn: Any, model: Any) -> tuple[Any, float]:
    _sync(model)
    started = time.perf_counter()
    out = fn()
    _sync(model)
    return out, time.perf_counter() - started


def _configurations(args: argparse.Namespace) -> list[list[tuple[str, dict[str, Any] | int]]]:
    """Groups of (name, evaluate_mmlu overrides) or (name, batch size) for a plain forward. A
    plain forward and the evaluator at the same batch size form one group: they run back to back,
    in alternating order, so their ratio is taken over the same moment's machine (a shared box's
    load drifts between configurations minutes apart). ``--policies``: one more group, the
    evaluator's defaults under each policy."""
    policies: list[list[tuple[str, dict[str, Any] | int]]] = (
        [[(f"policy_{p}", {"policy": p}) for p in args.policies]] if args.policies else [])
    if args.only_policies:
        return policies
    groups: list[list[tuple[str, dict[str, Any] | int]]] = [
        [(f"plain_forward_b{b}", b), (f"evaluator_b{b}", {"tokens_per_batch": 0, "batch_size": b,
                                                         "shared_prefix": False})]
        for b in FIXED_BATCHES]
    groups += [[(f"evaluator_tokens_{t}", {"tokens_per_batch": t, "shared_prefix": False})] for t in args.budgets]
    groups.append([("evaluator_tokens_default", {"shared_prefix": False})])
    groups.append([("shared_prefix", {})])
    groups += [[(f"shared_prefix_tokens_{t}", {"tokens_per_batch": t})] for t in args.budgets]
    return groups + policies


def _run_order(groups: list[list[Any]], repeat: int, repeats: int) -> list[Any]:
    """Repeat ``repeat``'s order: the groups rotated (no configuration always runs first), each
    pair reversed on odd repeats (neither member always runs second)."""
    start = repeat * len(groups) // repeats
    return [config for group in groups[start:] + groups[:start]
            for config in (group[::-1] if repeat % 2 else group)]


def _worker(rank: int, world: int, args: argparse.Namespace, data_dir: str, tok_dir: str) -> dict[str, Any]:
    import torch
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu, phase_coordinator
    from nemo_moe_export.evaluate.batching import default_tokens_per_batch
    from nemo_moe_export.evaluate.prepare import prepare_questions
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import discover_layout, init_expert_parallel

    device = torch.device(args.device)
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    loaded = load_mmlu(data_dir)
    test, dev = [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]
    layout = init_expert_parallel(args.ep or world, timeout_s=600) if world > 1 else discover_layout()
    model = build_model(args, len(tok), device)
    active = active_parameters(model)
    model = apply_expert_parallel(model, layout)
    prepared = prepare_questions(tok, test, dev, k_shot=K_SHOT, max_length=4096, vocab_size=model.config.vocab_size)
    coordinator = phase_coordinator(layout, timeout_s=600)
    evaluate = lambda qs, **kw: evaluate_mmlu(model, tok, qs, layout=layout, coordinator=coordinator,  # noqa: E731
                                              progress=False, **kw)
    warm = prepare_questions(tok, test[: 8 * world], dev, k_shot=K_SHOT, max_length=4096)
    for overrides in ({"shared_prefix": False}, {}):
        evaluate(warm, **overrides)
    runs: dict[str, list[dict[str, Any]]] = {}
    predictions: dict[str, Any] = {}
    groups = _configurations(args)
    for repeat in range(args.repeat):
        for name, config in _run_order(groups, repeat, args.repeat):
            if rank == 0:
                print(f"[mmlu_bench] run {repeat + 1}/{args.repeat}: {name}", file=sys.stderr, flush=True)
            if isinstance(config, int):
                out, seconds = _timed(lambda: plain_forward(model, prepared, config, layout, tok.pad_token_id), model)
                runs.setdefault(name, []).append({"seconds": seconds, **out})
                continue
            result, seconds = _timed(lambda: evaluate(prepared, **config), model)
            predictions[name] = [r["scores"] for r in result.records]
            runs.setdefault(name, []).append({"seconds": seconds, "computed_tokens": result.padding["real_tokens"],
                                              "fed_tokens": result.padding["fed_tokens"],
                                              "steps": result.steps, "batches": result.scoring["batches"],
                                              "tokens_per_batch": result.scoring["tokens_per_batch"],
                                              "prefix_batches": result.scoring["prefix_batches"]})
    return {"runs": runs, "scores": predictions, "active_parameters": active,
            "default_tokens_per_batch": {"full_prompts": default_tokens_per_batch(model, shared_prefix=False),
                                         "shared_prefix": default_tokens_per_batch(model, shared_prefix=True)}, "workload": workload_stats(prepared)}


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]], workload: dict[str, Any], active: int) -> dict[str, Any]:
    seconds = statistics.median(r["seconds"] for r in runs)
    computed = statistics.median(r["computed_tokens"] for r in runs)
    out = {"questions_per_s": workload["questions"] / seconds, "prompt_tokens_per_s": workload["prompt_tokens"] / seconds,
           "computed_tokens_per_s": computed / seconds, "tflops_achieved": 2 * active * computed / seconds / 1e12,
           "seconds_median": seconds, "seconds_all": [round(r["seconds"], 4) for r in runs]}
    out.update({k: v for k, v in runs[0].items() if k not in ("seconds", "computed_tokens")})
    return out


def _agreement(scores: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    return {"vs": b, **agreement(scores[a], scores[b])}


def agreement(got: list[list[float]], reference: list[list[float]]) -> dict[str, Any]:
    """How often two evaluations' choice scores (one list per question) pick the same answer, and
    for each question they disagree on, the reference's *margin*: its best score minus its second
    best (a near-tie is a margin within the two runs' score differences), beside the median margin."""
    def pick(s: list[float]) -> int:
        return max(range(len(s)), key=lambda i: (s[i], -i))

    def margin(s: list[float]) -> float:
        top = sorted(s, reverse=True)
        return top[0] - top[1]

    differ = [i for i, (s, t) in enumerate(zip(got, reference)) if pick(s) != pick(t)]
    return {"same_predictions": len(got) - len(differ), "questions": len(got),
            "agreement": (len(got) - len(differ)) / len(got),
            "max_loglikelihood_diff": max(abs(x - y) for s, t in zip(got, reference) for x, y in zip(s, t)),
            "median_margin": statistics.median(margin(t) for t in reference),
            "disagreements": [{"question": i, "reference_margin": round(margin(reference[i]), 5),
                               "max_score_diff": round(max(abs(x - y) for x, y in zip(got[i], reference[i])), 5)}
                              for i in differ[:50]]}


def _policies(result: dict[str, Any], args: argparse.Namespace, entries: dict[str, Any]) -> dict[str, Any]:
    """``--policies``: each policy's entry and, with both, lockstep's speedup over expert_dp (the
    median of per-repeat ratios: the two ran back to back) and their predictions' agreement."""
    world = 1 if args.device == "cuda" else args.world_size
    ep = (args.ep or world) if world > 1 else 1
    out: dict[str, Any] = {"ep_size": ep, "expert_dp_size": world // ep, "world_size": world,
                           **{p: entries[f"policy_{p}"] for p in args.policies}}
    if {"lockstep", "expert_dp"} <= set(args.policies):
        pairs = zip(result["runs"]["policy_expert_dp"], result["runs"]["policy_lockstep"])
        ratios = [edp["seconds"] / lock["seconds"] for edp, lock in pairs]
        out["lockstep_speedup_over_expert_dp_x"] = statistics.median(ratios)
        out["lockstep_speedup_over_expert_dp_per_repeat_x"] = [round(r, 4) for r in ratios]
        out["agreement"] = _agreement(result["scores"], "policy_expert_dp", "policy_lockstep")
    return out


def report(result: dict[str, Any], args: argparse.Namespace, load: tuple[float, float, float]) -> dict[str, Any]:
    import torch
    import transformers

    work, active = result["workload"], result["active_parameters"]
    entries = {name: _summary(runs, work, active) for name, runs in result["runs"].items()}
    if args.only_policies:
        return {"config": vars(args), "cpu_cores": os.cpu_count(), "loadavg_before": load,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "workload": work, "active_parameters": active, "runs": entries,
                "policies": _policies(result, args, entries)}
    for b in FIXED_BATCHES:  # per repeat, the pair ran back to back: the median of its ratios
        pairs = zip(result["runs"][f"plain_forward_b{b}"], result["runs"][f"evaluator_b{b}"])
        ratios = [plain["seconds"] / evaluator["seconds"] for plain, evaluator in pairs]
        entries[f"evaluator_b{b}"]["vs_plain"] = statistics.median(ratios)
        entries[f"evaluator_b{b}"]["vs_plain_per_repeat"] = [round(r, 4) for r in ratios]
    best_plain = max(entries[f"plain_forward_b{b}"]["questions_per_s"] for b in FIXED_BATCHES)
    best_fixed = max(entries[f"evaluator_b{b}"]["questions_per_s"] for b in FIXED_BATCHES)
    token_runs = [n for n in entries if n.startswith("evaluator_tokens_")]
    return {
        "config": vars(args), "cpu_cores": os.cpu_count(), "loadavg_before": load,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "workload": work, "active_parameters": active, "default_tokens_per_batch": result["default_tokens_per_batch"],
        "runs": entries,
        "targets": {
            "evaluator_vs_plain_min": min(entries[f"evaluator_b{b}"]["vs_plain"] for b in FIXED_BATCHES),
            "tokens_default_vs_best_fixed": entries["evaluator_tokens_default"]["questions_per_s"] / best_fixed,
            "tokens_best_vs_best_fixed": max(entries[n]["questions_per_s"] for n in token_runs) / best_fixed,
            "shared_prefix_vs_best_plain": entries["shared_prefix"]["questions_per_s"] / best_plain,
        },
        "shared_prefix_agreement": _agreement(result["scores"], "shared_prefix", "evaluator_tokens_default"),
        **({"policies": _policies(result, args, entries)} if args.policies else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks (gloo, EP over all of them)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel size on CPU ranks (default: the world size); it must divide "
                             "the world size and the expert count")
    parser.add_argument("--policies", nargs="+", choices=("lockstep", "expert_dp"), default=[],
                        help="also measure the evaluator's defaults under these policies, back to back")
    parser.add_argument("--only-policies", action="store_true", help="measure only the --policies comparison")
    parser.add_argument("--questions-per-subject", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="*", default=[],
                        help="token budgets measured besides the default one")
    parser.add_argument("--model-preset", default=None, help="a model preset of nemo_moe_export/conf/model")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--init-range", type=float, default=0.5, help="larger than 0.02: answers depend on the input")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.only_policies and not args.policies:
        parser.error("--only-policies needs --policies")
    if args.ep is not None and (args.ep < 1 or args.world_size % args.ep
                                or (args.model_preset is None and args.experts % args.ep)):
        parser.error(f"--ep {args.ep} must divide --world-size {args.world_size} and --experts {args.experts}")

    from nemo_moe_export.spawn import spawn

    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mmlu-bench-") as tmp:
        data_dir, tok_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tok")
        write_workload(data_dir, args.questions_per_subject, args.seed)
        build_tokenizer(tok_dir)
        if args.device == "cuda":
            result = _worker(0, 1, args, data_dir, tok_dir)
        else:
            result = spawn(_worker, args.world_size, args, data_dir, tok_dir, timeout_s=7200, pg_timeout_s=600,
                           threads_per_rank=args.threads_per_rank)[0]
    out = report(result, args, load)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
