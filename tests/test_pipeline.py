"""Pipeline parallelism with torch stages on real gloo ranks: same logits, same MMLU answers, same
gradients as the unsplit model, and a failing or stalled stage reported instead of a hang.

One spawn of 4 ranks runs every case (a case: a 2-D mesh with a "pp" dim, the stages built with
``split_stages`` and sharded inside the stage, a :class:`PipelinedCausalLM`):

* ``pp2_fsdp2``: mesh ("pp", "dp") = (2, 2), each stage ``fully_shard`` on ``mesh["dp"]``;
* ``pp2_ep2``: mesh ("pp", "ep") = (2, 2), each stage's experts expert-parallel over ``mesh["ep"]``;
* ``pp2_virtual``: 4 stages, 2 per rank in loop order, FSDP2 over "dp" (looped / interleaved schedules);
* ``pp2_uneven``: 4 layers split [1, 3], stages replicated over "dp".

Each case checks logits against the unsplit model on every rank (fp32; batches with fewer rows than
microbatches and with padding), MMLU predictions against a single-process run of the unsplit model
in the pytest process (both policies; the two pipelines evaluate different batches under
``lockstep``), and a 1F1B training step's loss and gradients against the unsplit model's. Then the
faults, on fresh groups whose pipeline timeout is short: a stage that raises during an MMLU
evaluation (every rank names the stage and rank), and a stalled first stage (its peer's receive
ends at the pipeline group's timeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from nemo_moe_export.spawn import spawn
from bounds import FP32_LOGITS, Bound, check_figure, judge_answers, relative_error
from test_mmlu_eval import K_SHOT, FailAtForward, load_split_data, write_mmlu_inputs

WORLD = 4
# 20 questions in 5 batches of 4: under lockstep one pipeline runs 3 batches, the other 2 and a dummy
SUBJECTS = {"abstract_algebra": 5, "philosophy": 5, "sociology": 6, "virology": 4}
BATCH = 4
# initializer_range 0.5: answers depend on the question (see test_mmlu_eval); 4 layers for 4 stages.
MODEL_KW = dict(n_experts=8, num_layers=4, vocab_size=416, seed=0, initializer_range=0.5)
# fp32 loss and gradients of the stages against the unsplit model: the microbatches' losses and
# gradients are summed in another order (a few ulps of values below 1).
GRADS = Bound(1e-5, "fp32 loss and gradients (absolute) summed over microbatches in another order; measured "
                    "<= 1.9e-6 on AMD EPYC")
PP_TIMEOUT_S = 60.0  # the healthy cases' pipeline groups
FAULT_TIMEOUT_S = 3.0  # the fault cases' pipeline groups: how long a blocked receive waits
MMLU_OPTS = dict(k_shot=K_SHOT, batch_size=BATCH, tokens_per_batch=0, progress=False)  # shared_prefix: default (on)


@dataclass(frozen=True)
class Case:
    dims: tuple[str, str]
    shard: str  # "fsdp", "ep" or "none": what runs inside each stage over the mesh's second dim
    stages_per_rank: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    microbatches: int = 2


CASES = {
    "pp2_fsdp2": Case(("pp", "dp"), "fsdp"),
    "pp2_ep2": Case(("pp", "ep"), "ep", layers_per_stage=(3, 1)),  # layer 0 is dense: both stages hold experts
    "pp2_virtual": Case(("pp", "dp"), "fsdp", stages_per_rank=2, microbatches=4),
    "pp2_uneven": Case(("pp", "dp"), "none", layers_per_stage=(1, 3)),
}


def build_model():
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("deepseek_v3", **MODEL_KW)
    for name, buf in model.named_buffers():  # token-dependent routing, as test_mmlu_eval does
        if name.endswith("e_score_correction_bias"):
            buf.mul_(0.05)
    return model


def _batch(seed: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a right-padding mask (the last row padded) and labels; any rank can rebuild any batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MODEL_KW["vocab_size"], (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[-1, length // 2:] = 0
    return ids, mask, torch.randint(0, MODEL_KW["vocab_size"], (rows, length), generator=gen)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


def _mesh(dims: tuple[str, str], pp_timeout_s: float):
    """A (2, 2) mesh whose "pp" groups have their own timeout: pipeline waits end there."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timedelta(seconds=pp_timeout_s)
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=dims, backend_override={"pp": ("gloo", gloo)})


def _pipelined(case: Case, mesh, layout):
    """This rank's stages of the test model, sharded inside each stage as ``case`` says."""
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.expert_parallel import apply_expert_parallel
    from nemo_moe_export.pipeline import PipelinedCausalLM, split_stages, stage_ids

    n_stages = 2 * case.stages_per_rank
    mine = stage_ids(layout.pp.rank, layout.pp.size, case.stages_per_rank)
    stages = split_stages(build_model(), n_stages, layers_per_stage=case.layers_per_stage)
    parts = [stages[i] for i in mine]
    for part in parts:
        if case.shard == "fsdp":
            for layer in part.model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
        elif case.shard == "ep":
            apply_expert_parallel(part, layout)
    return PipelinedCausalLM(parts, mine, n_stages, layout.pp.group, n_microbatches=case.microbatches)


def _logit_errors(model, reference, pipeline_index: int) -> dict[str, float]:
    """Max |pipeline - unsplit| (of the largest |logit|) on batches of this pipeline's own (pipelines differ, so EP and
    FSDP peers inside a stage see different tokens): 3 rows (< 4 microbatches), padded, all
    logits; 5 rows, each row's own kept positions; 1 row, the last position."""
    errors = {}
    for label, rows, length, keep in (("all", 3, 7, 0), ("rows", 5, 9, "per_row"), ("last", 1, 6, 1)):
        ids, mask, _ = _batch(100 + 10 * pipeline_index + rows, rows, length)
        positions = torch.randint(0, length, (rows, 2), generator=torch.Generator().manual_seed(rows))
        keep_arg = positions if keep == "per_row" else keep
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep_arg).logits
            full = reference(input_ids=ids, attention_mask=mask).logits
        want = torch.take_along_dim(full, positions[..., None], dim=1) if keep == "per_row" else full[:, -keep:]
        errors[label] = relative_error(got, want)
    return errors


def _mmlu(model, tok, test, dev, layout) -> dict:
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    out = {}
    for policy in ("lockstep", "expert_dp"):
        result = evaluate_mmlu(model, tok, test, dev, layout, policy=policy, timeout_s=60, **MMLU_OPTS)
        out[policy] = {"pred": result.predictions, "scores": [r["scores"] for r in result.records],
                       "metrics": result.metrics, "scoring": result.scoring, "layout": result.layout,
                       "steps": result.steps}
    return out


def _train_errors(case: Case, model, layout) -> dict[str, float]:
    """One 1F1B step on this pipeline's batch; loss and every gradient against the unsplit model.

    Expected gradients: FSDP averages over "dp", so the mean of both pipelines' reference
    gradients; under EP a dense weight sees only its pipeline's batch, an expert the tokens of
    both pipelines' batches (their sum); replicated stages, their own batch."""
    from torch.distributed.tensor import DTensor

    from nemo_moe_export.pipeline import pipeline_train_step

    batches = [_batch(7 + p, 4, 8) for p in range(2)]
    mine = layout.dp.rank  # which pipeline: dense DP holds "dp" or "ep", never "pp"
    ids, mask, labels = batches[mine]
    loss = pipeline_train_step(model, ids, labels, _loss, attention_mask=mask)
    refs = [_reference_grads(*b) for b in batches]
    errors = {"loss": abs(float(loss) - refs[mine][0])}
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        g0, g1 = refs[0][1][name], refs[1][1][name]
        if case.shard == "fsdp":
            want = (g0 + g1) / 2
        elif case.shard == "ep" and ".experts." in name:
            want = g0 + g1
        else:
            want = refs[mine][1][name]
        worst = max(worst, float((grad - want).abs().max()))
    errors["grad"] = worst
    errors["params"] = sum(1 for _ in model.named_parameters())
    return errors


def _reference_grads(ids, mask, labels) -> tuple[float, dict[str, torch.Tensor]]:
    reference = build_model()
    loss = _loss(reference(input_ids=ids, attention_mask=mask).logits, labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in reference.named_parameters()}


def _case(case: Case, tok, test, dev) -> dict:
    from nemo_moe_export.parallel import discover_layout

    mesh = _mesh(case.dims, PP_TIMEOUT_S)
    layout = discover_layout(mesh)
    model = _pipelined(case, mesh, layout)
    pipeline_index = layout.dp.rank  # the dp coordinate: which pipeline this rank is in
    return {"logits": _logit_errors(model.eval(), build_model().eval(), pipeline_index),
            "mmlu": _mmlu(model, tok, test, dev, layout),
            "train": _train_errors(case, model, layout),
            "keys": sorted(model.state_dict()), "stage_ids": list(model.stage_ids), "refusals": _refusals(model)}


def _refusals(model) -> dict[str, str | None]:
    """Bad uses refused up front with the package's input error (the key it names), on every rank."""
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.pipeline import PipelinedCausalLM, pipeline_train_step

    ids, _, labels = _batch(3, 3, 5)  # 3 rows: not a multiple of the microbatches
    calls = {
        "wrong_ids": lambda: PipelinedCausalLM(list(model.parts), [i + 1 for i in model.stage_ids], model.n_stages,
                                               model.pipeline_group),
        "use_cache": lambda: model(input_ids=ids, use_cache=True),
        "uneven_training_batch": lambda: pipeline_train_step(model, ids, labels, _loss),
    }
    out: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except InputError as exc:
            out[name] = exc.key
    return out


def _failing_stage(rank: int, tok, test, dev) -> dict:
    """Rank 2 (stage 1 of the first pipeline) raises in its second MMLU step."""
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.parallel import PeerError, discover_layout

    mesh = _mesh(("pp", "dp"), FAULT_TIMEOUT_S)
    layout = discover_layout(mesh)
    model = _pipelined(CASES["pp2_uneven"], mesh, layout)
    if rank == 2:
        last_layer = list(model.parts[0].model.layers.values())[-1]
        last_layer.register_forward_pre_hook(FailAtForward(model.n_microbatches + 1))  # step 2, microbatch 0
    started = time.monotonic()
    try:
        evaluate_mmlu(model, tok, test, dev, layout, policy="lockstep", timeout_s=6 * FAULT_TIMEOUT_S, **MMLU_OPTS)
        return {"error": None, "elapsed": time.monotonic() - started}
    except PeerError as exc:
        return {"error": str(exc), "ranks": exc.ranks, "elapsed": time.monotonic() - started}


def _stalled_stage(rank: int) -> dict:
    """Rank 0 (stage 0 of the first pipeline) never runs the forward; its last stage (rank 2)
    waits in a receive, which must end at the pipeline group's timeout. Rank 0 stays alive until
    then (its exit would close the connection and end the wait sooner). The other pipeline runs."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    from nemo_moe_export.parallel import discover_layout
    from nemo_moe_export.pipeline import PipelineError

    mesh = _mesh(("pp", "dp"), FAULT_TIMEOUT_S)
    layout = discover_layout(mesh)
    model = _pipelined(CASES["pp2_uneven"], mesh, layout).eval()
    ids, mask, _ = _batch(5, 2, 6)
    store, gave_up = _get_default_store(), "test_pipeline/stalled/gave_up"
    started = time.monotonic()
    if rank == 0:
        store.wait([gave_up], timedelta(seconds=FAULT_TIMEOUT_S + 30))
        return {"error": "stalled on purpose", "elapsed": time.monotonic() - started}
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        return {"error": None, "elapsed": time.monotonic() - started}
    except PipelineError as exc:
        return {"error": str(exc), "stage": exc.stage, "elapsed": time.monotonic() - started}
    finally:
        if rank == 2:
            store.set(gave_up, "1")


def _worker(rank: int, world: int, data_dir: str, tok_dir: str) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    test, dev = load_split_data(data_dir)
    out, seconds = {}, {}
    for name, case in CASES.items():
        started = time.monotonic()
        out[name] = _case(case, tok, test, dev)
        seconds[name] = time.monotonic() - started
    out["failing_stage"] = _failing_stage(rank, tok, test, dev)
    out["stalled_stage"] = _stalled_stage(rank)
    out["seconds"] = seconds
    return out


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return write_mmlu_inputs(root, SUBJECTS)


@pytest.fixture(scope="module")
def reference(inputs):
    """The unsplit model in this process (no torch.distributed), batch size 1: nothing padded."""
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

    test, dev = load_split_data(inputs["data"])
    result = evaluate_mmlu(build_model(), PreTrainedTokenizerFast.from_pretrained(inputs["tok"]), test, dev,
                           **(MMLU_OPTS | {"batch_size": 1, "shared_prefix": False}))
    return {"pred": result.predictions, "scores": [r["scores"] for r in result.records], "metrics": result.metrics}


@pytest.fixture(scope="module")
def ranks(inputs):
    return spawn(_worker, WORLD, inputs["data"], inputs["tok"], timeout_s=240)


# --------------------------------------------------------------------------------------------------
# Tests: single process
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "kimi_linear"])
def test_chained_stages_equal_the_unsplit_model(family):
    """Stage forwards chained by hand (no pipeline runtime) give the unsplit model's logits exactly,
    padding included; every stage keeps the original parameter names and the stages together hold
    every parameter once."""
    from nemo_moe_export.pipeline import split_stages, stage_info
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model(family, n_experts=4, num_layers=3).eval()
    ids, mask, _ = _batch(3, 3, 7)
    with torch.no_grad():
        want = model(input_ids=ids % model.config.vocab_size, attention_mask=mask).logits
        for split in (None, (1, 2), (2, 1), (1, 1, 1)):
            stages = split_stages(model, len(split or (0, 0)), layers_per_stage=split)
            hidden = ids % model.config.vocab_size
            for stage in stages:
                hidden = stage(hidden, attention_mask=mask)
            assert torch.equal(hidden, want), (family, split)
            names = [n for s in stages for n in s.state_dict()]
            assert sorted(names) == sorted(model.state_dict()), (family, split)
            assert [i for s in stages for i in stage_info(s).layers] == [0, 1, 2], (family, split)
    assert type(model.model.layers).__name__ == "ModuleList", "split_stages must leave the model as it was"


def test_stage_layout_and_ids():
    from nemo_moe_export.pipeline import split_stages, stage_ids

    stages = split_stages(build_model(), 2, layers_per_stage=[1, 3])
    first, last = stages
    assert list(first.model.layers) == ["0"] and list(last.model.layers) == ["1", "2", "3"]
    assert first.lm_head is None and first.model.norm is None and first.model.embed_tokens is not None
    assert last.model.embed_tokens is None and last.lm_head is not None
    assert first.model.rotary_emb is not None and last.model.rotary_emb is not None
    assert first.config is last.config and last.config.num_hidden_layers == 4
    assert "model.layers.3.mlp.experts.gate_up_proj" in last.state_dict()
    assert stage_ids(1, 2, 3) == [1, 3, 5] and stage_ids(0, 4) == [0]


@pytest.mark.parametrize("bad", ["tied", "layers", "n_stages", "not_a_model"])
def test_split_refuses_what_it_cannot_split(bad):
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.pipeline import split_stages
    from nemo_moe_export.tiny_models import tiny_model

    calls = {
        "tied": (lambda: split_stages(tiny_model("qwen3_moe", tie_word_embeddings=True), 2), "tie_word_embeddings"),
        "layers": (lambda: split_stages(build_model(), 2, layers_per_stage=[2, 1]), "layers_per_stage"),
        "n_stages": (lambda: split_stages(build_model(), 5), "n_stages"),
        "not_a_model": (lambda: split_stages(torch.nn.Linear(2, 2), 2), "model_type"),
    }
    call, key = calls[bad]
    with pytest.raises(InputError, match="pipeline stages|layers_per_stage") as info:
        call()
    assert info.value.key == key and info.value.expected is not None and info.value.actual is not None


# --------------------------------------------------------------------------------------------------
# Tests: 4 gloo ranks
# --------------------------------------------------------------------------------------------------


def test_reference_is_a_real_signal(reference):
    assert len(reference["pred"]) == sum(SUBJECTS.values())
    assert len(set(reference["pred"])) >= 2, "every question got the same answer: comparisons would be vacuous"


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_logits_equal_the_unsplit_model(ranks, case):
    for rank, results in enumerate(ranks):
        for name, error in results[case]["logits"].items():
            check_figure(error, FP32_LOGITS, f"{case} rank {rank} {name}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policy", ["lockstep", "expert_dp"])
def test_mmlu_under_pp_equals_single_process(ranks, reference, case, policy):
    for rank, results in enumerate(ranks):
        got = results[case]["mmlu"][policy]
        judge_answers(got, reference, f"{case} {policy} rank {rank}")
        assert got["scoring"]["shared_prefix"].startswith("off: PipelinedCausalLM: pipeline stages keep no KV cache")
        assert got["scoring"]["shared_prefixes"] == 0


def test_mmlu_layouts_were_the_intended_ones(ranks):
    """Guards the MMLU comparison: a "pp" group of 2 in stage order, dense DP without it, and under
    lockstep the two pipelines split an odd number of batches (one of them runs a dummy step, so
    EP and FSDP peers inside a stage run batches of different shapes in lockstep)."""
    n_batches = -(-sum(SUBJECTS.values()) // BATCH)
    assert n_batches % 2 == 1
    for rank, results in enumerate(ranks):
        for case in CASES:
            layout = results[case]["mmlu"]["lockstep"]["layout"]
            assert layout["pp"]["ranks"] == [rank % 2, rank % 2 + 2] and layout["pp"]["rank"] == rank // 2, layout
            assert layout["dp"]["size"] == 2 and rank in layout["dp"]["ranks"], layout
            assert results[case]["mmlu"]["lockstep"]["steps"] == -(-n_batches // 2)
        assert results["pp2_ep2"]["mmlu"]["lockstep"]["layout"]["ep"]["size"] == 2
        assert results["pp2_ep2"]["mmlu"]["expert_dp"]["steps"] == n_batches  # EP peers share every batch
        assert results["pp2_virtual"]["stage_ids"] == [rank // 2, rank // 2 + 2]


def test_training_step_loss_and_gradients_equal_the_unsplit_model(ranks):
    for rank, results in enumerate(ranks):
        for case in CASES:
            errors = results[case]["train"]
            assert errors["params"] > 0
            check_figure(errors["loss"], GRADS, f"{case} rank {rank} loss")
            check_figure(errors["grad"], GRADS, f"{case} rank {rank} gradients")


def test_state_dicts_of_a_pipeline_union_to_the_model(ranks):
    """The ranks of one pipeline hold every key of the unsplit model, each under its original name, once."""
    everything = sorted(build_model().state_dict())
    for case in CASES:
        for pipeline in (0, 1):
            keys = [k for rank, r in enumerate(ranks) if rank % 2 == pipeline for k in r[case]["keys"]]
            assert sorted(keys) == everything, case


def test_bad_uses_are_refused_on_every_rank(ranks):
    for results in ranks:
        for case in CASES:
            assert results[case]["refusals"] == {"wrong_ids": "ids", "use_cache": "use_cache",
                                                 "uneven_training_batch": "input_ids"}, case


def test_failing_stage_is_named_on_every_rank(ranks):
    for rank, results in enumerate(ranks):
        got = results["failing_stage"]
        assert got["error"] is not None, f"rank {rank} finished although stage 1 on rank 2 failed"
        assert "pipeline stage 1 on rank 2 failed" in got["error"] and "injected failure" in got["error"], got
        assert got["elapsed"] < 6 * FAULT_TIMEOUT_S, got


def test_stalled_stage_ends_at_the_pipeline_timeout(ranks):
    waiting = ranks[2]["stalled_stage"]
    assert waiting["error"] is not None and "stopped waiting for its pipeline peers" in waiting["error"], waiting
    assert waiting["stage"] is None, "nothing failed: no stage may be blamed"
    assert FAULT_TIMEOUT_S - 0.5 <= waiting["elapsed"] <= FAULT_TIMEOUT_S + 5, waiting
    for rank in (1, 3):  # the other pipeline is not affected
        assert ranks[rank]["stalled_stage"]["error"] is None, ranks[rank]["stalled_stage"]
