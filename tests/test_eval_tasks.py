"""Evaluation tasks as data: ARC-Challenge from YAML alone, cross-checked with lm-evaluation-harness.

Everything is built offline: an ARC-Challenge-shaped fixture in the allenai/ai2_arc layout
(``question``, ``choices {text, label}``, ``answerKey``; 3 to 5 choices, labels A-E or 1-5 as real
ARC has; a few questions whose choices are single words, so the single-token path runs with 3 and 5
choices too), the byte-level BPE tokenizer and the tiny DeepSeek-V3 of ``test_mmlu_eval``.

The reference is lm-evaluation-harness 0.4.13 itself: its own ``arc_challenge`` task config
(``lm_eval/tasks/arc/arc_easy.yaml`` + ``arc_challenge.yaml``), the dataset pointed at the fixture
(``dataset_path: json``), through ``lm_eval.evaluator.evaluate`` with an ``HFLM`` wrapping the same
model instance and tokenizer (batch size 1: nothing padded). Per question the requests must be
equal, the loglikelihoods within ``bounds.FP32_SCORES`` (fp32 on CPU, batched and padded here) and ``acc``
and ``acc_norm`` exactly equal; the aggregates too. Then ARC runs on 2 gloo ranks under EP=2 (the
layout of ``test_mmlu_eval``) with the answers of one process.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import yaml

from bounds import FP32_SCORES, check_close, judge_choices
from nemo_moe_export.errors import InputError
from nemo_moe_export.spawn import spawn
from test_mmlu_eval import WORDS, build_model, build_tokenizer

N_TEST = 64
BATCH = 4
ARC = {"task": "arc_challenge", "k_shot": 0}
LM_EVAL_TASKS = Path(__import__("lm_eval").__file__).parent / "tasks"


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


# units, non-ASCII ones among them, as real ARC has ("°C", "µm"): acc_norm divides by characters,
# not bytes, and on choices this short the two disagree
UNITS = ("°C", "°F", "K", "µm", "mm", "ΔT", "Å", "nm", "naïve", "Ångström")


def arc_record(rng: random.Random, i: int, n_choices: int, single_words: bool = False, units: bool = False) -> dict:
    labels = list("12345"[:n_choices]) if rng.random() < 0.3 else list("ABCDE"[:n_choices])
    texts = (rng.sample(WORDS, n_choices) if single_words else rng.sample(UNITS, n_choices) if units
             else [_sentence(rng, 1, 6) for _ in range(n_choices)])
    return {"id": f"Mercury_{i:05d}", "question": _sentence(rng, 3, 20) + "?",
            "choices": {"text": texts, "label": labels}, "answerKey": rng.choice(labels)}


def write_arc(root: Path, seed: int = 0) -> Path:
    """``{train,validation,test}.jsonl``, as the hub's ARC-Challenge folder has (lm-eval needs all three);
    every 8th test question has single-word choices (5 or 3: the single-token path), every 3rd
    short units as choices."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 4), ("validation", 4), ("test", N_TEST)):
        records = [arc_record(rng, i, 5, single_words=True) if split == "test" and i % 16 == 0 else
                   arc_record(rng, i, 3, single_words=True) if split == "test" and i % 16 == 8 else
                   arc_record(rng, i, 4, units=True) if split == "test" and i % 3 == 2 else
                   arc_record(rng, i, rng.choice((3, 4, 4, 4, 5))) for i in range(n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arc")
    data = write_arc(root / "ARC-Challenge")
    build_tokenizer().save_pretrained(str(root / "tok"))
    return {"root": root, "data": str(data), "tok": str(root / "tok")}


@pytest.fixture(scope="module")
def model():
    return build_model().eval()


@pytest.fixture(scope="module")
def ours(inputs, model):
    """ARC through the callback from its options alone, one process, batches of 4 (padded)."""
    from nemo_moe_export.evaluate.callback import MMLUCallback

    callback = MMLUCallback(inputs["data"], dict(ARC), output_dir=inputs["root"] / "out", progress=False,
                            batch_size=BATCH, tokens_per_batch=0)
    metrics = callback.evaluate(model, build_tokenizer())
    return {"metrics": metrics, "result": callback.last_result, "callback": callback, "out": inputs["root"] / "out"}


def judge_acc_and_norm(reference: list[list[float]], got: list[list[float]], choices: list[list[str]],
                       what: str) -> bool:
    """Two fp32 evaluations of the same questions: log-likelihoods within the bound, and the same
    acc and acc_norm choice wherever the reference decides it beyond the bound (acc_norm divides by
    the choice's length in characters, which only narrows a difference). Returns whether every
    choice agrees, when the aggregates must be equal too."""
    check_close(got, reference, FP32_SCORES, what)
    per_char = [[[s / len(c) for s, c in zip(row, cs)] for row, cs in zip(scores, choices)] for scores in (reference, got)]
    judge_choices(reference, got, FP32_SCORES, f"{what} (acc)")
    judge_choices(*per_char, FP32_SCORES, f"{what} (acc_norm)")
    argmax = [[max(range(len(r)), key=lambda i: (r[i], -i)) for r in rows] for rows in (reference, got, *per_char)]
    return argmax[0] == argmax[1] and argmax[2] == argmax[3]


def _choices(callback) -> list[list[str]]:
    return [q.choices for q in callback._prepared[1].questions]


def lm_eval_arc_config(data_dir: str) -> dict:
    """lm-eval's own arc_challenge config (arc_easy.yaml + the two keys arc_challenge.yaml changes),
    the dataset read from the fixture's files instead of the hub."""
    config = yaml.safe_load((LM_EVAL_TASKS / "arc" / "arc_easy.yaml").read_text())
    challenge = yaml.safe_load((LM_EVAL_TASKS / "arc" / "arc_challenge.yaml").read_text())
    assert challenge.pop("include") == "arc_easy.yaml" and set(challenge) == {"task", "dataset_name"}
    config |= challenge
    config.pop("tag")
    return config | {"dataset_path": "json", "dataset_name": None,
                     "dataset_kwargs": {"data_files": {s: f"{data_dir}/{s}.jsonl" for s in ("train", "validation",
                                                                                              "test")}}}


@pytest.fixture(scope="module")
def lm_eval_samples(inputs, model):
    """lm_eval.evaluator.evaluate on the same model instance and tokenizer: per-sample results."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    lm = HFLM(pretrained=model, tokenizer=build_tokenizer(), backend="causal", device="cpu", batch_size=1)
    tasks = get_task_dict([lm_eval_arc_config(inputs["data"])], TaskManager())
    out = evaluator.evaluate(lm, tasks, log_samples=True, bootstrap_iters=0, verbosity="WARNING")
    return {"samples": sorted(out["samples"]["arc_challenge"], key=lambda s: s["doc_id"]),
            "results": out["results"]["arc_challenge"]}


# --------------------------------------------------------------------------------------------------
# The definitions are lm-eval's
# --------------------------------------------------------------------------------------------------


def test_packaged_arc_definition_is_lm_evals():
    from nemo_moe_export.evaluate.task import load_task

    lm_eval = lm_eval_arc_config("unused")
    task = load_task("arc_challenge")
    assert (task.name, task.doc_to_text, task.doc_to_choice, task.doc_to_target) == (
        lm_eval["task"], lm_eval["doc_to_text"], lm_eval["doc_to_choice"], lm_eval["doc_to_target"])
    assert task.metrics == tuple(m["metric"] for m in lm_eval["metric_list"]) == ("acc", "acc_norm")
    assert task.splits == {"train": lm_eval["training_split"], "validation": lm_eval["validation_split"],
                           "test": lm_eval["test_split"]}
    assert (task.target_delimiter, task.fewshot_delimiter, task.description) == (" ", "\n\n", "")
    assert "fewshot_config" not in lm_eval and task.fewshot_sampler == "default"  # lm-eval's random draw


def test_packaged_mmlu_definition_is_lm_evals():
    """tasks/mmlu.yaml against lm-eval's _default_template_yaml and its 57 per-subject files."""
    from nemo_moe_export.evaluate.data import SUBJECT_CATEGORIES
    from nemo_moe_export.evaluate.task import load_task

    folder = LM_EVAL_TASKS / "mmlu" / "default"
    template = yaml.safe_load((folder / "_default_template_yaml").read_text())
    task = load_task("mmlu")
    assert (task.doc_to_text, list(task.doc_to_choice), task.doc_to_target) == (
        template["doc_to_text"], template["doc_to_choice"], template["doc_to_target"])
    assert (task.fewshot_split, task.fewshot_sampler) == (template["fewshot_split"],
                                                        template["fewshot_config"]["sampler"])
    assert task.metrics == tuple(m["metric"] for m in template["metric_list"])
    subjects = {}
    for path in sorted(folder.glob("mmlu_*.yaml")):
        config = yaml.safe_load(path.read_text())
        subject = config["dataset_name"]
        subjects[subject] = config["tag"].removeprefix("mmlu_").removesuffix("_tasks")
        assert task.describe({"subject": subject}) == config["description"], subject
    assert len(subjects) == 57 and subjects == SUBJECT_CATEGORIES
    assert {s: task.category_of(s) for s in subjects} == subjects and task.category_of("toy") == "other"


# --------------------------------------------------------------------------------------------------
# Question by question against lm-evaluation-harness
# --------------------------------------------------------------------------------------------------


def test_requests_equal_lm_evals(ours, lm_eval_samples):
    """The context and continuations of every loglikelihood request, character for character."""
    from nemo_moe_export.evaluate.task import load_task

    task = load_task("arc_challenge")
    questions = ours["result"].records
    prepared = ours["callback"]._prepared[1]
    assert len(lm_eval_samples["samples"]) == len(questions) == N_TEST
    for sample, q in zip(lm_eval_samples["samples"], prepared.questions):
        assert sample["doc_id"] == q.index and sample["doc"]["id"] == q.doc["id"]
        want = [tuple(a) for a in sample["arguments"]]
        assert [(task.context(q, []), c) for c in task.continuations(q)] == want
        assert sample["target"] == q.answer


def test_loglikelihoods_acc_and_acc_norm_equal_lm_evals(ours, lm_eval_samples):
    records = ours["result"].records
    lls = [[float(ll) for ll, _ in sample["filtered_resps"]] for sample in lm_eval_samples["samples"]]
    agree = judge_acc_and_norm(lls, [r["scores"] for r in records], _choices(ours["callback"]), "ours vs lm-eval")
    for sample, record, want in zip(lm_eval_samples["samples"], records, lls):  # lm-eval's own verdicts
        decided = sorted(want)[-1] - sorted(want)[-2] > 2 * FP32_SCORES.value
        if decided or agree:
            assert sample["acc"] == float(record["correct"]), (sample["doc_id"], want, record)
    overall = ours["result"].metrics["overall"]
    if agree:
        assert overall["acc"] == lm_eval_samples["results"]["acc,none"]
        assert overall["acc_norm"] == lm_eval_samples["results"]["acc_norm,none"]
    assert ours["metrics"]["arc_challenge/acc"] == overall["acc"]
    assert ours["metrics"]["arc_challenge/acc_norm"] == overall["acc_norm"]


def test_the_comparison_can_fail(ours, lm_eval_samples):
    """Varied predictions, acc and acc_norm disagreeing on some questions, both scoring paths used,
    3 to 5 choices and numeric labels, and choices on which dividing by bytes instead of characters
    changes acc_norm: a wrong definition would show."""
    from nemo_moe_export.evaluate.scoring import predict

    result = ours["result"]
    records = result.records
    assert len({r["scores"].index(max(r["scores"])) for r in records}) >= 3
    assert len({r["pred"] for r in records}) >= 10
    assert any(r["correct"] != r["correct_norm"] for r in records)
    assert 0 < result.metrics["overall"]["correct"] < N_TEST and 0 < result.metrics["overall"]["correct_norm"] < N_TEST
    assert result.scoring["single_token_questions"] > 0 and result.scoring["full_questions"] > 0
    prepared = ours["callback"]._prepared[1]
    assert {len(q.choices) for q in prepared.questions} == {3, 4, 5}
    assert any(q.doc["choices"]["label"][0] == "1" for q in prepared.questions)
    assert any(len(c) != len(c.encode()) for q in prepared.questions for c in q.choices)
    by_bytes = [predict([ll / len(c.encode()) for ll, c in zip(r["scores"], q.choices)]) == q.answer
                for q, r in zip(prepared.questions, records)]
    assert any(float(b) != sample["acc_norm"] for b, sample in zip(by_bytes, lm_eval_samples["samples"]))
    assert {len(r.choices) for r in prepared.rows if len(r.choices) > 1} == {3, 5}, "single-token rows of 3, 5 choices"


def test_outputs_name_the_task(ours):
    out = ours["out"]
    assert sorted(p.name for p in out.iterdir()) == ["arc_challenge_categories.png", "arc_challenge_history.png",
                                                    "arc_challenge_results.json", "arc_challenge_results.md"]
    payload = json.loads((out / "arc_challenge_results.json").read_text())
    assert payload["task"] == "arc_challenge" and payload["k_shot"] == 0
    assert payload["results"] == ours["result"].metrics and len(payload["predictions"]) == N_TEST
    markdown = (out / "arc_challenge_results.md").read_text()
    overall = ours["result"].metrics["overall"]
    assert markdown.startswith("## ARC-Challenge (0-shot)")
    assert (f"| **arc_challenge** | {100 * overall['acc']:.2f} | {100 * overall['acc_norm']:.2f} | "
            f"{overall['correct']} | {N_TEST} |") in markdown
    assert "MMLU" not in markdown
    assert set(ours["metrics"]) == {"arc_challenge/acc", "arc_challenge/acc_norm", "arc_challenge/questions_per_s",
                                    "arc_challenge/padding_waste"}
    for chart in ("arc_challenge_categories.png", "arc_challenge_history.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_task_selected_from_the_recipe_config_alone(inputs, ours, model):
    """``mmlu.task=arc_challenge mmlu.k_shot=0 mmlu.data_path=...``: the recipe's Hydra group."""
    from omegaconf import OmegaConf

    from nemo_moe_export.config import MMLUConfig
    from nemo_moe_export.evaluate.callback import MMLUCallback

    node = OmegaConf.merge(OmegaConf.structured(MMLUConfig),
                           OmegaConf.from_dotlist(["task=arc_challenge", "k_shot=0", f"data_path={inputs['data']}",
                                                   "progress=false", "plot=false", "tokens_per_batch=0"]))
    callback = MMLUCallback(node.data_path, node, output_dir=inputs["root"] / "from_config")
    callback.evaluate(model, build_tokenizer())
    judge_acc_and_norm([r["scores"] for r in ours["result"].records],
                       [r["scores"] for r in callback.last_result.records], _choices(ours["callback"]),
                       "from the recipe config vs the callback's options")


# --------------------------------------------------------------------------------------------------
# Distributed: the same answers on 2 ranks under EP=2
# --------------------------------------------------------------------------------------------------


def _distributed_worker(rank: int, world: int, data_dir: str, tok_dir: str, out_dir: str) -> dict:
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.parallel import init_expert_parallel

    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    layout = init_expert_parallel(2, timeout_s=60)
    model = apply_expert_parallel(build_model(), layout)
    out = {}
    modes = (("lockstep", dict(tokens_per_batch=0)), ("expert_dp", dict(tokens_per_batch=0, policy="expert_dp")),
             ("default", {}))  # the default: batches sized by tokens, shared prefixes where found
    for label, kw in modes:
        callback = MMLUCallback(data_dir, dict(ARC), output_dir=f"{out_dir}/{label}", progress=False,
                                batch_size=BATCH, timeout_s=60, **kw)
        callback.evaluate(model, tok, layout)
        result = callback.last_result
        out[label] = {"pred": result.predictions, "scores": [r["scores"] for r in result.records],
                      "norm": [r["pred_norm"] for r in result.records], "layout": result.layout,
                      "steps": result.steps}
    return out


@pytest.fixture(scope="module")
def distributed(inputs):
    return spawn(_distributed_worker, 2, inputs["data"], inputs["tok"], str(inputs["root"] / "dist"), timeout_s=240)


def test_distributed_answers_equal_one_process(distributed, ours):
    want = [r["scores"] for r in ours["result"].records]
    for rank, results in enumerate(distributed):
        for label, got in results.items():
            where = f"rank {rank}, {label}"
            judge_acc_and_norm(want, got["scores"], _choices(ours["callback"]), where)
            assert got["layout"]["ep"]["size"] == 2 and got["layout"]["dp"]["size"] == 2, where
        assert results["lockstep"]["steps"] < results["expert_dp"]["steps"], "lockstep splits over both ranks"


# --------------------------------------------------------------------------------------------------
# Bad tasks are clear errors
# --------------------------------------------------------------------------------------------------


def test_unknown_task_and_unsupported_few_shot_are_refused():
    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.evaluate.options import MMLUOptions

    with pytest.raises(InputError, match=r"unknown evaluation task .*'arc_challenge', 'mmlu'.*got 'arc'") as e:
        MMLUOptions(task="arc")
    assert e.value.key == "task"
    with pytest.raises(InputError, match="cannot run 5-shot.*set k_shot=0") as e:
        MMLUOptions(task="arc_challenge")  # the default k_shot=5: lm-eval's random sampler is not reproduced
    assert (e.value.key, e.value.expected, e.value.actual) == ("k_shot", "0", 5)
    with pytest.raises(InputError, match="cannot run 1-shot"):
        MMLUCallback("unused", {"task": "arc_challenge", "k_shot": 1})
    with pytest.raises(InputError, match="cannot run 2-shot"):
        from nemo_moe_export.evaluate.prepare import prepare_questions

        prepare_questions(build_tokenizer(), [], [], k_shot=2, task="arc_challenge")


def _arc_yaml(**changes) -> dict:
    config = yaml.safe_load((Path(__file__).parent.parent / "nemo_moe_export" / "evaluate" / "tasks"
                             / "arc_challenge.yaml").read_text())
    config |= changes
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change,key,match", [
    (dict(doc_to_text=None), "doc_to_text", "present"),
    (dict(doc_to_choice=None), "doc_to_choice", "present"),
    (dict(output_type="generate_until"), "output_type", "multiple_choice"),
    (dict(metric_list=[{"metric": "f1", "aggregation": "mean"}]), "metric_list", "acc"),
    (dict(metric_list=[{"metric": "acc", "aggregation": "median"}]), "metric_list", "aggregation: mean"),
    (dict(doc_to_text="Question: {{question}\nAnswer:"), "doc_to_text", "Jinja2 template"),
    (dict(include="arc_easy.yaml"), "include", "only the keys"),
    (dict(dataset_format="csv"), "dataset_format", "records"),
    (dict(categories=["a", "b"]), "categories", "category -> list of groups"),
])
def test_bad_task_yaml_is_a_clear_error(tmp_path, change, key, match):
    from nemo_moe_export.evaluate.task import load_task

    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(_arc_yaml(**change)))
    with pytest.raises(InputError, match=match) as e:
        load_task(str(path))
    assert e.value.key == key and str(path) in str(e.value)


def test_unreadable_task_files_are_clear_errors(tmp_path):
    from nemo_moe_export.evaluate.task import load_task

    with pytest.raises(InputError, match="cannot read task file.*missing.yaml"):
        load_task(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(InputError, match="a mapping of lm-eval task keys"):
        load_task(str(tmp_path / "list.yaml"))
    (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_task(str(tmp_path / "broken.yaml"))


@pytest.mark.parametrize("record,match", [
    ({"answerKey": "F"}, r"doc_to_target cannot be rendered.*ValueError"),  # not among the labels
    ({"question": None}, r"doc_to_text cannot be rendered.*UndefinedError"),  # the field is missing
    ({"choices": {"label": ["A", "B"], "text": ["x", ""]}}, "non-empty strings"),
    ({"choices": {"label": ["A", "B"]}}, r"doc_to_choice cannot be rendered.*UndefinedError"),
])
def test_bad_documents_are_refused_naming_file_and_line(tmp_path, record, match):
    from nemo_moe_export.evaluate.task import load_questions

    rng = random.Random(1)
    good = [arc_record(rng, i, 4) for i in range(3)]
    bad = arc_record(rng, 3, 2) | {"choices": {"label": ["A", "B"], "text": ["x", "y"]}, "answerKey": "A"} | record
    if record.get("question", "") is None:
        del bad["question"]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*good, bad]))
    with pytest.raises(InputError, match=match) as e:
        load_questions("arc_challenge", tmp_path, splits=["test"])
    assert f"{tmp_path / 'test.jsonl'} line 4" in str(e.value)


def test_missing_split_names_the_files_looked_for(tmp_path):
    from nemo_moe_export.evaluate.task import load_questions

    (tmp_path / "train.jsonl").write_text(json.dumps(arc_record(random.Random(0), 0, 4)) + "\n")
    with pytest.raises(InputError, match=r"arc_challenge test split not found.*test.jsonl or test-\*.parquet"):
        load_questions("arc_challenge", tmp_path, splits=["test"])


# --------------------------------------------------------------------------------------------------
# A user's own task: a YAML file by path, with first_n few-shot examples
# --------------------------------------------------------------------------------------------------


def test_user_task_yaml_by_path_with_first_n_shots_equals_lm_eval(inputs, model, tmp_path):
    """A task file of one's own (ARC's fields, few-shot from the validation split with ``first_n``):
    2-shot prompts and answers equal lm-eval's for the same config."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager, get_task_dict

    from nemo_moe_export.evaluate.callback import MMLUCallback

    own = _arc_yaml(task="arc_first_n", title="ARC (first_n)", fewshot_split="validation",
                    fewshot_config={"sampler": "first_n"})
    path = tmp_path / "arc_first_n.yaml"
    path.write_text(yaml.safe_dump(own))
    callback = MMLUCallback(inputs["data"], {"task": str(path), "k_shot": 2}, output_dir=tmp_path / "out",
                            progress=False, plot=False, batch_size=BATCH, tokens_per_batch=0)
    metrics = callback.evaluate(model, build_tokenizer())
    assert set(metrics) >= {"arc_first_n/acc", "arc_first_n/acc_norm"}
    assert (tmp_path / "out" / "arc_first_n_results.md").read_text().startswith("## ARC (first_n) (2-shot)")

    config = lm_eval_arc_config(inputs["data"]) | {"task": "arc_first_n", "fewshot_split": "validation",
                                                   "fewshot_config": {"sampler": "first_n"}, "num_fewshot": 2}
    lm = HFLM(pretrained=model, tokenizer=build_tokenizer(), backend="causal", device="cpu", batch_size=1)
    out = evaluator.evaluate(lm, get_task_dict([config], TaskManager()), log_samples=True, bootstrap_iters=0,
                             verbosity="WARNING")
    samples = sorted(out["samples"]["arc_first_n"], key=lambda s: s["doc_id"])
    task = callback.task
    prepared = callback._prepared[1]
    dev = callback._data[0]
    assert [q.index for q in dev] == [0, 1, 2, 3] and all(q.split == "validation" for q in dev)
    for sample, q in zip(samples, prepared.questions, strict=True):
        assert sample["arguments"][0][0] == task.context(q, dev[:2])
    judge_acc_and_norm([[float(ll) for ll, _ in sample["filtered_resps"]] for sample in samples],
                       [r["scores"] for r in callback.last_result.records], [q.choices for q in prepared.questions],
                       "first_n 2-shot: ours vs lm-eval")
