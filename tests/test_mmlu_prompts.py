r"""MMLU prompts, tokenization and scoring against lm-evaluation-harness 0.4.13's definition.

lm_eval is not installed here; expectations are written from its source (wheel
lm_eval-0.4.13-py3-none-any.whl), each citing the file it comes from. When lm_eval *is* importable,
the tokenization tests also run its own ``TemplateLM._encode_pair``.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import Question
from nemo_moe_export.evaluate.prompts import (
    ANSWER_CONTINUATIONS,
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


def q(question, choices, answer, subject="abstract_algebra", split="dev", index=0):
    return Question(subject, question, tuple(choices), answer, split, index)


DEV = [
    q("Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.", ["0", "1", "2", "3"], 1, index=0),
    q("  Statement 1 | x.\nStatement 2 | y.  ", ["True, True", "False, False", " True, False", "None"], 2,
      index=1),
    q("Third?", ["a", "b", "c", "d"], 3, index=2),
]
TEST = q("Find the degree for the given field extension Q(sqrt(2)) over Q.", ["0", "4", "2", "6"], 2,
         split="test")

# lm_eval/tasks/mmlu/default/_default_template_yaml, doc_to_text, copied verbatim.
LM_EVAL_DOC_TO_TEXT = (
    "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:"
)


# --- prompt text ---------------------------------------------------------------------------------


def test_two_shot_prompt_literal():
    # description from mmlu_abstract_algebra.yaml; each shot: doc_to_text + target_delimiter " " +
    # letter + fewshot_delimiter "\n\n" (lm_eval/api/task.py build_qa_turn); the test doc ends at
    # "Answer:". Only the question is stripped, choices are verbatim (note " True, False").
    expected = (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
        "Statement 1 | x.\nStatement 2 | y.\nA. True, True\nB. False, False\nC.  True, False\nD. None\n"
        "Answer: C\n\n"
        "Find the degree for the given field extension Q(sqrt(2)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:"
    )
    assert build_prompt(TEST, select_fewshot(DEV, 2, TEST)) == expected


def test_zero_shot_and_subject_spaces():
    doc = q(" Q ", ["a", "b", "c", "d"], 0, subject="high_school_us_history", split="test")
    assert build_prompt(doc, []) == (
        "The following are multiple choice questions (with answers) about high school us history.\n\n"
        "Q\nA. a\nB. b\nC. c\nD. d\nAnswer:"
    )


def test_prompt_matches_lm_eval_template_rendered_with_jinja():
    jinja2 = pytest.importorskip("jinja2")
    # lm_eval/utils.py: Environment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = env.from_string(LM_EVAL_DOC_TO_TEXT)

    def text(d):
        return template.render(question=d.question, choices=list(d.choices))

    desc = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    shots = "".join(text(d) + " " + "ABCD"[d.answer] + "\n\n" for d in DEV)
    assert build_prompt(TEST, select_fewshot(DEV, 3, TEST)) == desc + shots + text(TEST)


def test_fewshot_first_k_of_subject_and_limits():
    other = q("other subject", ["a", "b", "c", "d"], 0, subject="anatomy")
    pool = [other, *DEV]
    assert select_fewshot(pool, 2, TEST) == DEV[:2]
    assert select_fewshot(pool, 0, TEST) == []
    with pytest.raises(InputError, match="not enough few-shot examples for subject 'abstract_algebra'"):
        select_fewshot(pool, 4, TEST)
    # Evaluating dev itself: lm-eval's FirstNSampler drops the evaluated doc from the pool.
    assert select_fewshot(pool, 2, DEV[0]) == DEV[1:3]
    with pytest.raises(InputError):
        select_fewshot(pool, 3, DEV[0])


# --- tokenization ----------------------------------------------------------------------------------

CORPUS = [
    "The following are multiple choice questions (with answers) about abstract algebra.",
    "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B",
    "Statement 1 | x.\nStatement 2 | y.\nA. True, True\nB. False, False\nAnswer: C",
    "Answer: A\n\nAnswer: D\n\nAnswer: B\n\nAnswer: C",
] * 10


def gpt2_style() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few sentences; adds no special tokens, like GPT-2/Qwen."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def llama_style() -> PreTrainedTokenizerFast:
    """Same BPE plus a post-processor that prepends <s>, like Llama/DeepSeek tokenizers."""
    tok = Tokenizer.from_str(gpt2_style().backend_tokenizer.to_str())
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def merging_bpe() -> PreTrainedTokenizerFast:
    """Character BPE without pre-tokenizer whose merges cross the context/answer boundary.

    Merge ranks: ":"+" " first, then " "+"A", then ":"+" A". So "x: A" -> ["x", ": ", "A"] while
    " A" alone -> [" A"]: the answer token depends on the context.
    """
    chars = ["x", ":", " ", "A", "B", "C", "D", "<s>"]
    vocab = {c: i for i, c in enumerate(chars)} | {": ": 8, " A": 9, ": A": 10}
    merges = [(":", " "), (" ", "A"), (":", " A")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def fake_hflm(tokenizer, max_length=2048, model=None):
    """A real lm_eval HFLM object without a checkpoint: only the attributes _encode_pair,
    tok_encode and _loglikelihood_tokens read. None when lm_eval is not importable."""
    try:
        from lm_eval.api.model import CacheHook
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        return None
    lm = HFLM.__new__(HFLM)
    lm.backend, lm.tokenizer, lm.add_bos_token, lm.custom_prefix_token_id = "causal", tokenizer, None, None
    lm._max_length, lm.batch_size_per_gpu, lm._device, lm._rank = max_length, 1, "cpu", 0
    lm.logits_cache, lm.softmax_dtype, lm.cache_hook = False, None, CacheHook(None)
    lm._model_call = lambda inps, **kw: model(inps)
    return lm


def lm_eval_encode_pair(tokenizer, context, continuation):
    """lm_eval 0.4.13 lm_eval/api/model.py TemplateLM._encode_pair (lines 413-431, causal branch),
    with HFLM.tok_encode (lm_eval/models/huggingface.py lines 1040-1063, add_bos_token=None).
    Runs lm_eval's own code when it is importable, else the same lines copied literally."""
    lm = fake_hflm(tokenizer)
    if lm is not None:
        return lm._encode_pair(context, continuation)

    def tok_encode_(string):
        special_tokens_kwargs = {}
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if string.startswith(tokenizer.decode(prefix)):
            special_tokens_kwargs["add_special_tokens"] = False
        return tokenizer.encode(string, **special_tokens_kwargs)

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole_enc = tok_encode_(context + continuation)
    context_enc = tok_encode_(context)
    context_enc_len = len(context_enc)
    continuation_enc = whole_enc[context_enc_len:]
    return context_enc, continuation_enc


def test_answer_continuations_have_target_delimiter():
    # lm_eval/api/task.py construct_requests: (ctx, f"{target_delimiter}{cont}"), target_delimiter " "
    assert ANSWER_CONTINUATIONS == (" A", " B", " C", " D")


@pytest.mark.parametrize("make", [gpt2_style, llama_style, merging_bpe])
@pytest.mark.parametrize("context", ["Answer:", "x: A x:", "Answer: ", "x:  \n", "<s>x:"])
def test_encode_pair_mirrors_lm_eval(make, context):
    tok = make()
    for cont in ANSWER_CONTINUATIONS:
        assert encode_pair(tok, context, cont) == lm_eval_encode_pair(tok, context, cont)


def test_special_tokens_gpt2_vs_llama():
    prompt = build_prompt(TEST, DEV[:1])
    g, ll = gpt2_style(), llama_style()
    rg, rl = encode_request(g, prompt), encode_request(ll, prompt)
    assert list(rg.context) == g.encode(prompt, add_special_tokens=False)  # no BOS for GPT-2 style
    assert rl.context[0] == ll.bos_token_id and rl.context.count(ll.bos_token_id) == 1
    assert list(rl.context[1:]) == ll.encode(prompt, add_special_tokens=False)
    for r, t in ((rg, g), (rl, ll)):
        # byte-level pre-tokenization splits before " A", so each answer is its own single token
        assert [list(c) for c in r.continuations] == [t.encode(c, add_special_tokens=False) for c in ANSWER_CONTINUATIONS]
        assert single_token_answer_ids(r) == tuple(t.convert_tokens_to_ids(f"Ġ{x}") for x in "ABCD")
        assert multi_token_answers(r) == {}
    # a prompt already starting with BOS does not get a second one (HFLM.tok_encode has_bos_prefix)
    assert encode_request(ll, "<s>" + prompt).context == rl.context


def test_continuation_is_whole_minus_context_not_separate_encoding():
    tok = merging_bpe()
    ids = tok.convert_tokens_to_ids
    ctx, cont = encode_pair(tok, "x:", " A")
    assert ctx == ids(["x", ":"]) and cont == ids(["A"])  # whole "x: A" -> x, ": ", A
    assert tok.encode(" A") == ids([" A"])  # what a naive separate encoding would have scored
    # trailing space moves to the continuation: same tokens as without it
    assert encode_pair(tok, "x: ", "A") == (ctx, cont)
    r = encode_request(tok, "x:")
    # every answer is the bare letter after ": ", so the single-token path scores "A".."D"
    assert single_token_answer_ids(r) == tuple(ids(list("ABCD")))
    assert multi_token_answers(r) == {}


def test_multi_token_answers_reported():
    tok = merging_bpe()
    ids = tok.convert_tokens_to_ids
    r = encode_request(tok, "x x")
    # " A" merges into one token; " B" has no merge and stays " " + "B"
    assert r.continuations[0] == (ids(" A"),)
    assert multi_token_answers(r) == {c: (ids(" "), ids(c[1])) for c in (" B", " C", " D")}
    assert single_token_answer_ids(r) is None


def test_empty_continuation_is_refused():
    # "x:" + " A" -> whole "x: A"; with the merge ":"+" A" ranked before ":"+" " nothing is left
    vocab = {"x": 0, ":": 1, " ": 2, "A": 3, " A": 4, ": A": 5, "B": 6, "C": 7, "D": 8}
    merges = [(" ", "A"), (":", " A")]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    assert tok.encode("x:") == [0, 1] and tok.encode("x: A") == [0, 5]
    with pytest.raises(InputError, match="continuation encodes to no tokens"):
        encode_request(tok, "x:")


def test_truncate_left_matches_lm_eval_slice():
    # lm_eval/models/huggingface.py _loglikelihood_tokens:
    #   inp = (context_enc + continuation_enc)[-(max_length + 1):][:-1]
    #   warning when len(context_enc) + len(continuation_enc) > max_length + 1
    ctx, cont = list(range(10)), [100, 101]
    assert truncate_left(ctx, cont, 20) == (ctx + [100], False)
    assert truncate_left(ctx, cont, 11) == (ctx + [100], False)  # 12 tokens fit: last is never fed
    assert truncate_left(ctx, cont, 10) == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 100], True)
    assert truncate_left(ctx, cont, 3) == ([8, 9, 100], True)
    assert truncate_left(ctx, cont, 2) == ([9, 100], True)  # continuation may fill max_length
    for bad in ((ctx, [], 5), ([], cont, 5), (ctx, cont, 1), (ctx, cont, 0)):
        with pytest.raises(InputError):
            truncate_left(*bad)


class TinyCausalLM:
    """Deterministic causal "model": logits at t depend on tokens <= t (embedding of the token
    plus a decayed running sum), so truncation and context really change the scores."""

    def __init__(self, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)

    def __call__(self, inps: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        e = self.emb[inps]
        return e + 0.5 * torch.cumsum(e, dim=1) / torch.arange(1, inps.shape[1] + 1).view(1, -1, 1)


def our_scores(tok, model, prompt, max_length):
    req = encode_request(tok, prompt)
    out = []
    for cont in req.continuations:
        inp, _ = truncate_left(req.context, cont, max_length)
        out.append(continuation_logprob(model(torch.tensor([inp]))[0], cont))
    return out


@pytest.mark.parametrize("make", [gpt2_style, llama_style])
@pytest.mark.parametrize("max_length", [2048, 40, 7])
def test_end_to_end_scores_equal_lm_eval_hflm(make, max_length):
    tok = make()
    model = TinyCausalLM(len(tok))
    lm = fake_hflm(tok, max_length=max_length, model=model)
    if lm is None:
        pytest.skip("lm_eval not importable; test_truncate_left_matches_lm_eval_slice covers the slice")
    prompt = build_prompt(TEST, select_fewshot(DEV, 2, TEST))
    reqs = [((prompt, c), *lm._encode_pair(prompt, c)) for c in ANSWER_CONTINUATIONS]
    expected = [ll for ll, _ in lm._loglikelihood_tokens(reqs, disable_tqdm=True)]
    # the same float64 log-softmax and sums, in our batching vs lm-eval's: rounding of 1e-16 relative
    assert our_scores(tok, model, prompt, max_length) == pytest.approx(expected, abs=1e-9)


# --- scoring -------------------------------------------------------------------------------------------


def lm_eval_score(logits, inplen, cont):
    """lm_eval/models/huggingface.py: log_softmax(dim=-1), _select_cont_toks logits[inplen-contlen:inplen],
    gather at continuation tokens, float(sum)."""
    lp = torch.nn.functional.log_softmax(logits, dim=-1)[inplen - len(cont) : inplen]
    return float(torch.gather(lp.unsqueeze(0), 2, torch.tensor([cont]).unsqueeze(-1)).squeeze(-1).sum())


def test_continuation_logprob_matches_lm_eval_including_padding():
    torch.manual_seed(0)
    logits = torch.randn(9, 50, dtype=torch.float64)
    cont = [7, 3, 3]
    # float64, the same terms summed: equal to rounding (1e-16 relative of values below 10)
    assert continuation_logprob(logits, cont) == pytest.approx(lm_eval_score(logits, 9, cont), abs=1e-12)
    # right-padded row: only the first input_length positions are real
    assert continuation_logprob(logits, cont, input_length=6) == pytest.approx(
        lm_eval_score(logits, 6, cont), abs=1e-12)
    manual = sum(torch.log_softmax(logits[6 + i], -1)[t].item() for i, t in enumerate(cont))
    assert continuation_logprob(logits, cont) == pytest.approx(manual, abs=1e-12)
    with pytest.raises(InputError):
        continuation_logprob(logits, [1] * 10)
    with pytest.raises(InputError):
        continuation_logprob(logits[0], cont)


def test_single_token_scores_equal_argmax_of_last_position_logits():
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    answer_ids = (11, 12, 13, 14)
    scores = [continuation_logprob(logits, [i]) for i in answer_ids]
    assert predict(scores) == int(torch.argmax(logits[-1, list(answer_ids)]))


def test_predict_ties_go_to_first_and_nan_refused():
    assert predict([-1.0, -0.5, -0.5, -2.0]) == 1
    assert predict([-3.0, -3.0, -3.0, -3.0]) == 0
    assert predict([-3.0, -2.0, -1.0, -0.5]) == 3
    with pytest.raises(InputError):
        predict([0.0, float("nan"), 0.0, 0.0])


def test_aggregate_is_micro_over_subjects_and_json_serialisable():
    outcomes = [("anatomy", True)] + [("astronomy", c) for c in (True, False, False)] + [
        ("philosophy", True), ("philosophy", False), ("toy_subject", True)]
    res = aggregate(outcomes)
    assert res["subjects"]["astronomy"] == {"acc": 1 / 3, "correct": 1, "n": 3, "category": "stem"}
    assert res["categories"]["stem"] == {"acc": 0.5, "correct": 2, "n": 4, "subjects": 2}  # micro, not (1+1/3)/2
    assert res["categories"]["humanities"] == {"acc": 0.5, "correct": 1, "n": 2, "subjects": 1}
    assert res["categories"]["other"]["n"] == 1  # unknown subject counted as "other"
    assert "social_sciences" not in res["categories"]
    assert res["overall"] == {"acc": 4 / 7, "correct": 4, "n": 7, "subjects": 4}
    assert json.loads(json.dumps(res)) == res
    md = results_to_markdown(res)
    assert "| **mmlu** | 57.14 | 4 | 7 |" in md and "| - stem | 50.00 | 2 | 4 |" in md
    assert "|   - astronomy | 33.33 | 1 | 3 |" in md
    with pytest.raises(InputError):
        aggregate([])


def test_question_record():
    rec = question_record(TEST, [-2.0, -1.0, -0.5, -0.5])
    assert rec == {"subject": "abstract_algebra", "split": "test", "index": 0,
                   "scores": [-2.0, -1.0, -0.5, -0.5], "pred": "C", "gold": "C", "correct": True}
    assert json.loads(json.dumps(rec)) == rec
