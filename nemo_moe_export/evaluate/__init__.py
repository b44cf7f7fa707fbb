"""MMLU evaluation as lm-evaluation-harness defines it: data loading, prompts, tokenization, scoring.

The pieces (data, prompts, scoring) are single-process and deterministic so they can be checked
against lm-eval's definition in isolation; the distributed driver (:mod:`.evaluator`) only plans,
shards and runs forwards, and :mod:`.callback` wraps it for training loops.
"""

from nemo_moe_export.evaluate.callback import MMLUCallback, spread_subset
from nemo_moe_export.evaluate.data import (
    CATEGORIES,
    SUBJECT_CATEGORIES,
    Question,
    category_of,
    group_by_subject,
    load_mmlu,
    require_dev_examples,
)
from nemo_moe_export.evaluate.evaluator import (
    POLICIES,
    SCORING_MODES,
    MMLUResult,
    MMLUStepError,
    PreparedQuestions,
    evaluate_mmlu,
    phase_coordinator,
    plan_batches,
    plan_steps,
    prepare_questions,
)
from nemo_moe_export.evaluate.prompts import (
    ANSWER_CONTINUATIONS,
    EncodedRequest,
    build_prompt,
    encode_pair,
    encode_request,
    multi_token_answers,
    select_fewshot,
    single_token_answer_ids,
    truncate_left,
)
from nemo_moe_export.evaluate.scoring import (
    aggregate,
    continuation_logprob,
    predict,
    question_record,
    results_to_markdown,
)

__all__ = [
    "ANSWER_CONTINUATIONS",
    "MMLUCallback",
    "MMLUResult",
    "MMLUStepError",
    "POLICIES",
    "PreparedQuestions",
    "SCORING_MODES",
    "evaluate_mmlu",
    "phase_coordinator",
    "plan_batches",
    "plan_steps",
    "prepare_questions",
    "spread_subset",
    "CATEGORIES",
    "SUBJECT_CATEGORIES",
    "EncodedRequest",
    "Question",
    "aggregate",
    "build_prompt",
    "category_of",
    "continuation_logprob",
    "encode_pair",
    "encode_request",
    "group_by_subject",
    "load_mmlu",
    "multi_token_answers",
    "predict",
    "question_record",
    "require_dev_examples",
    "results_to_markdown",
    "select_fewshot",
    "single_token_answer_ids",
    "truncate_left",
]
