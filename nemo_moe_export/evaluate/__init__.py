"""MMLU evaluation as lm-evaluation-harness defines it: data loading, prompts, tokenization, scoring.

The pieces here are single-process and deterministic so they can be checked against lm-eval's
definition in isolation; the distributed driver only shards questions and runs forwards.
"""

from nemo_moe_export.evaluate.data import (
    CATEGORIES,
    SUBJECT_CATEGORIES,
    Question,
    category_of,
    group_by_subject,
    load_mmlu,
    require_dev_examples,
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
