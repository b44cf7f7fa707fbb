"""Multiple-choice evaluation as lm-evaluation-harness defines it (MMLU by default): data loading,
prompts, tokenization, scoring.

The task is data (:mod:`.task`: a YAML file in lm-eval's words, ``tasks/mmlu.yaml`` and
``tasks/arc_challenge.yaml`` packaged; :mod:`.data`, :mod:`.prompts`, :mod:`.scoring`:
single-process and deterministic, so they can be checked against lm-eval's definition in
isolation); the engine runs
it over any parallel layout, one module per step: :mod:`.prepare` (tokenize and validate),
:mod:`.prefixes` (the k-shot prefix a subject's rows share), :mod:`.batching` (batches and
who runs what), :mod:`.runner` (one forward),
:mod:`.results` (per-question records), driven by :mod:`.evaluator`. :mod:`.options` holds every
default; :mod:`.callback` wraps the driver for training loops.
"""

from nemo_moe_export.evaluate.batching import Batch, StepPlan, default_tokens_per_batch, plan_batches, plan_steps
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
from nemo_moe_export.evaluate.evaluator import MMLUStepError, evaluate_mmlu, phase_coordinator
from nemo_moe_export.evaluate.options import POLICIES, SCORING_MODES, MMLUOptions
from nemo_moe_export.evaluate.prefixes import SharedPrefix, find_shared_prefixes
from nemo_moe_export.evaluate.prepare import PreparedQuestions, Row, default_max_length, prepare_questions
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
from nemo_moe_export.evaluate.results import MMLUResult
from nemo_moe_export.evaluate.scoring import (
    aggregate,
    batch_continuation_logprobs,
    continuation_logprob,
    predict,
    question_record,
    results_to_markdown,
)
from nemo_moe_export.evaluate.task import PACKAGED_TASKS, Task, load_questions, load_task

__all__ = [
    "ANSWER_CONTINUATIONS",
    "Batch",
    "MMLUCallback",
    "MMLUOptions",
    "MMLUResult",
    "MMLUStepError",
    "PACKAGED_TASKS",
    "POLICIES",
    "PreparedQuestions",
    "Row",
    "SCORING_MODES",
    "SharedPrefix",
    "StepPlan",
    "Task",
    "default_max_length",
    "default_tokens_per_batch",
    "evaluate_mmlu",
    "find_shared_prefixes",
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
    "batch_continuation_logprobs",
    "build_prompt",
    "category_of",
    "continuation_logprob",
    "encode_pair",
    "encode_request",
    "group_by_subject",
    "load_mmlu",
    "load_questions",
    "load_task",
    "multi_token_answers",
    "predict",
    "question_record",
    "require_dev_examples",
    "results_to_markdown",
    "select_fewshot",
    "single_token_answer_ids",
    "truncate_left",
]
