"""megatron-core tensor (TP), sequence (SP) and expert-tensor (ETP) parallelism on 4 real gloo ranks:
the export view placed from ``sharded_state_dict()``, the no-gather export, transformers' load and
``from_hf`` back into the sharded model.

One spawn of 4 ranks runs every case (megatron's imports are paid once), re-initialising
``parallel_state`` between them (``destroy_model_parallel``, then ``initialize_model_parallel``):

* reference: rank 0 alone (TP=EP=PP=1) builds each family's unsharded model;
* ``tp2_ep2_sp``: TP2 x EP2 with sequence parallelism (ETP defaults to TP: 2);
* ``tp2_pp2``: TP2 x PP2 (one layer per stage);
* ``tp2_ep2_etp1``: TP2 x EP2 with ``expert_tensor_parallel_size=1`` (experts whole, expert-DP 2),
  then a final norm changed on one TP rank (the export's replica check must refuse it);
* last, CP=2: the wrapper refuses context parallelism by name;

each with a DeepSeek-V3-style (MLA, dense first layer, shared expert) and a Qwen3-MoE-style (GQA,
q/k norms) model. The HF vocabulary is the synthetic MMLU tokenizer's 62 tokens; megatron's is
padded to a multiple of 128 * TP (128 at TP=1, 256 at TP=2). MMLU runs under TP2 x EP2 with SP
against rank 0's single-process run.

Every model holds the same weights: each tensor's *global* value is drawn from its global name
(``megatron_reference.value_by_name``), and each rank keeps its slice of it, cut here by the tests'
own reading of megatron's tensor-parallel layers (column-parallel dim 0, row-parallel dim 1, the
SwiGLU ``linear_fc1`` as ``[gate_r; up_r]``, vocabulary rows padded), independently of the wrapper,
which reads megatron's own ``sharded_state_dict()``. The export must equal the reference model's
state converted key by key (``megatron_reference.hf_tensors``, the tokenizer's vocabulary rows).
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_reference import global_name, hf_tensors, value_by_name
from bounds import FP32_LOGITS, check_figure, judge_answers, relative_error
from nemo_moe_export.spawn import spawn

HIDDEN, LAYERS = 32, 2
K_SHOT, BATCH, N_TEST = 1, 4, 5  # MMLU: 20 synthetic questions
EXPERTS = {"deepseek_v3": 4, "qwen3_moe": 4}
FAMILIES = ("deepseek_v3", "qwen3_moe")
# case -> parallel_state sizes (TP is 2 in every case) and sequence parallelism
# The SP case (expert-TP 2) uses megatron's allgather token dispatcher: the alltoall one gathers
# uneven token counts over the expert-TP group, which gloo's all_gather (equal sizes only) refuses.
CASES = {
    "tp2_ep2_sp": dict(pp=1, ep=2, etp=None, sp=True, dispatcher="allgather"),
    "tp2_pp2": dict(pp=2, ep=1, etp=None, sp=False, dispatcher="alltoall"),
    "tp2_ep2_etp1": dict(pp=1, ep=2, etp=1, sp=False, dispatcher="alltoall"),
}
INPUT = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(5))  # 7: odd, SP pads
PADDING = torch.ones(2, 7, dtype=torch.long).index_fill_(1, torch.tensor([6]), 0)
# fp32, |logits| up to 4.0, sums in another order (tests/bounds.py); measured: every TP case within
# 2.9e-6 of the TP=1 model's logits and of transformers' on the export; MMLU scores within 2.4e-6
COLUMN = ("linear_qkv.weight", "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
          "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


# --------------------------------------------------------------------------------------------------
# The tests' own layout: global names, global values, each rank's slice
# --------------------------------------------------------------------------------------------------


def _global_value(key: str, name: str, shape: list[int], dtype: torch.dtype, seed: int, vocab: int) -> torch.Tensor:
    """The whole tensor ``name``: drawn from its name; the vocabulary's real rows do not depend on
    the padding (drawn at ``vocab`` rows), the padding rows come from another name."""
    if key in VOCAB_KEYS:
        real = value_by_name(key, name, torch.empty(vocab, *shape[1:], dtype=dtype), seed)
        pad = value_by_name(key, f"{name}#padding", torch.empty(shape[0] - vocab, *shape[1:], dtype=dtype), seed)
        return torch.cat([real, pad])
    return value_by_name(key, name, torch.empty(shape, dtype=dtype), seed)


def _slice(key: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A TP rank's part of ``full``, as megatron's local-spec layers hold it (the tests' reading)."""
    if size == 1:
        return full
    if key.endswith("linear_fc1.weight"):  # SwiGLU column-parallel: this rank's gate rows, then its up rows
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if key.endswith(COLUMN):
        return full.chunk(size, dim=0)[rank]
    if key.endswith(ROW):
        return full.chunk(size, dim=1)[rank]
    return full  # norms, router, expert bias: the same on every TP rank


def _scale(key: str, size: int) -> tuple[int, int]:
    """``(dim0 factor, dim1 factor)`` from a TP rank's shape to the global one."""
    if size == 1 or not key.endswith(("linear_fc1.weight", *COLUMN, *ROW)):
        return 1, 1
    return (1, size) if key.endswith(ROW) else (size, 1)


def _fill(gpt, seed: int, first_layer: int, vocab: int) -> None:
    """Every tensor of this rank: its slice of the global value of its global name."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    n_local = EXPERTS[_family(gpt)] // ps.get_expert_model_parallel_world_size()
    with torch.no_grad():
        for key, t in gpt.state_dict().items():
            if not isinstance(t, torch.Tensor) or key.endswith("_extra_state"):
                continue
            expert = ".mlp.experts." in key
            rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
            rows, cols = _scale(key, size)
            shape = [t.shape[0] * rows, *t.shape[1:]]
            if len(shape) > 1:
                shape[1] *= cols
            name = global_name(_global_layer(key, first_layer), ep_rank, n_local)
            t.copy_(_slice(key, _global_value(key, name, shape, t.dtype, seed, vocab), rank, size))


def _global_layer(key: str, first_layer: int) -> str:
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + first_layer}.", key)


def _family(gpt) -> str:
    return "deepseek_v3" if gpt.config.multi_latent_attention else "qwen3_moe"


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


def _model(family: str, vocab: int, seed: int = 0, sp: bool = False, dispatcher: str = "alltoall"):
    """The family's model on the current parallel_state (this rank's stage and slices), filled."""
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import MegatronCausalLM
    from nemo_moe_export.megatron.tiny import build_gpt, padded_vocab_size, tiny_transformer_config

    tp = ps.get_tensor_model_parallel_world_size()
    config = tiny_transformer_config(family, n_experts=EXPERTS[family], hidden_size=HIDDEN, num_layers=LAYERS,
                                     pipeline_size=ps.get_pipeline_model_parallel_world_size(), sequence_parallel=sp,
                                     dispatcher=dispatcher)
    gpt = build_gpt(config, vocab_size=padded_vocab_size(vocab, tp))
    assert gpt.vocab_size == 128 * tp  # the tokenizer's 62 tokens, padded to a multiple of 128 * TP
    first_layer = ps.get_pipeline_model_parallel_rank() * LAYERS // ps.get_pipeline_model_parallel_world_size()
    _fill(gpt, seed, first_layer, vocab)
    return MegatronCausalLM(gpt, vocab_size=vocab)


def _raw(model) -> dict:
    return {k: v.detach().clone() for k, v in model.gpt.state_dict().items() if isinstance(v, torch.Tensor)}


def _logits(model) -> dict:
    model.eval()  # megatron refuses MoE under TP without SP in training mode
    with torch.no_grad():
        return {"full": model(input_ids=INPUT, attention_mask=PADDING).logits,
                "last": model(input_ids=INPUT, attention_mask=PADDING, logits_to_keep=2).logits}


def _mmlu(model, data: tuple, layout=None, **kw) -> dict:
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.parallel import discover_layout

    tok, test, dev = data
    result = evaluate_mmlu(model, tok, test, dev, layout or discover_layout(), k_shot=K_SHOT, tokens_per_batch=0,
                           policy="lockstep", progress=False, **{"timeout_s": 60, "batch_size": BATCH, **kw})
    return {"pred": result.predictions, "scores": [r["scores"] for r in result.records]}


def _reference(family: str, data: tuple) -> dict:
    """Rank 0 alone: the unsharded model's state, logits and MMLU (one question per forward)."""
    from nemo_moe_export.parallel import ParallelLayout, RankGroup

    alone = RankGroup.alone()
    model = _model(family, len(data[0]))
    return {"state": _raw(model), "logits": _logits(model),
            "mmlu": _mmlu(model, data, ParallelLayout(alone, alone, alone, "world"), batch_size=1)}


def _placements(model) -> dict:
    """The view: each key's DTensor placements and global shape."""
    return {k: ([str(p) for p in v.placements], tuple(v.shape)) for k, v in model.state_dict().items()}


def _sharded(case: str, family: str, workdir: str, data: tuple) -> dict:
    from megatron.core import parallel_state as ps

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import export_hf_checkpoint

    built = {"vocab": len(data[0]), "sp": CASES[case]["sp"], "dispatcher": CASES[case]["dispatcher"]}
    model = _model(family, **built)
    out = {"logits": _logits(model), "view": _placements(model), "state": _raw(model),
           "etp": ps.get_expert_tensor_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank()}
    path = os.path.join(workdir, f"{case}-{family}")
    out["result"] = export_hf_checkpoint(path, model, max_shard_size="16KB", timeout_s=60)
    fresh = _model(family, seed=1, **built)
    out["before"] = _raw(fresh)
    get_adapter(fresh.config).from_hf(fresh.state_dict(), path, pp_group=fresh.pipeline_group)
    out["reloaded"] = _raw(fresh)
    if case == "tp2_ep2_sp":  # MMLU: TP ranks in lockstep, data-parallel ranks split the questions
        out["mmlu"] = _mmlu(model, data)
    if case == "tp2_ep2_etp1":
        out["drifted"] = _drifted_replica(model, os.path.join(workdir, f"drifted-{family}"))
    return out


def _drifted_replica(model, path: str) -> str | None:
    """The final norm (duplicated on every TP rank) changed on one TP rank: the export must refuse."""
    from megatron.core import parallel_state as ps

    from nemo_moe_export.export import export_hf_checkpoint

    norm = model.gpt.decoder.final_layernorm.weight
    with torch.no_grad():
        if ps.get_tensor_model_parallel_rank() == 1:
            norm.add_(1e-3)
        try:
            export_hf_checkpoint(path, model, timeout_s=60)
            return None
        except Exception as exc:  # every rank raises the same agreed error
            return f"{type(exc).__name__}: {exc}"
        finally:
            if ps.get_tensor_model_parallel_rank() == 1:
                norm.sub_(1e-3)


def _inputs(data_root: str) -> tuple:
    from nemo_moe_export.evaluate.data import load_mmlu
    from nemo_moe_export.job.data import build_tokenizer

    questions = load_mmlu(data_root)
    return (build_tokenizer(data_root), [q for q in questions if q.split == "test"],
            [q for q in questions if q.split == "dev"])


def _worker(rank: int, world: int, workdir: str, data_root: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_moe_export.megatron import cpu_patches

    cpu_patches.apply()
    data = _inputs(data_root)
    out: dict = {}
    ps.initialize_model_parallel()
    if rank == 0:
        out["reference"] = {family: _reference(family, data) for family in FAMILIES}
    dist.barrier()
    ps.destroy_model_parallel()
    for case, sizes in CASES.items():
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=sizes["pp"],
                                     expert_model_parallel_size=sizes["ep"],
                                     expert_tensor_parallel_size=sizes["etp"])
        out[case] = {family: _sharded(case, family, workdir, data) for family in FAMILIES}
        ps.destroy_model_parallel()
    out["context_parallel"] = _context_parallel_refusal()
    return out


def _context_parallel_refusal() -> str | None:
    """CP=2: the wrapper refuses at construction, before it touches the model."""
    from megatron.core import parallel_state as ps

    from nemo_moe_export.errors import InputError
    from nemo_moe_export.megatron import MegatronCausalLM

    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        MegatronCausalLM(None)
        return None
    except InputError as exc:
        return str(exc)
    finally:
        ps.destroy_model_parallel()


# --------------------------------------------------------------------------------------------------
# Fixtures and tests
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu

    workdir = str(tmp_path_factory.mktemp("megatron_tp"))
    data_root = os.path.join(workdir, "data")
    write_synthetic_mmlu(data_root, seed=0, n_train=4, n_dev=3, n_test=N_TEST)
    os.environ["OMP_NUM_THREADS"] = "1"
    ranks = spawn(_worker, 4, workdir, data_root, timeout_s=600)
    return {"ranks": ranks, "reference": ranks[0]["reference"], "workdir": workdir,
            "vocab": len(build_tokenizer(data_root))}


def _reference_hf(runs, family: str) -> dict[str, torch.Tensor]:
    """The unsharded model's state converted key by key, the vocabulary cut to the HF rows."""
    state = runs["reference"][family]["state"]
    out = hf_tensors(state, family=family, ep_rank=0, n_local=EXPERTS[family], hidden=HIDDEN)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        out[key] = out[key][:runs["vocab"]]
    return out


CASE_FAMILIES = [(c, f) for c in CASES for f in FAMILIES]


@pytest.mark.parametrize("case,family", CASE_FAMILIES)
def test_export_equals_the_unsharded_models_conversion_bytes_once(case, family, runs):
    per_rank = [out[case][family] for out in runs["ranks"]]
    results = [r["result"] for r in per_rank]
    assert sum(r.rank_bytes_written for r in results) == results[0].checkpoint_bytes
    path = os.path.join(runs["workdir"], f"{case}-{family}")
    written = {k: v for f in glob.glob(os.path.join(path, "*.safetensors")) for k, v in load_file(f).items()}
    expected = _reference_hf(runs, family)
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key


@pytest.mark.parametrize("case,family", CASE_FAMILIES)
def test_transformers_loads_it_with_megatrons_logits(case, family, runs):
    """transformers' model of the export gives the TP model's logits (which are the TP=1 model's)
    on every rank, padded rows and ``logits_to_keep`` included."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(os.path.join(runs["workdir"], f"{case}-{family}"),
                                                       output_loading_info=True)
    assert not any(info.values()), info
    vocab = runs["vocab"]
    assert model.config.vocab_size == vocab
    with torch.no_grad():
        hf = model(INPUT, attention_mask=PADDING).logits
    reference = runs["reference"][family]["logits"]
    assert reference["full"].shape == (2, 7, vocab)
    for rank, out in enumerate(runs["ranks"]):
        got = out[case][family]["logits"]
        assert got["full"].shape == hf.shape and got["last"].shape == (2, 2, vocab), rank
        check_figure(relative_error(got["full"], reference["full"]), FP32_LOGITS, f"rank {rank} vs TP=1")
        check_figure(relative_error(got["last"], reference["full"][:, -2:]), FP32_LOGITS, f"rank {rank} last 2")
        real = PADDING.bool()  # transformers' logits at padded positions attend differently
        check_figure(relative_error(got["full"][real], hf[real]), FP32_LOGITS, f"rank {rank} vs transformers")


@pytest.mark.parametrize("case,family", CASE_FAMILIES)
def test_from_hf_into_the_sharded_model_reproduces_every_parameter(case, family, runs):
    """Every parameter of every rank equals the exported model's; megatron's vocabulary padding
    rows are not in the checkpoint and ``from_hf`` leaves them as they were."""
    for rank, out in enumerate(runs["ranks"]):
        r = out[case][family]
        assert set(r["reloaded"]) == set(r["state"]) and len(r["state"]) > 10
        for key, want in r["state"].items():
            got = r["reloaded"][key]
            if key in VOCAB_KEYS:  # TP rank (rank % 2) holds rows from (rank % 2) * its row count
                real = max(0, min(got.shape[0], runs["vocab"] - rank % 2 * got.shape[0]))
                assert torch.equal(got[:real], want[:real]), (rank, key)
                assert torch.equal(got[real:], r["before"][key][real:]), (rank, key)
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_view_places_tensors_as_sharded_state_dict_records_them(case, runs):
    """Column-parallel weights ``Shard(0)``, row-parallel ``Shard(1)`` over the TP dim; the SwiGLU
    ``linear_fc1`` as its factory's gate (``_w``) and up (``_v``) pieces of F rows each; norms and
    routers replicated over TP; experts over the expert-TP dim (ETP 2) or whole (ETP 1)."""
    view = runs["ranks"][0][case]["deepseek_v3"]["view"]
    etp = runs["ranks"][0][case]["deepseek_v3"]["etp"]
    assert etp == (1 if case == "tp2_ep2_etp1" else 2)
    assert any(k.endswith("_w") for k in view)
    if "decoder.layers.0.input_layernorm.weight" in view:  # stage 0
        assert view["decoder.layers.0.self_attention.linear_proj.weight"] == (["R", "S(1)"], (32, 32))
        assert view["decoder.layers.0.input_layernorm.weight"][0] == ["R", "R"]
        assert view["decoder.layers.0.mlp.linear_fc1.weight_w"] == (["R", "S(0)"], (64, 32))
        assert view["decoder.layers.0.mlp.linear_fc1.weight_v"] == (["R", "S(0)"], (64, 32))
        assert "decoder.layers.0.mlp.linear_fc1.weight" not in view
        assert view["embedding.word_embeddings.weight"] == (["R", "S(0)"], (256, 32))
    if "decoder.layers.1.mlp.router.weight" in view:  # the MoE layer's stage
        experts = view["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight_w"]
        assert experts == ((["R", "S(0)"], (16, 32)) if etp == 2 else (["R"], (16, 32)))
        assert view["decoder.layers.1.mlp.router.weight"][0] == ["R", "R"]


def test_a_replica_drifted_on_one_tp_rank_is_refused(runs):
    for rank, out in enumerate(runs["ranks"]):
        for family in FAMILIES:
            error = out["tp2_ep2_etp1"][family]["drifted"]
            assert error is not None and ("final_layernorm" in error or "model.norm.weight" in error), (rank, error)


def test_mmlu_under_tp2_with_sp_equals_the_single_process_run(runs):
    """TP ranks take every batch together (lockstep), data-parallel ranks split the questions; every
    rank's predictions equal rank 0's alone at TP=1, one question per forward."""
    for family in FAMILIES:
        reference = runs["reference"][family]["mmlu"]
        assert len(set(reference["pred"])) >= 2, "every question got the same answer: the comparison would be vacuous"
        for rank, out in enumerate(runs["ranks"]):
            judge_answers(out["tp2_ep2_sp"][family]["mmlu"], reference, f"{family} rank {rank}")


def test_context_parallelism_is_refused_by_name(runs):
    for out in runs["ranks"]:
        assert out["context_parallel"] is not None and "context_parallel" in out["context_parallel"]
        assert "'context_parallel': 2" in out["context_parallel"], out["context_parallel"]


# --------------------------------------------------------------------------------------------------
# The table options the view relies on, in one process (megatron-named tensors, no model)
# --------------------------------------------------------------------------------------------------


def _qwen3_adapter(vocab: int):
    from nemo_moe_export.adapters import InMemoryFormat, get_adapter
    from nemo_moe_export.adapters.tables_megatron import NAMING
    from nemo_moe_export.megatron.hf_config import MegatronQwen3MoeConfig

    config = MegatronQwen3MoeConfig(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_experts=4,
                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    config.in_memory_format = InMemoryFormat(NAMING)
    return get_adapter(config)


def test_glu_pieces_and_padded_rows_map_to_their_hf_rows():
    """``linear_fc1.weight_w`` / ``_v`` are gate and up whole; a padded embedding's HF tensor is its
    first ``vocab_size`` rows, as views; a vocabulary larger than the rows is refused by name."""
    from nemo_moe_export.errors import InputError

    state = {"embedding.word_embeddings.weight": torch.randn(128, 16),
             "decoder.layers.0.mlp.linear_fc1.weight_w": torch.randn(24, 16),
             "decoder.layers.0.mlp.linear_fc1.weight_v": torch.randn(24, 16),
             "decoder.layers.0.mlp.linear_fc2.weight": torch.randn(16, 24)}
    adapter = _qwen3_adapter(100)
    shapes = {k: tuple(m.shape) for k, m in adapter.hf_metadata(state).items()}
    assert shapes == {"model.embed_tokens.weight": (100, 16), "model.layers.0.mlp.gate_proj.weight": (24, 16),
                      "model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.mlp.down_proj.weight": (16, 24)}
    pieces = adapter.to_hf(state)
    assert torch.equal(pieces["model.embed_tokens.weight"].tensor, state["embedding.word_embeddings.weight"][:100])
    assert pieces["model.embed_tokens.weight"].tensor.data_ptr() == state["embedding.word_embeddings.weight"].data_ptr()
    assert torch.equal(pieces["model.layers.0.mlp.up_proj.weight"].tensor, state["decoder.layers.0.mlp.linear_fc1.weight_v"])
    with pytest.raises(InputError, match="vocab_size") as refused:
        _qwen3_adapter(200).hf_metadata(state)
    assert "embedding.word_embeddings.weight" in str(refused.value)
