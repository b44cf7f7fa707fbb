"""MMLU under a layout: steps and rows per rank per policy, from the evaluator's own batching code.

The questions are tokenized (``evaluate/prepare.py``), the global batches planned by the
evaluator's own ``global_batches`` (shared prefixes, token budget, uniform shapes) and each
simulated rank's steps derived (``batching.plan_steps``) exactly as ``evaluate_mmlu`` does on that
rank; only the ParallelLayout is built from the rank lists instead of process groups (the
planner has none): dense DP is the world, EP groups and expert-DP groups are Megatron's
(``parallel.expert_parallel_groups``), as ``init_expert_parallel`` creates them.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from nemo_moe_export.evaluate.batching import plan_steps
from nemo_moe_export.evaluate.data import load_mmlu
from nemo_moe_export.evaluate.evaluator import global_batches
from nemo_moe_export.evaluate.options import MMLUOptions
from nemo_moe_export.evaluate.prepare import default_max_length, model_vocab_size, prepare_questions
from nemo_moe_export.parallel import ParallelLayout, RankGroup, expert_parallel_groups

__all__ = ["plan_mmlu", "rank_layout"]

PLANNED_POLICIES = ("lockstep", "expert_dp")


def rank_layout(rank: int, world: int, parallel: Any) -> ParallelLayout:
    """Rank ``rank``'s DP / EP / expert-DP groups under ``parallel`` (by rank lists)."""
    everyone = tuple(range(world))
    dp = RankGroup(rank, world, everyone)
    if parallel.strategy not in ("ep", "ep_fsdp") or parallel.ep_size == 1:
        return ParallelLayout(dp=dp, ep=RankGroup(0, 1, (rank,)), edp=dp, source="planner")
    ep_groups, edp_groups = expert_parallel_groups(world, parallel.ep_size)
    ep = next(tuple(g) for g in ep_groups if rank in g)
    edp = next(tuple(g) for g in edp_groups if rank in g)
    return ParallelLayout(dp=dp, ep=RankGroup(ep.index(rank), len(ep), ep),
                          edp=RankGroup(edp.index(rank), len(edp), edp), source="planner")


def plan_mmlu(data_path: str, tokenizer_path: str, parallel: Any, world: int, meta: Any,
              options: MMLUOptions | None = None) -> dict:
    """Steps and rows of every rank for each policy, for the questions under ``data_path``."""
    opts = options or MMLUOptions()
    questions = load_mmlu(data_path, splits=("dev", "test"))
    dev = [q for q in questions if q.split == "dev"]
    test = [q for q in questions if q.split == "test"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    prepared = prepare_questions(tokenizer, test, dev, k_shot=opts.k_shot, scoring=opts.scoring,
                                 max_length=opts.max_length or default_max_length(meta.model, tokenizer),
                                 vocab_size=model_vocab_size(meta.model))
    batches, budget, prefixes, uniform_shapes = global_batches(meta.model, prepared, opts)
    out: dict[str, Any] = dict(questions=len(test), rows=len(prepared.rows), batches=len(batches),
                               tokens_per_batch=budget, shared_prefixes=len(prefixes), policies={})
    for policy in PLANNED_POLICIES:
        per_rank = []
        for rank in range(world):
            steps = plan_steps(batches, policy, rank_layout(rank, world, parallel), uniform_shapes=uniform_shapes)
            mine = [b for b in steps.batch_of_step if b is not None]
            per_rank.append(dict(steps=steps.n_steps, forwards=len(mine), dummy_steps=steps.n_steps - len(mine),
                                 rows=sum(len(batches[b].rows) for b in mine), shard=steps.shard_rank,
                                 shards=steps.shard_size))
        rows = [r["rows"] for r in per_rank]
        out["policies"][policy] = dict(steps=max(r["steps"] for r in per_rank), shards=per_rank[0]["shards"],
                                       rows_min=min(rows), rows_max=max(rows), rows_mean=sum(rows) / world,
                                       rows_total=sum(rows), per_rank=per_rank)
    return out
