r"""MMLU prompts and their tokenization, byte-for-byte as lm-evaluation-harness builds them.

The prompt text is rendered from the packaged task file ``tasks/mmlu.yaml`` by
:class:`~nemo_moe_export.evaluate.task.Task` (docs/design.md#evaluation-tasks), which holds the
lm-eval fields below verbatim; :func:`build_prompt` takes any other task too. The tokenization
functions serve every task.

Checked against lm_eval 0.4.13 (wheel ``lm_eval-0.4.13-py3-none-any.whl`` from PyPI, read, not
installed):

* ``lm_eval/tasks/mmlu/default/_default_template_yaml``: ``fewshot_split: dev``,
  ``fewshot_config: {sampler: first_n}``, ``output_type: multiple_choice``,
  ``doc_to_text: "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:"``,
  ``doc_to_choice: ["A", "B", "C", "D"]``, ``doc_to_target: answer``. Only the question is
  stripped; choices are inserted verbatim.
* ``lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml`` / ``_generate_configs.py``: ``description``
  is ``f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"``.
* ``lm_eval/tasks/mmlu/default/_mmlu.yaml`` (and ``_mmlu_stem.yaml`` ...): groups aggregate
  ``acc`` with ``weight_by_size: True``.
* ``lm_eval/config/task.py`` ``TaskConfig``: ``target_delimiter = " "``, ``fewshot_delimiter =
  "\n\n"``; ``FewshotConfig.from_dict`` inherits both for the few-shot examples.
* ``lm_eval/api/task.py`` ``ConfigurableTask.fewshot_context`` / ``build_qa_turn`` and
  ``lm_eval/api/utils.py`` ``Message.to_text``/``maybe_delimit``: without a chat template the prompt
  is ``description + sum(doc_to_text(ex) + " " + letter + "\n\n" for ex in shots) +
  doc_to_text(doc)`` (the test question gets no trailing delimiter).
* ``lm_eval/api/samplers.py`` ``FirstNSampler``: the first k docs of the dev split; the evaluated
  doc is removed from the pool only when the few-shot split *is* the evaluated split; k larger than
  the pool is an error.
* ``ConfigurableTask.construct_requests``: one request per choice, ``(context, " " + letter)``.
* ``lm_eval/api/model.py`` ``TemplateLM._encode_pair`` (causal): trailing whitespace of the
  context moves to the front of the continuation; ``whole = tok_encode(context + continuation)``,
  ``context_enc = tok_encode(context)``, ``continuation_enc = whole[len(context_enc):]``.
* ``lm_eval/models/huggingface.py`` ``HFLM.tok_encode``: ``tokenizer.encode(string)`` with the
  tokenizer's default special tokens (``add_bos_token=None``), except ``add_special_tokens=False``
  when the string already starts with ``decode(prefix_token_id)`` (BOS, else EOS).
* ``HFLM._loglikelihood_tokens`` (causal): ``inp = (context_enc + continuation_enc)[-(max_length +
  1):][:-1]``; logged as truncation when ``len(context_enc) + len(continuation_enc) > max_length +
  1``; asserts ``0 < len(continuation_enc) <= max_length``; scores are ``log_softmax`` over the
  whole vocabulary (in ``softmax_dtype``, default the logits' dtype) gathered at the continuation
  tokens from the last ``len(continuation_enc)`` positions of ``inp`` and summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import LETTERS, Question
from nemo_moe_export.evaluate.task import Task, load_task

__all__ = [
    "ANSWER_CONTINUATIONS",
    "EncodedRequest",
    "build_prompt",
    "describe_subject",
    "encode_pair",
    "encode_request",
    "format_example",
    "multi_token_answers",
    "select_fewshot",
    "single_token_answer_ids",
    "tok_encode",
    "truncate_left",
]

TARGET_DELIMITER = " "  # lm_eval/config/task.py TaskConfig.target_delimiter (tasks/mmlu.yaml states it too)
ANSWER_CONTINUATIONS: tuple[str, ...] = tuple(TARGET_DELIMITER + x for x in LETTERS)


# --- prompt text ----------------------------------------------------------------------------------


def describe_subject(subject: str) -> str:
    """The task description lm-eval prepends (``_generate_configs.py``), rendered from ``tasks/mmlu.yaml``."""
    return _mmlu().describe({"subject": subject})


def format_example(q: Question, *, with_answer: bool) -> str:
    """``doc_to_text`` of ``q``; few-shot examples add ``" " + letter`` (the target delimiter)."""
    task = _mmlu()
    text = task.text(q)
    return text + task.target_delimiter + task.choices(q)[q.answer] if with_answer else text


def select_fewshot(pool: Sequence[Question], k: int, doc: Question | None = None) -> list[Question]:
    """The first ``k`` questions of ``doc``'s subject in ``pool`` (lm-eval's ``first_n`` sampler).

    When the evaluated split is itself the few-shot split (evaluating ``dev``), ``doc`` is removed
    from the pool first, as lm-eval does, so a question never answers itself. (Any task's
    ``first_n`` sampler: the subject is the task's group.)
    """
    if k < 0:
        raise InputError("few-shot count must be >= 0", key="k", expected=">= 0", actual=k)
    subject = doc.subject if doc is not None else None
    candidates = [p for p in pool if subject is None or p.subject == subject]
    if doc is not None and candidates and doc.split == candidates[0].split:
        candidates = [p for p in candidates if not _same_doc(p, doc)]
    if k > len(candidates):
        raise InputError(
            f"not enough few-shot examples for subject {subject!r}", key="k",
            expected=f"<= {len(candidates)} (dev questions available)", actual=k,
            hint="lower k or load the subject's dev split",
        )
    return candidates[:k]


def _same_doc(a: Question, b: Question) -> bool:
    """lm-eval compares doc dicts, i.e. content, not position."""
    return (a.subject, a.question, a.choices, a.answer) == (b.subject, b.question, b.choices, b.answer)


def build_prompt(doc: Question, fewshot: Sequence[Question], task: Task | str = "mmlu") -> str:
    """Description, the few-shot examples each followed by a blank line, then the open question:
    ``task``'s :meth:`~nemo_moe_export.evaluate.task.Task.context` (MMLU's, from ``tasks/mmlu.yaml``)."""
    return load_task(task).context(doc, fewshot)


def _mmlu() -> Task:
    return load_task("mmlu")


# --- tokenization ---------------------------------------------------------------------------------


def tok_encode(tokenizer: Any, text: str) -> list[int]:
    """``HFLM.tok_encode`` with ``add_bos_token=None``: the tokenizer's own special tokens.

    A Llama-style tokenizer therefore adds BOS, a GPT-2-style one adds nothing. Special tokens are
    skipped when the text already starts with the decoded prefix token (BOS, else EOS), so a BOS is
    never doubled.
    """
    prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix_id is not None and text.startswith(tokenizer.decode(prefix_id)):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``TemplateLM._encode_pair`` for causal models.

    The continuation's tokens are those of the whole string after the context's tokens, so a merge
    across the boundary (e.g. ``":" + " A"``) is scored the way the model would have produced it.
    """
    if not context:
        raise InputError("context must be non-empty", key="context", expected="text", actual="''")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok_encode(tokenizer, context + continuation)
    context_enc = tok_encode(tokenizer, context)
    return context_enc, whole[len(context_enc):]


@dataclass(frozen=True)
class EncodedRequest:
    """The four loglikelihood requests of one question, tokenized."""

    context: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]  # one per choice, " A" .. " D"


def encode_request(
    tokenizer: Any, prompt: str, continuations: Sequence[str] = ANSWER_CONTINUATIONS
) -> EncodedRequest:
    """Tokenize ``prompt`` against each answer continuation as lm-eval's HF backend does.

    Raises when a continuation comes out empty or the context differs between choices: both would
    make the scores incomparable (lm-eval asserts the former).
    """
    pairs = [encode_pair(tokenizer, prompt, c) for c in continuations]
    context = pairs[0][0]
    for (ctx, cont), text in zip(pairs, continuations, strict=True):
        if ctx != context:
            raise InputError("context tokens differ between choices", key=repr(text))
        if not cont:
            raise InputError(
                "continuation encodes to no tokens", key=repr(text), expected=">= 1 token",
                actual=0, hint="the tokenizer merged the answer into the context",
            )
    return EncodedRequest(tuple(context), tuple(tuple(cont) for _, cont in pairs))


def truncate_left(
    context: Sequence[int], continuation: Sequence[int], max_length: int
) -> tuple[list[int], bool]:
    """Model input for one request and whether it was cut, as ``HFLM._loglikelihood_tokens``.

    The input is ``(context + continuation)[-(max_length + 1):][:-1]``: the last token is never fed
    (nothing scores it), so a request of ``max_length + 1`` tokens still fits whole. Logits at the
    last ``len(continuation)`` input positions score the continuation.
    """
    if max_length < 1:
        raise InputError("max_length must be >= 1", key="max_length", expected=">= 1",
                         actual=max_length)
    if not context or not continuation or len(continuation) > max_length:
        raise InputError(
            "cannot score request", key="continuation",
            expected=f"non-empty context and 1..{max_length} continuation tokens",
            actual=f"{len(context)} context, {len(continuation)} continuation tokens",
        )
    whole = list(context) + list(continuation)
    return whole[-(max_length + 1):][:-1], len(whole) > max_length + 1


def single_token_answer_ids(request: EncodedRequest) -> tuple[int, ...] | None:
    """Token id of each answer when every answer is exactly one distinct token, else None.

    Only then is the cheap path (compare the answers' logits at the last prompt position) equal to the
    summed continuation log-likelihood; otherwise the caller must score full continuations.
    """
    if any(len(c) != 1 for c in request.continuations):
        return None
    ids = tuple(c[0] for c in request.continuations)
    return ids if len(set(ids)) == len(ids) else None


def multi_token_answers(
    request: EncodedRequest, continuations: Sequence[str] = ANSWER_CONTINUATIONS
) -> dict[str, tuple[int, ...]]:
    """Answers that are not a single token, with their tokens, for a log line explaining why the
    full continuation log-likelihood path was taken."""
    return {
        text: cont
        for text, cont in zip(continuations, request.continuations, strict=True)
        if len(cont) != 1
    }
