"""Distributed MMLU evaluation on real gloo ranks with a real tiny DeepSeek-V3: no hang, same answers.

Everything is built offline here: MMLU CSVs in the hendrycks layout (4 subjects, one per category,
questions of 1-30 words so prompt lengths vary), a byte-level BPE tokenizer trained with
``tokenizers`` (" A".." D" are single tokens; a second one, with no merges, splits them), and the
model from ``tiny_models``. 43 questions in batches of 4 make 11 batches, so batch counts per rank
are uneven on 4 ranks (and on the 2 expert-DP replicas of EP=2).

The reference is a single-process run in the pytest process itself (no torch.distributed), batch
size 1 and full prompts, so it has no padding and no cache at all. Distributed runs must give the
same prediction for every question (scores within fp32 noise), whatever the layout (EP=2, EP=4,
FSDP2, Megatron's parallel_state), policy and mode (fixed batches of full prompts, or the default:
batches sized by tokens with shared k-shot prefixes).
"""

from __future__ import annotations

import csv
import json
import os
import random
import time

import pytest
import torch

from bounds import FP32_SCORES, check_close, judge_answers, judge_choices, judge_predictions
from nemo_moe_export.errors import InputError
from nemo_moe_export.spawn import spawn

WORLD = 4
SUBJECTS = {"abstract_algebra": 11, "philosophy": 9, "sociology": 13, "virology": 10}  # 43 questions
N_QUESTIONS = sum(SUBJECTS.values())
DEV_PER_SUBJECT = 3
K_SHOT = 2
BATCH = 4
N_BATCHES = -(-N_QUESTIONS // BATCH)  # 11: not a multiple of 4 (nor of 2)
TOKENIZER_VOCAB = 400
# initializer_range 0.5: a random model whose answers depend on the question (at the default 0.02
# every question gets the same letter and the comparisons below would be vacuous).
MODEL_KW = dict(n_experts=8, num_layers=3, vocab_size=416, seed=0, initializer_range=0.5)
STALL_TIMEOUT_S = 3.0
FULL_PROMPTS = dict(tokens_per_batch=0, shared_prefix=False)  # fixed batches of BATCH rows, no cache
# shared prefixes (packed: the tokens a forward feeds), several units and suffix batches per unit
SHARED = dict(tokens_per_batch=200, shared_prefix=True)
WORDS = ("alpha beta gamma delta field ring group prime matrix vector virus cell law mind society "
         "ethics norm proof").split()
DESCRIPTION = "The following are multiple choice questions (with answers) about"


# --------------------------------------------------------------------------------------------------
# Test inputs (built offline, shared by the parent and the ranks)
# --------------------------------------------------------------------------------------------------


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_mmlu_csvs(root: str, subjects: dict[str, int] = SUBJECTS, seed: int = 0) -> None:
    """hendrycks layout: {dev,test}/{subject}_{split}.csv, no header, question,A,B,C,D,answer."""
    rng = random.Random(seed)
    for split, counts in (("dev", {s: DEV_PER_SUBJECT for s in subjects}), ("test", subjects)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for subject, n in counts.items():
            with open(os.path.join(root, split, f"{subject}_{split}.csv"), "w", newline="") as f:
                writer = csv.writer(f)
                for _ in range(n):
                    choices = [_sentence(rng, 1, 4) for _ in range(4)]
                    writer.writerow([_sentence(rng, 1, 30) + "?", *choices, rng.choice("ABCD")])


def write_mmlu_inputs(root, subjects) -> dict[str, str]:
    """Under ``root``: an MMLU folder of ``subjects`` (``data``) and the tests' tokenizer (``tok``)."""
    data_dir, tok_dir = str(root / "data"), str(root / "tok")
    write_mmlu_csvs(data_dir, subjects)
    build_tokenizer().save_pretrained(tok_dir)
    return {"data": data_dir, "tok": tok_dir}


def build_tokenizer(answer_merges: bool = True):
    """Byte-level BPE (GPT-2 style) whose merges cover the prompt words. With ``answer_merges``
    " A".." D" are single tokens; without, the corpus never shows a space before a capital letter,
    so every answer is two tokens ("Ġ", letter) and scoring must take the full path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 5 + [DESCRIPTION, "Answer:"] * 10 + ([" A B C D"] * 50 if answer_merges else [])
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def load_split_data(data_dir: str):
    from nemo_moe_export.evaluate.data import load_mmlu

    loaded = load_mmlu(data_dir)
    return [q for q in loaded if q.split == "test"], [q for q in loaded if q.split == "dev"]


def build_model():
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", **MODEL_KW)
    # tiny_model's N(0, 1) router biases would send every token to the same experts; smaller ones
    # make routing token-dependent, so EP all-to-alls carry uneven, partly empty splits.
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.mul_(0.05)
    return model


def summary(result, plan_steps=None) -> dict:
    """What the parent compares: predictions, scores and the bookkeeping (picklable)."""
    return {"pred": result.predictions, "scores": [r["scores"] for r in result.records],
            "metrics": result.metrics, "steps": result.steps, "padding": result.padding,
            "scoring": result.scoring, "layout": result.layout, "plan": plan_steps}


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


class ForwardCounter:
    """Counts forwards of a model (dummy ones included) through a pre-hook."""

    def __init__(self, model) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.count += 1


def _plan(tok, test, dev, layout, policy, **kw):
    """This rank's steps and the global batches, planned as evaluate_mmlu plans them with ``kw``."""
    from nemo_moe_export.evaluate.batching import plan_batches, plan_steps
    from nemo_moe_export.evaluate.prefixes import find_shared_prefixes
    from nemo_moe_export.evaluate.prepare import prepare_questions

    prepared = prepare_questions(tok, test, dev, k_shot=K_SHOT, max_length=512, scoring=kw.get("scoring", "auto"))
    prefixes = find_shared_prefixes(prepared) if kw.get("shared_prefix", True) else ()
    # packed=: the tests' DeepSeek-V3 model evaluates shared prefixes packed (prefix_attention.PACKED_MODEL_TYPES)
    batches = plan_batches(prepared.rows, BATCH, token_budget=kw["tokens_per_batch"], prefixes=prefixes,
                           packed=bool(prefixes))
    return plan_steps(batches, policy, layout), batches


def _run_policies(model, tok, test, dev, layout, label: str, policies=("lockstep", "expert_dp"), **kw) -> dict:
    """Evaluate under each policy; keep the answers, the forward count and this rank's step plan."""
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    kw = FULL_PROMPTS | kw
    counter = ForwardCounter(model)
    out = {}
    for policy in policies:
        before = counter.count
        result = evaluate_mmlu(model, tok, test, dev, layout, k_shot=K_SHOT, batch_size=BATCH, policy=policy,
                               timeout_s=60, progress=False, **kw)
        plan, batches = _plan(tok, test, dev, layout, policy, **kw)
        kinds = [None if b is None else batches[b].kind for b in plan.batch_of_step]
        out[(label, policy)] = summary(result, list(plan.batch_of_step)) | {"forwards": counter.count - before,
                                                                            "kinds": kinds}
    return out


def _bad_inputs(tok, split_tok, test, dev, layout, model) -> dict:
    """Each bad input must raise InputError at once, on every rank, with no collective begun."""
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    cases = {
        "k_too_large": dict(tokenizer=tok, k_shot=DEV_PER_SUBJECT + 1),
        "split_letters": dict(tokenizer=split_tok, scoring="single_token"),
        "unknown_policy": dict(tokenizer=tok, policy="round_robin"),
        "no_questions": dict(tokenizer=tok, questions=[]),
    }
    out = {}
    for name, kw in cases.items():
        kw = {"questions": test, "k_shot": K_SHOT} | kw
        started = time.monotonic()
        try:
            evaluate_mmlu(model, kw.pop("tokenizer"), kw.pop("questions"), dev, layout, timeout_s=60,
                          progress=False, **kw)
            out[name] = (None, time.monotonic() - started)
        except InputError as exc:
            out[name] = (str(exc).replace(f"rank {layout.dp.ranks[layout.dp.rank]}", "rank R"),
                         time.monotonic() - started)
    return out


def _equivalence_worker(rank: int, world: int, data_dir: str, tok_dir: str, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.hooks import RecipeContext
    from nemo_moe_export.parallel import discover_layout, init_expert_parallel

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(tok_dir, "single"))
    split_tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(tok_dir, "split"))
    test, dev = load_split_data(data_dir)
    results: dict = {}

    layout2 = init_expert_parallel(2, timeout_s=60)
    model2 = apply_expert_parallel(build_model(), layout2)
    results["bad_inputs"] = _bad_inputs(tok, split_tok, test, dev, layout2, model2)
    results |= _run_policies(model2, tok, test, dev, layout2, "ep2")  # still in step after the errors
    results |= _run_policies(model2, tok, test, dev, layout2, "ep2-uniform", policies=("lockstep",),
                             uniform_shapes=True)
    results |= _run_policies(model2, split_tok, test, dev, layout2, "ep2-full", policies=("lockstep",))
    results |= _run_policies(model2, tok, test, dev, layout2, "ep2-shared", **SHARED)
    results |= _run_policies(model2, split_tok, test, dev, layout2, "ep2-shared-full", policies=("lockstep",), **SHARED)

    # The hook protocol, as a training loop drives it: steps 1..3, then the end of training.
    callback = MMLUCallback(data_dir, every_n_steps=2, k_shot=K_SHOT, batch_size=BATCH,
                            output_dir=out_dir, timeout_s=60, progress=False)
    ctx = RecipeContext(model=model2, layout=layout2, tokenizer=tok)
    for step in (1, 2, 3):
        callback.on_step_end(ctx, step)
    callback.on_train_end(ctx)
    results["callback"] = {"during": ctx.results["mmlu_during_training"], "final": ctx.results["mmlu"],
                           "final_flat": callback.history[-1]["metrics"]}
    results["callback_pred"] = callback.last_result.predictions

    layout4 = init_expert_parallel(4, timeout_s=60)
    results |= _run_policies(apply_expert_parallel(build_model(), layout4), tok, test, dev, layout4, "ep4")

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    fsdp = build_model()
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    results |= _run_policies(fsdp, tok, test, dev, discover_layout(mesh), "fsdp")
    results |= _run_policies(fsdp, tok, test, dev, discover_layout(mesh), "fsdp-shared", policies=("lockstep",),
                             **SHARED)

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        layout = discover_layout()
        results |= _run_policies(apply_expert_parallel(build_model(), layout), tok, test, dev, layout, "megatron")
    finally:
        parallel_state.destroy_model_parallel()
    return results


class FailAtForward:
    """Raises from a forward pre-hook at the ``n``-th forward: a rank failing mid-evaluation."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self, *_args) -> None:
        self.seen += 1
        if self.seen == self.n:
            raise RuntimeError("injected failure")


def _failure_worker(rank: int, world: int, data_dir: str, tok_dir: str) -> dict:
    """A failing peer (lockstep, EP=2), then the naive policy (EP=4): errors on every rank."""
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import PeerError, init_expert_parallel

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(tok_dir, "single"))
    test, dev = load_split_data(data_dir)
    out = {}
    for label, ep, policy, fail_rank, mode in (("failing_peer", 2, "lockstep", 2, FULL_PROMPTS),
                                               ("naive", 4, "naive", None, FULL_PROMPTS),
                                               ("failing_peer_shared", 2, "lockstep", 2, SHARED),
                                               ("naive_shared", 4, "naive", None, SHARED)):
        layout = init_expert_parallel(ep, timeout_s=STALL_TIMEOUT_S)
        model = apply_expert_parallel(build_model(), layout)
        if rank == fail_rank:
            model.register_forward_pre_hook(FailAtForward(2))
        plan, batches = _plan(tok, test, dev, layout, policy, **mode)
        kinds = [None if b is None else batches[b].kind for b in plan.batch_of_step]
        started = time.monotonic()
        try:
            evaluate_mmlu(model, tok, test, dev, layout, k_shot=K_SHOT, batch_size=BATCH, policy=policy,
                          timeout_s=3 * STALL_TIMEOUT_S, progress=False, **mode)
            out[label] = {"error": None, "elapsed": time.monotonic() - started, "kinds": kinds}
        except PeerError as exc:
            out[label] = {"error": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - started,
                          "kinds": kinds}
    return out


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmlu")
    data_dir, tok_dir = str(root / "data"), str(root / "tok")
    write_mmlu_csvs(data_dir)
    build_tokenizer().save_pretrained(os.path.join(tok_dir, "single"))
    build_tokenizer(answer_merges=False).save_pretrained(os.path.join(tok_dir, "split"))
    return {"data": data_dir, "tok": tok_dir, "root": root}


def _tokenizer(inputs, kind="single"):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(os.path.join(inputs["tok"], kind))


@pytest.fixture(scope="module")
def reference(inputs):
    """Single process, no torch.distributed, batch size 1 (nothing padded)."""
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    test, dev = load_split_data(inputs["data"])
    model = build_model()
    out = {}
    for label, kind, scoring, batch, mode in (
            ("single", "single", "auto", 1, FULL_PROMPTS), ("single_batched", "single", "auto", BATCH, FULL_PROMPTS),
            ("full", "single", "full", BATCH, FULL_PROMPTS), ("split", "split", "auto", BATCH, FULL_PROMPTS),
            ("default", "single", "auto", BATCH, {}), ("shared", "single", "auto", BATCH, SHARED),
            ("shared_split", "split", "auto", BATCH, SHARED)):
        out[label] = summary(evaluate_mmlu(model, _tokenizer(inputs, kind), test, dev, k_shot=K_SHOT,
                                           batch_size=batch, scoring=scoring, progress=False, **mode))
    return out


@pytest.fixture(scope="module")
def distributed(inputs):
    out_dir = str(inputs["root"] / "callback")
    per_rank = spawn(_equivalence_worker, WORLD, inputs["data"], inputs["tok"], out_dir, timeout_s=240)
    return per_rank, out_dir


# --------------------------------------------------------------------------------------------------
# Tests: single process
# --------------------------------------------------------------------------------------------------


def test_reference_is_a_real_signal(reference):
    """Guards the equivalence tests: predictions vary, both scoring paths ran, nothing was cut."""
    single, split = reference["single"], reference["split"]
    assert len(single["pred"]) == N_QUESTIONS
    assert len(set(single["pred"])) >= 2, "every question got the same answer: comparisons would be vacuous"
    assert single["scoring"]["single_token_questions"] == N_QUESTIONS and single["scoring"]["rows"] == N_QUESTIONS
    assert split["scoring"]["full_questions"] == N_QUESTIONS and split["scoring"]["rows"] == 4 * N_QUESTIONS
    assert single["scoring"]["truncated_questions"] == 0
    assert single["padding"]["waste"] == 0.0


@pytest.mark.parametrize("mode,want", [("default", "single"), ("shared", "single"), ("shared_split", "split")])
def test_shared_prefix_equals_full_prompts(reference, mode, want):
    """fp32: the same predictions as full prompts, log-likelihoods within 1e-4, with the k-shot
    prefix computed once per unit and its cache continued (the default mode, and a small budget
    that makes several units and several suffix batches per unit)."""
    got = reference[mode]
    assert got["scoring"]["shared_prefixes"] == len(SUBJECTS), got["scoring"]
    assert got["scoring"]["shared_prefix_rows"] == got["scoring"]["rows"]
    assert got["padding"]["prefix_forwards"] >= 1 and got["padding"]["real_tokens"] < reference[want]["padding"][
        "real_tokens"] * 0.6, "the prefix was not shared"
    judge_answers(got, reference[want], f"{mode} vs full prompts")
    if mode != "default":
        assert got["scoring"]["prefix_batches"] >= 3 and got["scoring"]["batches"] >= 2 * got["scoring"][
            "prefix_batches"], got["scoring"]


def test_padded_batches_equal_unpadded(reference):
    batched = reference["single_batched"]
    assert batched["padding"]["padded_tokens"] > 0, "no padding happened; the test would prove nothing"
    judge_answers(batched, reference["single"], "batch size 4 vs 1")


def test_single_token_path_equals_full_continuation_loglikelihood(reference):
    # " A".." D" are single tokens: the four logits at the last position are lm-eval's loglikelihoods.
    judge_answers(reference["full"], reference["single"], "full vs single-token scoring")


def test_predictions_match_a_direct_forward(inputs, reference):
    """Independent of the evaluator's batching: one unpadded forward per question, argmax of the
    log-softmax at the last position over the answer tokens."""
    from nemo_moe_export.evaluate.prompts import build_prompt, encode_request, select_fewshot

    tok, model = _tokenizer(inputs), build_model().eval()
    test, dev = load_split_data(inputs["data"])
    letters = [tok.convert_tokens_to_ids(f"Ġ{x}") for x in "ABCD"]
    direct = []
    for q in test[:12]:
        prompt = build_prompt(q, select_fewshot(dev, K_SHOT, q))
        ids = torch.tensor([encode_request(tok, prompt).context])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)[letters]
        direct.append(logp.tolist())
    check_close(direct, reference["single"]["scores"][:12], FP32_SCORES, "direct forward vs the evaluator")
    judge_choices(direct, reference["single"]["scores"][:12], FP32_SCORES, "direct forward vs the evaluator")


def test_one_position_list_per_batch_equals_per_row_positions(inputs, reference, monkeypatch):
    """transformers releases before per-row ``logits_to_keep`` (5.17 on the GPU image) get each
    row's positions gathered in front of the output head: same predictions, scores within float
    rounding, for full prompts and shared prefixes."""
    from nemo_moe_export.evaluate import runner
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    monkeypatch.setattr(runner, "_accepts_row_positions", lambda: False)
    test, dev = load_split_data(inputs["data"])
    for mode in (FULL_PROMPTS, SHARED):
        result = evaluate_mmlu(build_model(), _tokenizer(inputs), test, dev, k_shot=K_SHOT, batch_size=BATCH,
                               progress=False, **mode)
        judge_answers(summary(result), reference["single"], f"one position list per batch {mode}")


def test_truncation_cuts_from_the_left_and_is_reported(inputs):
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    test, dev = load_split_data(inputs["data"])
    model, tok = build_model(), _tokenizer(inputs)
    short = evaluate_mmlu(model, tok, test[:8], dev, k_shot=K_SHOT, batch_size=BATCH, max_length=48, progress=False,
                          **FULL_PROMPTS)
    unbatched = evaluate_mmlu(model, tok, test[:8], dev, k_shot=K_SHOT, batch_size=1, max_length=48, progress=False,
                              **FULL_PROMPTS)
    assert short.scoring["truncated_questions"] == 8 and short.padding["fed_tokens"] <= 8 * 48
    unbatched_scores = [r["scores"] for r in unbatched.records]
    judge_choices(unbatched_scores, [r["scores"] for r in short.records], FP32_SCORES, "cut rows, batch 4 vs 1")
    default = evaluate_mmlu(model, tok, test[:8], dev, k_shot=K_SHOT, max_length=48, progress=False)
    assert default.scoring["shared_prefix_rows"] == 0, "cut rows must keep their full prompts"
    judge_choices(unbatched_scores, [r["scores"] for r in default.records], FP32_SCORES, "cut rows, default vs 1")


@pytest.mark.parametrize("case", ["missing_dir", "malformed_csv", "unknown_subject", "k_too_large",
                                  "split_letters", "vocab_mismatch", "bad_policy", "bad_tokens_per_batch",
                                  "bad_shared_prefix"])
def test_bad_input_is_a_clear_error(inputs, tmp_path, case):
    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    model, tok = build_model(), _tokenizer(inputs)
    test, dev = load_split_data(inputs["data"])
    if case == "malformed_csv":
        write_mmlu_csvs(str(tmp_path))
        with open(tmp_path / "test" / "virology_test.csv", "a") as f:
            f.write("only,three,columns\n")
    calls = {
        "missing_dir": (lambda: MMLUCallback(tmp_path / "nope").evaluate(model, tok), "not found"),
        "malformed_csv": (lambda: MMLUCallback(tmp_path).evaluate(model, tok), "wrong column count"),
        "unknown_subject": (lambda: MMLUCallback(inputs["data"], subjects=["anatomy"]).evaluate(model, tok),
                            "subject\\(s\\) not found"),
        "k_too_large": (lambda: evaluate_mmlu(model, tok, test, dev, k_shot=4), "k=4 few-shot"),
        "split_letters": (lambda: evaluate_mmlu(model, _tokenizer(inputs, "split"), test, dev, k_shot=K_SHOT,
                                                scoring="single_token"), "splits the answer letters"),
        "vocab_mismatch": (lambda: evaluate_mmlu(build_model_with_vocab(256), tok, test, dev, k_shot=K_SHOT),
                           "outside the model's vocabulary"),
        "bad_policy": (lambda: MMLUCallback(inputs["data"], policy="naive"), "policy"),
        "bad_tokens_per_batch": (lambda: evaluate_mmlu(model, tok, test, dev, k_shot=K_SHOT, tokens_per_batch=-8),
                                 "tokens_per_batch"),
        "bad_shared_prefix": (lambda: MMLUCallback(inputs["data"], shared_prefix="yes"), "shared_prefix"),
    }
    call, message = calls[case]
    with pytest.raises(InputError, match=message):
        call()


def build_model_with_vocab(vocab_size: int):
    from nemo_moe_export.tiny_models import tiny_model

    return tiny_model("deepseek_v3", **(MODEL_KW | {"vocab_size": vocab_size}))


def test_plan_balances_steps_and_keeps_padding_low(inputs):
    """Planning alone (no ranks): equal step counts for safe policies, uneven for naive."""
    from nemo_moe_export.evaluate.batching import plan_batches, plan_steps
    from nemo_moe_export.evaluate.prepare import prepare_questions
    from nemo_moe_export.parallel import ParallelLayout, RankGroup

    test, dev = load_split_data(inputs["data"])
    prepared = prepare_questions(_tokenizer(inputs), test, dev, k_shot=K_SHOT, max_length=512)
    batches = plan_batches(prepared.rows, BATCH)
    assert len(batches) == N_BATCHES
    lengths = [len(prepared.rows[i].input_ids) for b in batches for i in b.rows]
    assert lengths == sorted(lengths, reverse=True)
    fed = sum(len(b.rows) * b.length for b in batches)
    assert 1 - sum(lengths) / fed <= 0.10

    def layout(rank, ep):
        ep_group = RankGroup(rank % ep, ep, tuple(range(rank // ep * ep, rank // ep * ep + ep)))
        edp_group = RankGroup(rank // ep, WORLD // ep, tuple(range(rank % ep, WORLD, ep)))
        return ParallelLayout(RankGroup(rank, WORLD, (0, 1, 2, 3)), ep_group, edp_group, "test")

    for policy, ep, want_steps in (("lockstep", 2, 3), ("expert_dp", 2, 6), ("expert_dp", 4, 11)):
        plans = [plan_steps(batches, policy, layout(r, ep)) for r in range(WORLD)]
        assert {p.n_steps for p in plans} == {want_steps}, policy
        run = sorted(b for p in plans for b in p.batch_of_step if b is not None)
        copies = 1 if policy == "lockstep" else ep
        assert run == sorted(list(range(N_BATCHES)) * copies), policy
    naive = [plan_steps(batches, "naive", layout(r, 4)).n_steps for r in range(WORLD)]
    assert naive == [3, 3, 3, 2]
    uniform = [plan_steps(batches, "lockstep", layout(r, 2), uniform_shapes=True).shapes for r in range(WORLD)]
    assert all(u == uniform[0] for u in uniform) and uniform[0][0] == (BATCH, batches[0].length)


# --------------------------------------------------------------------------------------------------
# Tests: 4 gloo ranks
# --------------------------------------------------------------------------------------------------


RUNS = [("ep2", "lockstep"), ("ep2", "expert_dp"), ("ep4", "lockstep"), ("ep4", "expert_dp"),
        ("fsdp", "lockstep"), ("fsdp", "expert_dp"), ("megatron", "lockstep"), ("megatron", "expert_dp"),
        ("ep2-uniform", "lockstep"), ("ep2-shared", "lockstep"), ("ep2-shared", "expert_dp"),
        ("fsdp-shared", "lockstep")]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(r))
def test_distributed_predictions_equal_single_process(run, distributed, reference):
    per_rank, _ = distributed
    for rank, results in enumerate(per_rank):
        judge_answers(results[run], reference["single"], f"{run} rank {rank}")


def test_full_continuation_path_distributed(distributed, reference):
    per_rank, _ = distributed
    for rank, results in enumerate(per_rank):
        for run in ("ep2-full", "ep2-shared-full"):
            got = results[(run, "lockstep")]
            assert got["scoring"]["full_questions"] == N_QUESTIONS
            judge_answers(got, reference["split"], f"{run} rank {rank}")


def test_prefix_forwards_are_steps_like_any_other(distributed):
    """Guards the shared-prefix runs: every rank ran prefix and suffix forwards, and at some step
    ranks ran forwards of different kinds (each still exactly one forward, counted above)."""
    per_rank, _ = distributed
    for run in (("ep2-shared", "lockstep"), ("ep2-shared", "expert_dp"), ("fsdp-shared", "lockstep")):
        kinds = [results[run]["kinds"] for results in per_rank]
        assert all("prefix" in k and "suffix" in k for k in kinds), kinds
        assert any(len({k[s] for k in kinds}) > 1 for s in range(len(kinds[0]))), kinds


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(r))
def test_every_rank_runs_the_same_number_of_forwards(run, distributed):
    per_rank, _ = distributed
    forwards = [results[run]["forwards"] for results in per_rank]
    steps = [results[run]["steps"] for results in per_rank]
    assert len(set(forwards)) == 1 and forwards == steps, (forwards, steps)


def test_layouts_and_uneven_batches_were_exercised(distributed):
    """Guards the equivalence tests: the layouts were the intended ones and some rank had to run
    a dummy step (the case that hangs without it)."""
    per_rank, _ = distributed
    for rank, results in enumerate(per_rank):
        assert results[("ep2", "lockstep")]["layout"]["ep"]["size"] == 2
        assert results[("ep4", "lockstep")]["layout"]["ep"]["size"] == 4
        assert results[("fsdp", "lockstep")]["layout"]["ep"]["size"] == 1
        assert results[("megatron", "lockstep")]["layout"]["source"] == "megatron"
        assert results[("megatron", "lockstep")]["layout"]["edp"]["ranks"] == [rank % 2, rank % 2 + 2]
    lockstep_plans = [results[("ep2", "lockstep")]["plan"] for results in per_rank]
    assert any(None in plan for plan in lockstep_plans) and not all(None in plan for plan in lockstep_plans)
    edp_plans = [results[("ep2", "expert_dp")]["plan"] for results in per_rank]
    assert edp_plans[0] == edp_plans[1] and edp_plans[2] == edp_plans[3], "EP peers must share batches"
    assert edp_plans[0] != edp_plans[2]


def test_lockstep_splits_work_over_all_ranks(distributed):
    per_rank, _ = distributed
    for results in per_rank:
        assert results[("ep4", "lockstep")]["steps"] == -(-N_BATCHES // WORLD)
        assert results[("ep4", "expert_dp")]["steps"] == N_BATCHES  # EP=4 on 4 ranks: no expert-DP split
        assert results[("ep4", "lockstep")]["padding"]["waste"] <= 0.10


def test_bad_input_raises_on_every_rank_before_any_collective(distributed):
    per_rank, _ = distributed
    first = per_rank[0]["bad_inputs"]
    for name, (message, elapsed) in first.items():
        assert message is not None, f"{name}: no error"
    for rank, results in enumerate(per_rank):
        for name, (message, elapsed) in results["bad_inputs"].items():
            assert message == first[name][0], f"rank {rank} {name}: a different error"
            assert elapsed < 5, f"rank {rank} {name}: took {elapsed:.1f} s (waited on a collective?)"
    # The evaluations that followed on the same groups succeeded: no rank was left inside a collective.
    assert all(("ep2", "lockstep") in results for results in per_rank)


def test_callback_writes_results(distributed, reference):
    per_rank, out_dir = distributed
    for rank, results in enumerate(per_rank):
        during, final, at_end = (results["callback"][k] for k in ("during", "final", "final_flat"))
        assert [r["step"] for r in during] == [2], "with every_n_steps=2, steps 1 and 3 are not evaluated"
        at_two = {k: v for k, v in during[0].items() if k != "step"}
        accuracy = {k: v for k, v in at_two.items() if k.endswith("/acc")}
        assert {k: at_end[k] for k in accuracy} == accuracy and len(accuracy) == 5
        judge_predictions(reference["single"]["scores"], results["callback_pred"], FP32_SCORES,
                          f"callback rank {rank} vs single process")
        if results["callback_pred"] == reference["single"]["pred"]:  # metrics follow the answers
            assert at_two["mmlu/acc"] == pytest.approx(reference["single"]["metrics"]["overall"]["acc"])
            assert final == reference["single"]["metrics"], f"rank {rank}: ctx.results['mmlu']"
    payload = json.loads(open(os.path.join(out_dir, "mmlu_results.json")).read())
    assert payload["step"] == 3 and payload["policy"] == "lockstep"
    assert payload["results"] == per_rank[0]["callback"]["final"]
    assert set(payload["results"]["categories"]) == {"stem", "humanities", "social_sciences", "other"}
    assert [p["pred"] for p in payload["predictions"]] == per_rank[0]["callback_pred"]
    assert payload["layout"]["ep"]["size"] == 2 and payload["layout"]["dp"]["size"] == WORLD
    # the callback runs the default mode: here one unit, all suffixes (1-30 words) in one batch
    assert payload["timing"]["questions_per_s"] > 0 and 0 <= payload["padding"]["waste"] <= 0.5
    assert payload["scoring"]["shared_prefix_rows"] == N_QUESTIONS and payload["padding"]["prefix_forwards"] >= 1
    assert [h["step"] for h in payload["history"]] == [2, 3]
    markdown = open(os.path.join(out_dir, "mmlu_results.md")).read()
    overall = reference["single"]["metrics"]["overall"]
    assert f"| **mmlu** | {100 * overall['acc']:.2f} | {overall['correct']} | {N_QUESTIONS} |" in markdown
    assert "| - humanities |" in markdown and "|   - virology |" in markdown
    for chart in ("mmlu_categories.png", "mmlu_history.png"):
        assert open(os.path.join(out_dir, chart), "rb").read(8) == b"\x89PNG\r\n\x1a\n", chart


@pytest.fixture(scope="module")
def failures(inputs):
    return spawn(_failure_worker, WORLD, inputs["data"], inputs["tok"], timeout_s=120)


def test_failing_peer_is_an_error_on_every_rank_naming_the_step(failures):
    for rank, out in enumerate(failures):
        res = out["failing_peer"]
        assert res["error"] is not None, f"rank {rank} finished although rank 2 failed"
        assert "mmlu step 2 of 3" in res["error"], res["error"]
        assert "injected failure" in res["error"] and 2 in res["ranks"], res
        assert res["elapsed"] < 4 * STALL_TIMEOUT_S + 5, res


def test_failing_peer_with_shared_prefixes(failures):
    """The same with shared prefixes: rank 2 fails its second forward (a suffix after its prefix
    forward), every rank names that step."""
    assert failures[2]["failing_peer_shared"]["kinds"][0] == "prefix", "rank 2 must fail right after a prefix forward"
    for rank, out in enumerate(failures):
        res = out["failing_peer_shared"]
        assert res["error"] is not None, f"rank {rank} finished although rank 2 failed"
        assert f"mmlu step 2 of {len(res['kinds'])}" in res["error"], res["error"]
        assert "injected failure" in res["error"] and 2 in res["ranks"], res
        assert res["elapsed"] < 4 * STALL_TIMEOUT_S + 5, res


def test_naive_sharding_with_shared_prefixes_stalls_and_is_reported(failures):
    steps = [len(out["naive_shared"]["kinds"]) for out in failures]
    assert len(set(steps)) > 1, f"the shared-prefix plan is even ({steps}): the stall would not be exercised"
    for rank, out in enumerate(failures):
        res = out["naive_shared"]
        assert res["error"] is not None, f"rank {rank}: naive sharding did not stall"
        assert "timed out" in res["error"].lower() or "no report" in res["error"].lower(), res["error"]
        assert STALL_TIMEOUT_S - 0.5 <= res["elapsed"] < 4 * STALL_TIMEOUT_S + 5, res


def test_naive_sharding_stalls_and_is_reported_not_hung(failures):
    """The hazard is real: with dense-DP sharding rank 3 runs one step fewer, its EP peers block
    in the expert all-to-all until the group timeout, and every rank gets the error."""
    for rank, out in enumerate(failures):
        res = out["naive"]
        assert res["error"] is not None, f"rank {rank}: naive sharding did not stall"
        assert "mmlu step 3 of 3" in res["error"] and "timed out" in res["error"].lower(), res["error"]
        assert sorted(res["ranks"]) == [0, 1, 2], res
        assert STALL_TIMEOUT_S - 0.5 <= res["elapsed"] < 4 * STALL_TIMEOUT_S + 5, res
