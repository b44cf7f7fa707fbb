"""Shared-prefix evaluation and batches sized by tokens (docs/design.md#shared-prefix-evaluation,
docs/design.md#batches-sized-by-tokens), single process, real tiny models of every cache kind.

The reference is always the same evaluation with full prompts in batches of one row (no padding,
no cache): predictions must be identical and log-likelihoods within 1e-4 in fp32, for MLA
(DeepSeek-V3), grouped-query attention (Qwen3-MoE) and Kimi Linear's linear attention state.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from bounds import FP32_SCORES, check_close, judge_choices
from test_mmlu_eval import K_SHOT, build_tokenizer, load_split_data, write_mmlu_csvs

FULL = dict(tokens_per_batch=0, shared_prefix=False, batch_size=1)
SUBJECTS = {"abstract_algebra": 5, "philosophy": 4, "sociology": 5}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mmlu"))
    write_mmlu_csvs(root, SUBJECTS, seed=3)
    test, dev = load_split_data(root)
    return build_tokenizer(), build_tokenizer(answer_merges=False), test, dev


def _model(family: str):
    from nemo_moe_export.tiny_models import tiny_model

    extra = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2) if family == "kimi_linear" else {}
    return tiny_model(family, n_experts=4, num_layers=2, vocab_size=416, seed=1, initializer_range=0.5, **extra)


def _evaluate(model, tok, test, dev, **kw):
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    return evaluate_mmlu(model, tok, test, dev, k_shot=K_SHOT, progress=False, **kw)


def _assert_same(got, want, where):
    """fp32, prefixes computed once vs full prompts: log-likelihoods within the bound, the same
    answers wherever the full prompts decide them beyond it."""
    got_scores, want_scores = ([r["scores"] for r in result.records] for result in (got, want))
    check_close(got_scores, want_scores, FP32_SCORES, where)
    judge_choices(want_scores, got_scores, FP32_SCORES, where)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "kimi_linear"])
def test_shared_prefix_equals_full_prompts_for_every_cache_kind(data, family):
    tok, split_tok, test, dev = data
    model = _model(family)
    for tokenizer, where in ((tok, "single-token answers"), (split_tok, "multi-token answers")):
        reference = _evaluate(model, tokenizer, test, dev, **FULL)
        assert len(set(reference.predictions)) >= 2, "every question got the same answer: vacuous"
        for budget in (None, 400):  # one unit; several units of several suffix batches
            got = _evaluate(model, tokenizer, test, dev, tokens_per_batch=budget)
            assert got.scoring["shared_prefix_rows"] == got.scoring["rows"] and got.padding["prefix_forwards"] >= 1
            assert got.scoring["prefix_attention"] == ("copied" if family == "kimi_linear" else "packed")
            _assert_same(got, reference, f"{family}, {where}, tokens_per_batch={budget}")


class NarrowForward(torch.nn.Module):
    """A real transformers model behind a forward that takes no cache (as a megatron-core wrapper
    called transformers-style may): shared prefixes must fall back to full prompts."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)


def test_a_model_that_cannot_cache_falls_back_to_full_prompts_with_a_log_line(data, caplog):
    tok, _, test, dev = data
    model = _model("deepseek_v3")
    with caplog.at_level(logging.WARNING, logger="nemo_moe_export.evaluate.evaluator"):
        got = _evaluate(NarrowForward(model), tok, test, dev)
    assert "shared prefixes off, evaluating full prompts" in caplog.text
    assert "takes no cache or past_key_values, use_cache, position_ids" in caplog.text
    assert got.scoring["shared_prefixes"] == 0 and got.padding["prefix_forwards"] == 0
    _assert_same(got, _evaluate(model, tok, test, dev, **FULL), "fallback")


def test_plan_units_cover_every_row_once_within_the_budget(data):
    """Every row in exactly one suffix batch, each right after its unit's prefix batch in the
    order a shard runs them; no forward over the budget; the batches do not depend on the world."""
    from nemo_moe_export.evaluate.batching import plan_batches, plan_steps
    from nemo_moe_export.evaluate.prefixes import find_shared_prefixes
    from nemo_moe_export.evaluate.prepare import prepare_questions
    from nemo_moe_export.parallel import ParallelLayout, RankGroup

    tok, _, test, dev = data
    prepared = prepare_questions(tok, test, dev, k_shot=K_SHOT, max_length=512)
    prefixes = find_shared_prefixes(prepared)
    assert [p.subject for p in prefixes] == sorted(SUBJECTS)
    for p in prefixes:
        assert all(prepared.rows[r].input_ids[:p.length] == p.token_ids for r in p.rows)
    budget = 400
    batches = plan_batches(prepared.rows, 16, token_budget=budget, prefixes=prefixes)
    suffix_rows = sorted(r for b in batches if b.kind == "suffix" for r in b.rows)
    assert suffix_rows == list(range(len(prepared.rows)))
    assert all(b.n_rows * (b.context + b.length) <= budget or b.n_rows == 1 for b in batches)
    assert sum(b.kind == "prefix" for b in batches) >= 2, "the budget should make several units"
    for world in (1, 2, 3):
        plans = []
        for rank in range(world):
            group = RankGroup(rank, world, tuple(range(world)))
            plans.append(plan_steps(batches, "lockstep", ParallelLayout(group, RankGroup.alone(), group, "test")))
        assert len({p.n_steps for p in plans}) == 1
        run = [b for p in plans for b in p.batch_of_step if b is not None]
        assert sorted(run) == list(range(len(batches)))
        for p in plans:
            current = None
            for b in (batches[i] for i in p.batch_of_step if i is not None):
                current = b.batch_id if b.kind == "prefix" else current
                assert b.kind != "suffix" or b.after == current, "a suffix batch ran without its prefix's cache"


def test_batched_scores_equal_lm_eval_style_single_row_scores():
    from nemo_moe_export.evaluate.scoring import batch_continuation_logprobs, continuation_logprob

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(3, 3, 50) * 4).to(dtype)
        continuations = [[(4,), (7,), (9,), (11,)], [(5, 6, 7)], [(8, 2)]]
        got = batch_continuation_logprobs(logits, continuations)
        for i, choices in enumerate(continuations):
            want = [continuation_logprob(logits[i], c) for c in choices]
            assert got[i, :len(choices)].tolist() == want, (dtype, i)
            assert all(math.isnan(v) for v in got[i, len(choices):].tolist())


def test_default_token_budget_comes_from_the_model_and_its_device():
    from nemo_moe_export.evaluate.batching import MAX_TOKENS, MIN_TOKENS, bytes_per_token, default_tokens_per_batch

    small, big = _model("deepseek_v3"), _model("qwen3_moe")
    assert bytes_per_token(big) != bytes_per_token(small)
    for model in (small, big):
        budget = default_tokens_per_batch(model, shared_prefix=False)
        assert MIN_TOKENS <= budget <= MAX_TOKENS and budget % 1024 == 0
        again = default_tokens_per_batch(model, shared_prefix=False)
        assert budget == again, "must be the same on every call (and rank)"
    wide = _model_with(hidden_size=512, moe_intermediate_size=512)
    full_prompts = dict(shared_prefix=False)
    assert default_tokens_per_batch(wide, **full_prompts) < default_tokens_per_batch(small, **full_prompts)


def test_full_prompt_default_budget_is_capped_below_the_shared_prefix_one(monkeypatch):
    """Full prompts pad to their batch's longest row, so their default stops at
    FULL_PROMPT_MAX_TOKENS; shared-prefix suffixes may use the whole memory-derived budget."""
    from nemo_moe_export.evaluate import batching

    model = _model("deepseek_v3")
    monkeypatch.setattr(batching, "CPU_ACTIVATION_BYTES", 64 << 30)  # a device with room for far more
    assert batching.default_tokens_per_batch(model, shared_prefix=False) == batching.FULL_PROMPT_MAX_TOKENS
    assert batching.default_tokens_per_batch(model, shared_prefix=True) == batching.MAX_TOKENS


def _model_with(**config):
    from nemo_moe_export.tiny_models import tiny_model

    return tiny_model("deepseek_v3", n_experts=4, num_layers=2, vocab_size=416, **config)


def test_a_row_longer_than_the_budget_still_gets_a_forward_of_its_own(data):
    from nemo_moe_export.evaluate.batching import plan_batches
    from nemo_moe_export.evaluate.prefixes import find_shared_prefixes
    from nemo_moe_export.evaluate.prepare import prepare_questions

    tok, _, test, dev = data
    prepared = prepare_questions(tok, test, dev, k_shot=K_SHOT, max_length=512)
    tiny = plan_batches(prepared.rows, 16, token_budget=8, prefixes=find_shared_prefixes(prepared))
    assert all(b.n_rows == 1 for b in tiny)
    assert sorted(r for b in tiny for r in b.rows) == list(range(len(prepared.rows)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_lse_equals_torch_sdpa_and_its_log_sum_exp(causal, dtype):
    """The kernels behind the broadcast prefix attention (flash on CPU, and the plain-torch one
    used where no fused kernel returns the log-sum-exp), against SDPA and a float64 log-sum-exp;
    value heads narrower than the keys, as MLA's."""
    from nemo_moe_export.evaluate.prefix_attention import _math_attention_with_lse, attention_with_lse

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 4, 9, 24, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(3, 4, 9, 16, generator=gen).to(dtype)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                            scale=0.3)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for fn in (lambda: attention_with_lse(q, k, v, 0.3, causal=causal), lambda: _math_attention_with_lse(q, k, v, 0.3, causal)):
        out, lse = fn()
        assert out.dtype == dtype and out.shape == want.shape and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() <= tol
        assert (lse.double() - scores.logsumexp(-1)).abs().max() <= tol
