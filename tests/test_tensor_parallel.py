"""torch tensor parallelism (``parallelize_tp``) and context-parallel meshes on 4 real gloo ranks:
export, load, MMLU and FP8 export (docs/design.md#tensor-and-context-parallelism-torch-tp).

One spawn of 4 ranks runs every case:

* ``tp_fsdp`` for DeepSeek-V3 (MLA, ``q_lora_rank`` set, dense layer 0 of width 384) and Qwen3-MoE
  (GQA, per-head q/k norms): mesh ("dp", "tp") = (2, 2), ``parallelize_tp(model, mesh["tp"])`` then
  ``fully_shard`` over ``mesh["dp"]`` as torchtitan does. Logits and one backward's gradients
  against the unsharded model; ``export_hf_checkpoint`` (checked here against ``save_pretrained``
  of the unsharded model, tensor for tensor); ``from_hf`` into a freshly initialised TP x FSDP2
  model (every local shard equal to the original's); MMLU predictions against a single-process run
  of the unsharded model, with TP peers on the same batches and only "dp" splitting them.
* FP8 under TP2 (DeepSeek-V3): column-parallel ``gate_proj`` / ``up_proj`` [384, 64] split at row
  192 (inside block row 1) and row-parallel ``down_proj`` [64, 384] split at column 192, then FSDP
  rows; both scale formats, byte-equal to ``test_fp8_export.reference_fp8`` of the unsharded weights.
* ``cp``: mesh ("dp", "cp") = (2, 2), ``fully_shard`` over "dp" only, so every weight has a copy on
  each CP rank: the export compares those copies and writes shared; MMLU runs lockstep over "cp".
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from bounds import FP32_GRADS, FP32_LOGITS, check_figure, judge_answers, relative_error
from nemo_moe_export.spawn import spawn
from test_fp8_export import FP8_RULE, reference_fp8
from test_mmlu_eval import BATCH, K_SHOT, ForwardCounter, _plan, load_split_data, write_mmlu_inputs
from checks import assert_serving_config, stored_tensors

WORLD = 4
SUBJECTS = {"abstract_algebra": 5, "philosophy": 5, "sociology": 6, "virology": 4}  # 20 questions, 5 batches
# initializer_range 0.5: answers depend on the question (see test_mmlu_eval). Hidden 64: 8 heads.
MODEL_KW = dict(n_experts=4, num_layers=2, hidden_size=64, vocab_size=416, initializer_range=0.5)
FAMILY_KW = {"deepseek_v3": dict(q_lora_rank=16, intermediate_size=384), "qwen3_moe": {}}
MMLU_OPTS = dict(k_shot=K_SHOT, batch_size=BATCH, tokens_per_batch=0, progress=False)  # shared_prefix: default
# TP splits the row-parallel layers' fp32 sums in two; how those round depends on the CPU's GEMM
# kernels (measured 5.5e-7 for DeepSeek-V3 and 1.3e-6 for Qwen3-MoE of the largest |logit| on an
# AMD EPYC with AVX-512): bounds.FP32_LOGITS and FP32_GRADS, relative like the figures below.
SCALE_FMTS = (None, "ue8m0")


def build_model(family: str, seed: int = 0):
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model(family, seed=seed, **MODEL_KW, **FAMILY_KW[family])
    for name, buf in model.named_buffers():  # token-dependent routing, as test_mmlu_eval does
        if name.endswith("e_score_correction_bias"):
            buf.mul_(0.05)
    return model


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


def _sharded(family: str, dims: tuple[str, str], seed: int = 0):
    """The test model on a (2, 2) mesh: TP over the second dim when it is "tp", FSDP2 over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_moe_export.job.tensor_parallel import parallelize_tp_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    return parallelize_tp_fsdp(build_model(family, seed), mesh), mesh


def _batch(rows: int = 3, length: int = 9):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, MODEL_KW["vocab_size"], (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[-1, length // 2:] = 0
    return ids, mask, torch.randint(0, MODEL_KW["vocab_size"], (rows, length), generator=gen)


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _forward_errors(family: str, model) -> dict[str, float]:
    """Logits and, after one backward of the same batch on every rank (FSDP averages equal
    gradients), every gradient against the unsharded model's."""
    from torch.distributed.tensor import DTensor

    reference = build_model(family)
    ids, mask, labels = _batch()
    logits = model(input_ids=ids, attention_mask=mask).logits
    want = reference(input_ids=ids, attention_mask=mask).logits
    _loss(logits, labels).backward()
    _loss(want, labels).backward()
    grads = dict(reference.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        errors[name] = relative_error(grad, grads[name].grad)
    model.zero_grad(set_to_none=True)
    worst = max(errors, key=errors.get)
    return {"logits": relative_error(logits, want), "grad": errors[worst], "worst": worst}


def _placements(model) -> dict[str, str]:
    return {name: f"{tuple(p.device_mesh.mesh_dim_names)} {p.placements}" for name, p in model.named_parameters()}


def _mmlu(model, tok, test, dev, layout) -> dict:
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    counter = ForwardCounter(model)
    result = evaluate_mmlu(model, tok, test, dev, layout, policy="lockstep", timeout_s=60, **MMLU_OPTS)
    plan, batches = _plan(tok, test, dev, layout, "lockstep", tokens_per_batch=0)
    return {"batches": len(batches), "pred": result.predictions, "scores": [r["scores"] for r in result.records],
            "steps": result.steps, "forwards": counter.count, "layout": result.layout, "plan": list(plan.batch_of_step),
            "scoring": result.scoring}


def _export(model, path: str, **options) -> dict:
    from nemo_moe_export.export import export_hf_checkpoint

    result = export_hf_checkpoint(path, model, max_shard_size="64KB", timeout_s=60, **options)
    return {"bytes": result.rank_bytes_written, "total": result.checkpoint_bytes,
            "replica_check": dict(result.replica_check), "io": dict(result.io)}


def _reload_mismatches(family: str, dims: tuple[str, str], path: str, original) -> list[str]:
    """``from_hf`` into a freshly initialised model sharded the same way (seed 1): each rank's
    local shard of every parameter and buffer must equal the original model's."""
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.adapters import get_adapter

    loaded, _ = _sharded(family, dims, seed=1)
    get_adapter(loaded.config).from_hf(loaded.state_dict(), path)
    want = original.state_dict()
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    return [k for k, v in loaded.state_dict().items() if not torch.equal(local(v), local(want[k]))]


def _tp_case(family: str, out_dir: str, tok, test, dev) -> dict:
    from nemo_moe_export.parallel import discover_layout

    model, mesh = _sharded(family, ("dp", "tp"))
    layout = discover_layout(mesh)
    out = {"forward": _forward_errors(family, model), "placements": _placements(model)}
    model.eval()
    path = os.path.join(out_dir, f"tp-{family}")
    out["export"] = _export(model, path)
    out["reload"] = _reload_mismatches(family, ("dp", "tp"), path, model)
    if family == "deepseek_v3":
        for fmt in SCALE_FMTS:
            out[f"fp8-{fmt}"] = _export(model, os.path.join(out_dir, f"tp-fp8-{fmt}"), quantize="fp8_block",
                                        scale_fmt=fmt)
    with torch.no_grad():
        out["mmlu"] = _mmlu(model, tok, test, dev, layout)
    return out


def _cp_case(out_dir: str, tok, test, dev) -> dict:
    from nemo_moe_export.parallel import discover_layout

    from nemo_moe_export.placement import unsplit_model_parallel_dims

    model, mesh = _sharded("deepseek_v3", ("dp", "cp"))
    model.eval()
    layout = discover_layout(mesh)
    out = {"export": _export(model, os.path.join(out_dir, "cp-deepseek_v3"))}
    # A mesh that flattens "cp" into the FSDP dim (torchtitan's dp_shard_cp) splits the weights over
    # the CP ranks: no CP copies there; "dp" alone leaves the CP dim (root dim 1) to copies.
    flat = mesh["dp", "cp"]._flatten("dp_shard_cp")
    out["unsplit_dims"] = {"dp": [dim for _, dim in unsplit_model_parallel_dims(mesh["dp"])],
                           "dp_shard_cp": [dim for _, dim in unsplit_model_parallel_dims(flat)]}
    with torch.no_grad():
        out["mmlu"] = _mmlu(model, tok, test, dev, layout)
    return out


def _worker(rank: int, world: int, data_dir: str, tok_dir: str, out_dir: str) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    test, dev = load_split_data(data_dir)
    out, seconds = {}, {}
    for name, run in (("tp-deepseek_v3", lambda: _tp_case("deepseek_v3", out_dir, tok, test, dev)),
                      ("tp-qwen3_moe", lambda: _tp_case("qwen3_moe", out_dir, tok, test, dev)),
                      ("cp-deepseek_v3", lambda: _cp_case(out_dir, tok, test, dev))):
        started = time.monotonic()
        out[name] = run()
        seconds[name] = round(time.monotonic() - started, 2)
    out["seconds"] = seconds
    return out


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor-parallel")
    return write_mmlu_inputs(root, SUBJECTS) | {"out": str(root / "out")}


@pytest.fixture(scope="module")
def ranks(inputs):
    os.makedirs(inputs["out"])
    return spawn(_worker, WORLD, inputs["data"], inputs["tok"], inputs["out"], timeout_s=300)


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """``save_pretrained`` of each unsharded model, by family: the references the exports must equal."""
    out = {}
    for family in FAMILY_KW:
        out[family] = str(tmp_path_factory.mktemp(f"saved-{family}"))
        build_model(family).save_pretrained(out[family])
    return out


@pytest.fixture(scope="module")
def saved(saved_dirs):
    return {family: stored_tensors(path) for family, path in saved_dirs.items()}


@pytest.fixture(scope="module")
def reference(inputs):
    """MMLU of each unsharded model in this process (no torch.distributed), batch size 1, full prompts."""
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    test, dev = load_split_data(inputs["data"])
    tok = PreTrainedTokenizerFast.from_pretrained(inputs["tok"])
    out = {}
    for family in FAMILY_KW:
        with torch.no_grad():
            result = evaluate_mmlu(build_model(family).eval(), tok, test, dev,
                                   **(MMLU_OPTS | {"batch_size": 1, "shared_prefix": False}))
        out[family] = {"pred": result.predictions, "scores": [r["scores"] for r in result.records]}
    return out


def _assert_equal_tensors(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: keys differ: {sorted(set(got) ^ set(want))}"
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, f"{where}: {key}"
        assert torch.equal(got[key].contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), \
            f"{where}: {key} differs"


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_plan_reads_the_config_and_adds_mla_attention():
    """What each layer gets: the config's colwise / rowwise layers outside the routed experts,
    DeepSeek-V3's MLA projections, per-head norms as Replicate over TP; routed experts untouched."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from nemo_moe_export.job.tensor_parallel import tp_plan

    kinds = {ColwiseParallel: "col", RowwiseParallel: "row", SequenceParallel: "heads"}
    deepseek = {k: kinds[type(v)] for k, v in tp_plan(build_model("deepseek_v3")).items()}
    assert deepseek == {"mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row",
                        "mlp.shared_experts.gate_proj": "col", "mlp.shared_experts.up_proj": "col",
                        "mlp.shared_experts.down_proj": "row", "self_attn.q_b_proj": "col",
                        "self_attn.kv_b_proj": "col", "self_attn.o_proj": "row"}
    qwen = {k: kinds[type(v)] for k, v in tp_plan(build_model("qwen3_moe")).items()}
    assert qwen == {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
                    "self_attn.o_proj": "row", "self_attn.q_norm": "heads", "self_attn.k_norm": "heads",
                    "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


def test_tp_size_that_splits_heads_unevenly_is_refused():
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.job.tensor_parallel import parallelize_tp

    class ThreeWay:  # stands in for a 3-rank mesh: parallelize_tp reads its size before any collective
        def size(self):
            return 3

    with pytest.raises(InputError, match="num_attention_heads"):
        parallelize_tp(build_model("qwen3_moe"), ThreeWay())


@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_tp_fsdp_forward_and_gradients_equal_the_unsharded_model(family, ranks):
    for rank, result in enumerate(ranks):
        errors = result[f"tp-{family}"]["forward"]
        check_figure(errors["logits"], FP32_LOGITS, f"{family} rank {rank} logits")
        check_figure(errors["grad"], FP32_GRADS, f"{family} rank {rank} gradient of {errors['worst']}")
    placements = ranks[0][f"tp-{family}"]["placements"]
    # What TP split and what it left whole (experts: FSDP over "dp" only).
    assert placements["model.layers.1.self_attn.o_proj.weight"] == "('dp', 'tp') (Shard(dim=0), Shard(dim=1))"
    assert placements["lm_head.weight"].startswith("('dp', 'tp') (_StridedShard(dim=0")
    assert placements["model.layers.1.mlp.experts.gate_up_proj"] == "('dp',) (Shard(dim=0),)"
    if family == "qwen3_moe":
        assert placements["model.layers.0.self_attn.q_norm.weight"] == "('dp', 'tp') (Shard(dim=0), Replicate())"


@pytest.mark.parametrize("case", ["tp-deepseek_v3", "tp-qwen3_moe", "cp-deepseek_v3"])
def test_export_equals_save_pretrained_and_writes_each_byte_once(case, ranks, inputs, saved, saved_dirs):
    from nemo_moe_export.export import verify_checkpoint

    family = case.split("-", 1)[1]
    path = os.path.join(inputs["out"], case)
    _assert_equal_tensors(stored_tensors(path), saved[family], case)
    assert_serving_config(path, saved_dirs[family])  # the TP / CP door (docs/design.md#serving-engines)
    assert verify_checkpoint(path).ok
    results = [r[case]["export"] for r in ranks]
    assert sum(r["bytes"] for r in results) == results[0]["total"]
    # The copies TP leaves whole (norms, router, experts) and every CP copy were compared, and
    # their holders shared the writing: every rank wrote some of them.
    assert all(r["replica_check"]["tensors"] > 0 for r in results), results
    assert min(r["bytes"] for r in results) > 0.15 * results[0]["total"], [r["bytes"] for r in results]
    # Row-parallel (Shard(1) over "tp") shares went to the TP peers, each writing whole rows; CP has none.
    exchanged = [r["io"]["exchanged_bytes"] for r in results]
    assert all(x > 0 for x in exchanged) if case.startswith("tp") else exchanged == [0] * WORLD, exchanged


def test_cp_copies_are_read_from_the_root_mesh(ranks):
    for result in ranks:
        assert result["cp-deepseek_v3"]["unsplit_dims"] == {"dp": [1], "dp_shard_cp": []}


@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_from_hf_into_tp_fsdp_reproduces_every_parameter(family, ranks):
    for rank, result in enumerate(ranks):
        assert result[f"tp-{family}"]["reload"] == [], rank


@pytest.mark.parametrize("case", ["tp-deepseek_v3", "tp-qwen3_moe", "cp-deepseek_v3"])
def test_mmlu_predictions_equal_a_single_process_run(case, ranks, reference):
    family = case.split("-", 1)[1]
    want = reference[family]
    assert len(set(want["pred"])) > 1, "the reference must not answer every question alike"
    for rank, result in enumerate(ranks):
        judge_answers(result[case]["mmlu"], want, f"{case} rank {rank}")


@pytest.mark.parametrize("case", ["tp-deepseek_v3", "tp-qwen3_moe", "cp-deepseek_v3"])
def test_mmlu_splits_questions_over_dp_only(case, ranks):
    """Ranks (dp, tp|cp) = 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1): TP / CP peers run the same
    batches in the same steps; the two data replicas split the batches between them."""
    plans = [r[case]["mmlu"]["plan"] for r in ranks]
    assert plans[0] == plans[1] and plans[2] == plans[3], plans
    real = [b for b in plans[0] + plans[2] if b is not None]
    assert sorted(real) == list(range(ranks[0][case]["mmlu"]["batches"])), plans
    assert plans[0] != plans[2]
    forwards = [r[case]["mmlu"]["forwards"] for r in ranks]
    assert len(set(forwards)) == 1, forwards
    dim = case.split("-")[0]
    for rank, result in enumerate(ranks):
        layout = result[case]["mmlu"]["layout"]
        assert layout["dp"]["ranks"] == [rank % 2, rank % 2 + 2] and layout[dim]["ranks"] == [rank - rank % 2,
                                                                                               rank - rank % 2 + 1]


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_fp8_export_under_tp_equals_quantizing_the_unsharded_model(scale_fmt, ranks, inputs, saved):
    path = os.path.join(inputs["out"], f"tp-fp8-{scale_fmt}")
    expected = {}
    for key, w in saved["deepseek_v3"].items():
        if FP8_RULE.search(key):
            expected[key], expected[key + "_scale_inv"] = reference_fp8(w, scale_fmt)
        else:
            expected[key] = w
    _assert_equal_tensors(stored_tensors(path), expected, f"fp8 {scale_fmt}")
    assert tuple(expected["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (1, 3)  # 384 columns: 3 blocks
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"].get("scale_fmt") == scale_fmt
    results = [r["tp-deepseek_v3"][f"fp8-{scale_fmt}"] for r in ranks]
    assert sum(r["bytes"] for r in results) == results[0]["total"]
    assert sum(r["io"]["boundary_blocks"] for r in results) > 0  # the TP cut at 192 crosses blocks


def test_one_spawn_stays_within_budget(ranks):
    print("seconds per case (rank 0):", ranks[0]["seconds"])
    assert sum(ranks[0]["seconds"].values()) < 150
