"""megatron-core ``GPTModel`` s on real gloo ranks: MMLU under megatron's own dispatchers, the
no-gather HF export, ``from_hf`` back, the Megatron-Bridge callback path and the megatron recipe.

Two spawns share the megatron imports (5-12 s per process) across every case:

* 4 ranks: a single-process-equivalent reference (EP=1, rank 0 evaluates alone, one question per
  forward: at EP=1 the dispatcher runs no collective); then EP=2: ``lockstep`` and ``expert_dp``
  under the ``alltoall`` dispatcher and ``lockstep`` under ``allgather`` (equal shapes needed), the
  export of a DeepSeek-V3-style model (MLA, dense first layer, shared expert, 6 experts: 3 per EP
  rank, a count that does not divide the 4 ranks; megatron-core refuses EP blocks of unequal size)
  and of a Qwen3-MoE-style model, ``from_hf`` into fresh EP=2 models, the Bridge callback path on
  real megatron ``DistributedDataParallel`` chunks, the packaged recipe (train, MMLU, export); last,
  ``naive`` with a short EP-group timeout (it breaks the EP group, so nothing runs after it).
* 2 ranks, EP=1: ``from_hf`` of both checkpoints into fresh models.

The CUDA-only calls are replaced by ``nemo_moe_export.megatron.cpu_patches`` (each named there with
the call it stands in for). Weights depend only on each tensor's global name (the tests' own
derivation, ``megatron_reference.fill_by_global_name``), so every EP size holds the same model.
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_reference import fill_by_global_name, hf_tensors
from bounds import FP32_LOGITS, FP32_SCORES, check_figure, judge_answers, judge_predictions, relative_error
from nemo_moe_export.spawn import spawn

EXPERTS = {"deepseek_v3": 6, "qwen3_moe": 4}
HIDDEN = 32
INPUT = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(5))
K_SHOT, BATCH = 1, 4
N_TEST = 11  # per subject: 44 questions, 11 batches: the naive split gives ranks [3, 3, 3, 2] batches
STALL_TIMEOUT_S = 5.0
# verify's transformers reload runs in the pytest process (test below): one interpreter fewer
RECIPE_QUICK = ["stages=[train,mmlu,export]", "trainer.max_steps=8", "trainer.progress=false", "mmlu.progress=false",
                "data.n_train=40", "data.n_test=6"]


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


def _model(family: str, vocab_size: int, seed: int = 0, dispatcher: str = "alltoall"):
    """A tiny megatron-core model of ``family`` on the current parallel_state, wrapped (after a
    barrier: the wrapper's all-gather over the EP group then starts on every rank at once, well
    within even the naive case's short group timeout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import MegatronCausalLM
    from nemo_moe_export.megatron.tiny import build_gpt, tiny_transformer_config

    config = tiny_transformer_config(family, n_experts=EXPERTS[family], hidden_size=HIDDEN, dispatcher=dispatcher)
    gpt = build_gpt(config, vocab_size=vocab_size)
    n_local = EXPERTS[family] // ps.get_expert_model_parallel_world_size()
    fill_by_global_name(gpt, ep_rank=ps.get_expert_model_parallel_rank(), n_local=n_local, seed=seed)
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.barrier()
    return MegatronCausalLM(gpt)


def _inputs(data_root: str):
    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.job.data import build_tokenizer

    questions = load_mmlu(data_root)
    return (build_tokenizer(data_root), [q for q in questions if q.split == "test"],
            [q for q in questions if q.split == "dev"])


def _evaluate(model, tok, test, dev, layout, policy: str, **kw) -> dict:
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    result = evaluate_mmlu(model, tok, test, dev, layout, k_shot=K_SHOT, tokens_per_batch=0, policy=policy,
                           progress=False, **{"timeout_s": 60, "batch_size": BATCH, **kw})
    return {"pred": result.predictions, "scores": [r["scores"] for r in result.records], "steps": result.steps,
            "uniform": result.scoring["uniform_shapes"], "layout": result.layout}


def _raw_state(model) -> dict:
    from megatron.core import parallel_state as ps

    state = {k: v.detach().clone() for k, v in model.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    return {"state": state, "ep_rank": ps.get_expert_model_parallel_rank(),
            "n_local": len(next(iter(model.config.in_memory_format.local_experts.values())).mine)}


def _reloads_exactly(model, path: str, family: str, vocab_size: int) -> dict:
    """``from_hf`` of ``path`` into a fresh model (other weights) reproduces ``model`` exactly."""
    from nemo_moe_export.adapters import get_adapter

    fresh = _model(family, vocab_size, seed=1)
    report = get_adapter(fresh.config).from_hf(fresh.state_dict(), path)
    want, got = model.gpt.state_dict(), fresh.gpt.state_dict()
    keys = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    return {"differ": [k for k in keys if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))],
            "compared": len(keys), "bytes_read": report.bytes_read}


def _bridge_path(model, tok, data_root: str, workdir: str) -> dict:
    """Bridge's events on real megatron DDP chunks: the hooks find, wrap, evaluate and export."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_moe_export.plugin import plugin_hooks
    from nemo_moe_export.integrations.megatron_bridge import BridgeEvents

    chunk = DistributedDataParallel(model.gpt.config, DistributedDataParallelConfig(), model.gpt)
    hooks = plugin_hooks(mmlu=dict(data_path=data_root, output_dir=os.path.join(workdir, "bridge_mmlu"),
                                   k_shot=K_SHOT, batch_size=BATCH, progress=False, plot=False, timeout_s=60),
                         export=dict(output_dir=os.path.join(workdir, "bridge_hf"), timeout_s=60))
    events = BridgeEvents(hooks, tokenizer=tok)
    context = SimpleNamespace(model=[chunk], state=SimpleNamespace(train_state=SimpleNamespace(step=1)),
                              loss_dict={"lm loss": torch.tensor(2.5)})
    events.on_train_start(context)
    events.on_train_step_end(context)
    events.on_train_end(context)
    results = events.ctx.results
    return {"wrapped": type(events.ctx.model).__name__, "pred": hooks.hooks[1].last_result.predictions,
            "export_bytes": results["export"].rank_bytes_written, "loss": results.get("train_loss")}


def _recipe(workdir: str) -> dict:
    """The packaged megatron-core recipe, every stage, in these ranks (it initialises parallel_state)."""
    from nemo_moe_export.job.compose import load_config
    from nemo_moe_export.job.stages import run_recipe

    cfg = load_config("megatron_deepseek_v3_tiny", [f"run_dir={workdir}/recipe", *RECIPE_QUICK])
    return run_recipe(cfg)


def _naive(tok, test, dev) -> dict:
    """EP=2 groups with a short timeout: an EP peer left alone in the all-to-all raises after it."""
    from megatron.core import parallel_state as ps

    from nemo_moe_export.parallel import PeerError, discover_layout

    ps.initialize_model_parallel(expert_model_parallel_size=2, distributed_timeout_minutes=STALL_TIMEOUT_S / 60)
    model = _model("deepseek_v3", len(tok))
    started = time.monotonic()
    try:
        _evaluate(model, tok, test, dev, discover_layout(), "naive", timeout_s=3 * STALL_TIMEOUT_S)
        return {"error": None, "elapsed": time.monotonic() - started}
    except PeerError as exc:
        return {"error": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - started}


def _four_rank_worker(rank: int, world: int, data_root: str, workdir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_moe_export.export import export_hf_checkpoint
    from nemo_moe_export.megatron import cpu_patches
    from nemo_moe_export.parallel import ParallelLayout, RankGroup, discover_layout

    cpu_patches.apply()
    tok, test, dev = _inputs(data_root)
    out: dict = {}
    ps.initialize_model_parallel(expert_model_parallel_size=1)
    if rank == 0:  # the single-process run: EP=1 runs no collective; rank 0 alone, nothing padded
        alone = RankGroup.alone()
        out["reference"] = _evaluate(_model("deepseek_v3", len(tok)), tok, test, dev,
                                     ParallelLayout(alone, alone, alone, "world"), "lockstep", batch_size=1)
    dist.barrier()
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    models = {family: _model(family, len(tok)) for family in EXPERTS}
    layout = discover_layout()
    for policy in ("lockstep", "expert_dp"):
        out[policy] = _evaluate(models["deepseek_v3"], tok, test, dev, layout, policy)
    # the allgather dispatcher gathers equal-shaped buffers: uniform shapes, detected from the model
    out["allgather"] = _evaluate(_model("deepseek_v3", len(tok), dispatcher="allgather"), tok, test, dev, layout,
                                 "lockstep")
    for family, model in models.items():
        path = os.path.join(workdir, family)
        with torch.no_grad():
            logits = model(input_ids=INPUT).logits
        result = export_hf_checkpoint(path, model, max_shard_size="16KB", timeout_s=60)
        out[family] = {"logits": logits, "result": result, **_raw_state(model),
                       "reload": _reloads_exactly(model, path, family, len(tok))}
    out["bridge"] = _bridge_path(models["deepseek_v3"], tok, data_root, workdir)
    ps.destroy_model_parallel()
    out["recipe"] = _recipe(workdir)
    ps.destroy_model_parallel()
    out["naive"] = _naive(tok, test, dev)
    return out


def _refusal(build) -> str | None:
    from nemo_moe_export.errors import InputError

    try:
        build()
    except InputError as exc:
        return str(exc)
    return None


def _two_rank_worker(rank: int, world: int, data_root: str, workdir: str) -> dict:
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import MegatronCausalLM, cpu_patches
    from nemo_moe_export.megatron.tiny import build_gpt, tiny_transformer_config

    cpu_patches.apply()
    tok, _, _ = _inputs(data_root)
    out = {"refused": [_refusal(lambda: MegatronCausalLM(None))]}  # before parallel_state exists
    ps.initialize_model_parallel(expert_model_parallel_size=1)
    eps = tiny_transformer_config("deepseek_v3", layernorm_epsilon=1e-5)  # HF's MLA norms use 1e-6
    out["refused"].append(_refusal(lambda: MegatronCausalLM(build_gpt(eps, vocab_size=len(tok)))))
    for family in EXPERTS:
        model = _model(family, len(tok))  # the same weights as the EP=2 model that was exported
        out[family] = _reloads_exactly(model, os.path.join(workdir, family), family, len(tok))
    return out


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from nemo_moe_export.job.data import write_synthetic_mmlu

    root = tmp_path_factory.mktemp("megatron")
    data_root, workdir = str(root / "data"), str(root / "out")
    os.makedirs(workdir)
    write_synthetic_mmlu(data_root, seed=0, n_train=4, n_dev=3, n_test=N_TEST)
    four = spawn(_four_rank_worker, 4, data_root, workdir, timeout_s=400)
    two = spawn(_two_rank_worker, 2, data_root, workdir, timeout_s=200)
    return {"four": four, "two": two, "workdir": workdir}


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_lockstep_expert_dp_and_allgather_match_the_single_process_run(runs):
    reference = runs["four"][0]["reference"]
    assert len(set(reference["pred"])) >= 2, "every question got the same answer: the comparison would be vacuous"
    for rank, out in enumerate(runs["four"]):
        for policy in ("lockstep", "expert_dp", "allgather"):
            got = out[policy]
            judge_answers(got, reference, f"rank {rank} {policy}")
            assert got["uniform"] is True  # detected: the model holds megatron-core modules
            assert got["layout"]["source"] == "megatron"
    assert runs["four"][0]["lockstep"]["steps"] == 3 and runs["four"][0]["expert_dp"]["steps"] == 6
    assert runs["four"][0]["reference"]["steps"] == 44  # one question per forward: nothing padded


def test_naive_split_stalls_in_megatrons_all_to_all_and_every_rank_reports_it(runs):
    """11 batches on 4 ranks: rank 2 runs a third forward its EP peer (rank 3) never joins, and is
    left in megatron's all-to-all until the EP group's timeout; every rank names it, in time."""
    for rank, out in enumerate(runs["four"]):
        res = out["naive"]
        assert res["error"] is not None, f"rank {rank}: the naive split did not stall"
        assert res["ranks"] == [2] and "mmlu step 3 of 3 (naive)" in res["error"], res
        assert STALL_TIMEOUT_S - 0.5 <= res["elapsed"] < 4 * STALL_TIMEOUT_S + 10, res


@pytest.mark.parametrize("family", sorted(EXPERTS))
def test_export_loads_in_transformers_matches_the_model_and_each_tensor(family, runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from checks import assert_serving_config

    from nemo_moe_export.export import verify_checkpoint

    path = os.path.join(runs["workdir"], family)
    per_rank = [out[family] for out in runs["four"]]
    results = [r["result"] for r in per_rank]
    assert sum(r.rank_bytes_written for r in results) == results[0].checkpoint_bytes  # each byte once
    assert results[0].files > 1 and verify_checkpoint(path).ok

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # The megatron-core door: config.json and dtypes as transformers writes the same weights.
    model.save_pretrained(tmp_path / "reference")
    assert_serving_config(path, str(tmp_path / "reference"))
    with torch.no_grad():
        hf_logits = model(INPUT).logits
    for rank, r in enumerate(per_rank):  # fp32 megatron vs transformers on the exported checkpoint
        check_figure(relative_error(hf_logits, r["logits"]), FP32_LOGITS, f"transformers vs rank {rank}")

    written = {k: v for f in glob.glob(os.path.join(path, "*.safetensors")) for k, v in load_file(f).items()}
    expected: dict[str, torch.Tensor] = {}
    for r in per_rank:  # every rank's tensors, converted key by key; replicas must agree
        for key, value in hf_tensors(r["state"], family=family, ep_rank=r["ep_rank"], n_local=r["n_local"],
                                     hidden=HIDDEN).items():
            assert key not in expected or torch.equal(expected[key], value), key
            expected[key] = value
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key


@pytest.mark.parametrize("family", sorted(EXPERTS))
def test_from_hf_reproduces_the_parameters_on_ep2_and_on_ep1(family, runs):
    for where, outs in (("EP=2 on 4 ranks", [o[family]["reload"] for o in runs["four"]]),
                        ("EP=1 on 2 ranks", [o[family] for o in runs["two"]])):
        for rank, reload in enumerate(outs):
            assert reload["compared"] > 10 and reload["differ"] == [], (where, rank, reload["differ"])
    ep2, ep1 = runs["four"][0][family]["reload"], runs["two"][0][family]
    assert ep2["bytes_read"] < ep1["bytes_read"], "an EP=2 rank should read only its own experts"


def test_models_the_wrapper_cannot_express_are_refused_by_name(runs):
    for out in runs["two"]:
        before, eps = out["refused"]
        assert before and "parallel_state is not initialised" in before
        assert eps and "megatron.layernorm_epsilon" in eps and "1e-05" in eps


def test_bridge_callback_wraps_the_chunk_evaluates_and_exports(runs):
    lockstep = runs["four"][0]["lockstep"]
    for rank, out in enumerate(runs["four"]):
        bridge = out["bridge"]
        assert bridge["wrapped"] == "MegatronCausalLM"
        judge_predictions(lockstep["scores"], bridge["pred"], FP32_SCORES, f"Bridge callback rank {rank}")
        assert bridge["loss"] == [[1, 2.5]]
    bridge_dir, direct_dir = (os.path.join(runs["workdir"], d) for d in ("bridge_hf", "deepseek_v3"))
    load = lambda d: {k: v for f in glob.glob(os.path.join(d, "*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    bridge, direct = load(bridge_dir), load(direct_dir)
    assert set(bridge) == set(direct) and all(torch.equal(bridge[k], direct[k]) for k in direct)


def test_the_megatron_recipe_trains_evaluates_exports_and_reloads_the_same_answers(runs, tmp_path):
    """train -> MMLU (megatron's all-to-all, EP=2 x DP=2) -> export, then the recipe's own reload
    with transformers: the checkpoint answers every question as the trained megatron-core model did."""
    from nemo_moe_export.job import reload

    results = runs["four"][0]["recipe"]
    assert results["train"]["steps"] == 8 and results["train"]["last_loss"] < results["train"]["first_loss"]
    run_dir = os.path.join(runs["workdir"], "recipe")
    assert os.path.exists(os.path.join(run_dir, "checkpoint", "metadata.json"))  # megatron's dist_checkpointing
    options = tmp_path / "options.json"  # the run's own mmlu group, as the recipe's verify stage hands it over
    options.write_text(json.dumps(json.loads(open(os.path.join(run_dir, "config.json")).read())["mmlu"]))
    assert reload.main([os.path.join(run_dir, "hf"), os.path.join(run_dir, "data"), str(tmp_path / "r.json"),
                        "--options", str(options)]) == 0
    reloaded = json.loads((tmp_path / "r.json").read_text())
    judge_answers({"scores": reloaded["scores"]}, {"scores": results["mmlu_scores"]}, "transformers reload")
    if reloaded["predictions"] == results["mmlu_predictions"]:  # the accuracy follows the answers
        assert reloaded["overall"]["acc"] == results["mmlu"]["overall"]["acc"]
