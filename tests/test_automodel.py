"""NeMo AutoModel 0.7.0 itself: its DeepSeek-V3 and Qwen3-MoE classes, its parallelizer and its
AutoPipeline, on 4 real gloo ranks (docs/design.md#nemo-automodel).

One spawn runs every case:

* ``deepseek_v3_ep`` / ``qwen3_moe_ep``: FSDP2 + EP2 through AutoModel's ``parallelize_model``
  (experts on its (ep_shard, ep) mesh, placements (Shard(1), Shard(0))), one training step, then
  our no-gather export, ``from_hf`` back into a fresh sharded model, and (DeepSeek-V3) MMLU through
  AutoModel's own forward under both policies;
* ``deepseek_v3_bf16``: DeepSeek-V3 in bf16 as AutoModel lays it out (fp32 correction bias) under
  FSDP2 + EP2 with AutoModel's default bf16 policy, and our export;
* ``deepseek_v3_pp``: PP2 x EP2 x FSDP2 through ``instantiate_infrastructure`` + ``AutoPipeline``
  (1F1B), one training step through AutoPipeline's schedule, MMLU through the same schedule's
  forward-only ``eval`` (``AutoPipelineCausalLM``), two forwards of rows it pads, the export of the
  stage modules with the pipeline group, then AutoPipeline's next training step (one pipeline's
  stages re-shaped to a shorter batch);
* ``recipe``: AutoModel's ``train_ft`` with our ``MoEExportFinetuneRecipe``, from the documented
  example YAML (``examples/automodel_moe_export.yaml``, the model, gloo and paths swapped for the
  test's): 3 steps under FSDP2 + EP2, MMLU at step 2 and at the end, its own checkpoint at the last
  step, our export; then a second recipe instance resumes and gets the plugin's MMLU history back;
* ``recipe_pp``: the same recipe under PP2 x EP2 x FSDP2 (AutoPipeline 1F1B): MMLU after every
  step and at the end through AutoPipeline's schedule, and the export.

The parent compares each export, tensor for tensor (dtype and value), with the checkpoint
AutoModel's own adapter (``state_dict_adapter.to_hf``) plus a safetensors save produce from the
same weights (gathered with ``full_tensor`` in the ranks, for the reference only); loads it with
transformers and compares logits with AutoModel's sharded forward; checks that every tensor byte
was written once; and compares MMLU predictions with a single-process run of the same AutoModel model.
"""

from __future__ import annotations

import glob
import os
import struct

import pytest
import torch

from bounds import FP32_LOGITS, FP32_SCORES, check_close, check_figure, judge_answers, relative_error
from nemo_moe_export.spawn import spawn
from test_mmlu_eval import K_SHOT, build_tokenizer, load_split_data, write_mmlu_csvs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4
VOCAB = 416  # the MMLU test tokenizer has 400 tokens
SEQ = 12
# transformers' load of the export vs AutoModel's sharded forward, fp32, logits of order 10: the
# two differ only in summation order (bounds.FP32_LOGITS, relative to the largest |logit|). The
# pipeline's microbatch losses: fp32 cross-entropies of one row, likewise (bounds.FP32_SCORES).
MMLU_SUBJECTS = {"abstract_algebra": 5, "philosophy": 5, "sociology": 6}  # 16 questions, 4 batches of 4
MMLU_OPTS = dict(k_shot=K_SHOT, batch_size=4, tokens_per_batch=0, progress=False)


# --------------------------------------------------------------------------------------------------
# Stand-ins for AutoModel's hard-coded CUDA calls (tests only; these machines have no GPU)
# --------------------------------------------------------------------------------------------------


def stand_in_for_torch_cuda_current_device() -> int:
    """Qwen3-MoE's constructor builds ``torch.device(f"cuda:{torch.cuda.current_device()}")`` for
    its rotary embedding, which it never allocates there."""
    return 0


def stand_in_for_torch_cuda_synchronize(device=None) -> None:
    """AutoPipeline's stage warm-up synchronizes the CUDA stream; CPU work is already synchronous."""


def stand_in_for_torch_cuda_reset_peak_memory_stats(device=None) -> None:
    """``train_ft``'s ``setup()`` starts by resetting CUDA's peak-memory counters; there are none."""


def stand_in_for_torch_device_cuda_in_build_model() -> None:
    """``train_ft.build_model`` builds the infrastructure on ``torch.device("cuda", current_device())``
    and moves the model there: the same two calls, on the CPU."""
    import nemo_automodel.recipes.llm.train_ft as train_ft

    instantiate, apply = train_ft.instantiate_infrastructure, train_ft.apply_model_infrastructure
    if getattr(instantiate, "on_cpu", False):
        return

    def instantiate_on_cpu(**kwargs):
        return instantiate(**{**kwargs, "device": torch.device("cpu")})

    def apply_on_cpu(model, **kwargs):
        return apply(model, **{**kwargs, "device": torch.device("cpu")})

    instantiate_on_cpu.on_cpu = True
    train_ft.instantiate_infrastructure, train_ft.apply_model_infrastructure = instantiate_on_cpu, apply_on_cpu


def install_cpu_stand_ins() -> None:
    torch.cuda.current_device = stand_in_for_torch_cuda_current_device
    torch.cuda.synchronize = stand_in_for_torch_cuda_synchronize
    torch.cuda.reset_peak_memory_stats = stand_in_for_torch_cuda_reset_peak_memory_stats


# --------------------------------------------------------------------------------------------------
# AutoModel's models, built from configs
# --------------------------------------------------------------------------------------------------


def hf_config(family: str, layers: int):
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    if family == "deepseek_v3":
        return DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            max_position_embeddings=512, num_nextn_predict_layers=0, dtype="float32")
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512, dtype="float32")


def build(family: str, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32):
    """AutoModel's own class for ``family`` with the torch backends, unsharded, in ``dtype`` as its
    ``initialize_weights`` lays it out (DeepSeek-V3 keeps ``e_score_correction_bias`` in fp32);
    weights N(0, 0.5) so MMLU answers depend on the question, router biases small and nonzero."""
    from nemo_automodel.components.models.common import BackendConfig

    install_cpu_stand_ins()
    if family == "deepseek_v3":
        from nemo_automodel.components.models.deepseek_v3.model import DeepseekV3ForCausalLM as cls
    else:
        from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM as cls
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False, experts="torch_mm",
                            dispatcher="torch")
    torch.manual_seed(seed)
    model = cls.from_config(hf_config(family, layers), backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model


def fp32_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.float32)


def token_batch(seed: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, SEQ), generator=gen), torch.randint(0, VOCAB, (rows, SEQ), generator=gen)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# --------------------------------------------------------------------------------------------------
# Rank workers
# --------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full_state_dict(modules) -> dict[str, torch.Tensor]:
    """The reference's input only: every tensor gathered whole (a collective per DTensor, in the
    same key order on every rank of a stage)."""
    full = {}
    for module in modules:
        for key, t in module.state_dict().items():
            full[key] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return full


def _stats(result) -> dict:
    return {"rank_bytes_written": result.rank_bytes_written, "checkpoint_bytes": result.checkpoint_bytes,
            "files": result.files, "tensors": result.tensors}


def _ep_case(rank: int, family: str, root: str, mmlu_inputs: tuple[str, str] | None) -> dict:
    from nemo_automodel.components.distributed import model_parallelizer
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes

    from nemo_moe_export import export_hf_checkpoint, get_adapter
    from nemo_moe_export.integrations.automodel import AutoModelCausalLM, automodel_layout

    model = build(family)
    mesh = MeshContext.build(FSDP2Config(mp_policy=fp32_policy()), ParallelismSizes(ep_size=2))
    model_parallelizer.parallelize_model(model, mesh)
    experts = model.state_dict()["model.layers.1.mlp.experts.gate_and_up_projs"]
    placement = (tuple(str(getattr(n, "value", n)) for n in experts.device_mesh.mesh_dim_names),
                 tuple(map(repr, experts.placements)))

    ids, labels = token_batch(seed=rank)  # each rank its own batch: a real data-parallel step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cross_entropy(model(ids).logits, labels).backward()
    optimizer.step()
    optimizer.zero_grad()
    probe, _ = token_batch(seed=100)
    with torch.no_grad():
        logits = model(probe).logits

    out_dir = os.path.join(root, f"{family}_ep")
    result = export_hf_checkpoint(out_dir, model)
    # The fp32 model exported in bf16: which tensors stay fp32 is transformers' rule for the family,
    # not AutoModel's class's (docs/design.md#casting-like-transformers).
    export_hf_checkpoint(out_dir + "_as_bf16", model, dtype="bfloat16")
    full = _full_state_dict([model])

    fresh = build(family, seed=7)
    model_parallelizer.parallelize_model(fresh, mesh)
    trained, loaded = model.state_dict(), fresh.state_dict()
    differed = [k for k in trained if not torch.equal(_local(trained[k]), _local(loaded[k]))]
    report = get_adapter(fresh.config).from_hf(loaded, out_dir)
    still_different = [k for k in trained if not (torch.equal(_local(trained[k]), _local(loaded[k]))
                                                  and _local(trained[k]).dtype == _local(loaded[k]).dtype)]

    mmlu = None
    if mmlu_inputs is not None:
        from transformers import PreTrainedTokenizerFast

        from nemo_moe_export.evaluate.evaluator import evaluate_mmlu

        data_dir, tok_dir = mmlu_inputs
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        test, dev = load_split_data(data_dir)
        layout = automodel_layout(mesh.device_mesh, mesh.moe_mesh)
        mmlu = {"layout": (layout.dp.ranks, layout.ep.ranks, layout.edp.ranks)}
        for policy in ("lockstep", "expert_dp"):
            mmlu[policy] = _mmlu_run(evaluate_mmlu(AutoModelCausalLM(model), tok, test, dev, layout=layout,
                                                   policy=policy, **MMLU_OPTS))
    return {"stats": _stats(result), "placement": placement, "logits": logits if rank == 0 else None,
            "full": full if rank == 0 else None, "differed_before_load": len(differed),
            "still_different": still_different, "bytes_read": report.bytes_read, "mmlu": mmlu,
            "path": out_dir}


def _bf16_case(rank: int, root: str) -> dict:
    """AutoModel's DeepSeek-V3 in bf16 (``e_score_correction_bias`` fp32, as its
    ``initialize_weights`` keeps it) under FSDP2 + EP2 with AutoModel's default bf16 mixed precision,
    exported as it is."""
    from nemo_automodel.components.distributed import model_parallelizer
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes

    from nemo_moe_export import export_hf_checkpoint

    model = build("deepseek_v3", dtype=torch.bfloat16)
    mesh = MeshContext.build(FSDP2Config(), ParallelismSizes(ep_size=2))
    model_parallelizer.parallelize_model(model, mesh)
    out_dir = os.path.join(root, "deepseek_v3_bf16")
    result = export_hf_checkpoint(out_dir, model)
    full = _full_state_dict([model])
    return {"stats": _stats(result), "full": full if rank == 0 else None, "path": out_dir}


def _mmlu_run(result) -> dict:
    return {"pred": result.predictions, "scores": [x["scores"] for x in result.records],
            "shared_prefix": result.scoring["shared_prefix"]}


def _pp_case(rank: int, root: str, mmlu_inputs: tuple[str, str]) -> dict:
    from nemo_automodel._transformers.infrastructure import instantiate_infrastructure
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.pipelining.config import PipelineConfig

    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export import export_hf_checkpoint
    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.integrations.automodel import AutoPipelineCausalLM, automodel_layout

    model = build("deepseek_v3", layers=4)
    fsdp = FSDP2Config(mp_policy=fp32_policy())
    mesh = MeshContext.build(fsdp, ParallelismSizes(pp_size=2, ep_size=2))
    # patch_*=False: AutoModel's own models take stage inputs as they are (its DeepSeek-V3 benchmark YAML)
    pipeline = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=1, pp_batch_size=2, patch_inner_model=False,
                              patch_causal_lm_model=False, pp_seq_len=SEQ)
    _, autopipeline, parallelize_fn, _ = instantiate_infrastructure(
        distributed_config=fsdp, pipeline_config=pipeline, device=torch.device("cpu"), mesh=mesh)
    autopipeline.build(model, loss_fn=cross_entropy, parallelize_fn=parallelize_fn)
    parts = autopipeline.parts
    info = autopipeline.info

    pp = mesh.device_mesh["pp"]
    dp_rank = mesh.device_mesh["dp_shard"].get_local_rank()
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.05)

    def train_step(ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One 1F1B step as AutoModel's recipe runs it: the stages re-shaped to the batch's length first."""
        losses: list[torch.Tensor] = []
        autopipeline.update_seq_len(ids.shape[1])
        autopipeline.step(ids, target=labels if info.has_last_stage else None,
                          losses=losses if info.has_last_stage else None)
        optimizer.step()
        optimizer.zero_grad()
        return losses

    losses = train_step(*token_batch(seed=dp_rank))  # one batch per pipeline

    # MMLU through AutoPipeline's schedule (its eval step), after the training step. Each stage
    # module's forwards, seen from inside them: the PipelineStage running them is AutoPipeline's
    # own, in a forward-only step (schedule.eval clears its has_backward for the step), and its
    # fwd_cache holds the step's earlier microbatches (forward_one_chunk fills it)
    data_dir, tok_dir = mmlu_inputs
    test, dev = load_split_data(data_dir)
    layout = automodel_layout(mesh.device_mesh, mesh.moe_mesh)
    model = AutoPipelineCausalLM(autopipeline)
    forwards: list[tuple[int, bool, int]] = []
    hooks = [stage.submod.register_forward_hook(
        lambda *_, stage=stage: forwards.append((stage.stage_index, stage.has_backward, len(stage.fwd_cache))))
        for stage in info.stages]
    mmlu = _mmlu_run(evaluate_mmlu(model, PreTrainedTokenizerFast.from_pretrained(tok_dir), test, dev, layout=layout,
                                   **MMLU_OPTS))
    for hook in hooks:
        hook.remove()
    # what the next training step finds: the training microbatch and length, a schedule that trains
    after_mmlu = (autopipeline.pp_microbatch_size, autopipeline._pp_current_seq_len, info.schedule._has_backward)
    # Two more forwards of 3 rows (padded to the 2 microbatches, dropped after), every position
    # kept: the same length on both pipelines, then a shorter one on one pipeline only
    forwards_after = []
    for length in (SEQ, SEQ if dp_rank == 0 else SEQ - 3):
        ids = token_batch(seed=200, rows=3)[0][:, :length]
        forwards_after.append((ids, model(ids).logits))

    out_dir = os.path.join(root, "deepseek_v3_pp")
    result = export_hf_checkpoint(out_dir, parts, pp_group=pp.get_group())
    full = _full_state_dict(parts)  # the weights MMLU saw and the next step starts from
    keys = sorted(k for part in parts for k in part.state_dict())
    # Training goes on after the evaluation: AutoPipeline's next step, a shorter batch on one
    # pipeline only (its stages re-shaped, the other pipeline's kept)
    ids, labels = token_batch(seed=10 + dp_rank)
    ids, labels = ids[:, :SEQ - 3 * dp_rank], labels[:, :SEQ - 3 * dp_rank]
    next_losses = train_step(ids, labels)
    return {"stats": _stats(result), "pp_rank": pp.get_local_rank(), "keys": keys, "trained": bool(losses) or None,
            "mmlu": mmlu, "next_step": (ids, labels, [loss.item() for loss in next_losses]),
            "mmlu_forwards": forwards, "after_mmlu": after_mmlu, "n_microbatches": model.n_microbatches,
            "forwards_after": forwards_after,
            "full": full if dp_rank == 0 else None, "path": out_dir}


def recipe_model():
    """The recipe YAML's ``model._target_`` in the test: AutoModel's DeepSeek-V3, tiny."""
    return build("deepseek_v3")


def recipe_model_4_layers():
    """The pipelined recipe's ``model._target_``: two layers per stage."""
    return build("deepseek_v3", layers=4)


def _pipelined_recipe_case(rank: int, recipe_yaml: str) -> dict:
    """The recipe under PP2 x EP2 x FSDP2: 3 steps of AutoPipeline's 1F1B, MMLU after every step
    and at the end through AutoPipeline's schedule, then the export of the stage modules with
    the pipeline group. The weights and the evaluation at step 1 are kept for the parent."""
    import traceback

    try:
        from nemo_automodel.components.config._arg_parser import parse_args_and_load_config

        from nemo_moe_export.integrations.automodel import MoEExportFinetuneRecipe

        stand_in_for_torch_device_cuda_in_build_model()
        recipe = MoEExportFinetuneRecipe(parse_args_and_load_config(recipe_yaml, argv=[]))
        recipe.setup()
        step_end, at_step_1 = recipe.moe_export_step_end, {}

        def keep_step_1(step: int) -> None:
            step_end(step)
            if step == 1:
                at_step_1["full"] = _full_state_dict(recipe.model_parts)
                at_step_1["mmlu"] = _mmlu_run(recipe.moe_export_state._mmlu_callbacks()[0].last_result)

        recipe.moe_export_step_end = keep_step_1
        lengths, forward_backward = [], recipe._forward_backward_step  # the training batches' lengths

        def record_length(idx, batch, **kwargs):
            if kwargs.get("is_train", True):
                lengths.append(batch["input_ids"].shape[1])
            return forward_backward(idx, batch, **kwargs)

        recipe._forward_backward_step = record_length
        recipe.run_train_validation_loop()
        results = recipe.moe_export_results
        export = results["export"]
        last = recipe.moe_export_state._mmlu_callbacks()[0].last_result
        first_of_stage = recipe.device_mesh["dp_shard"].get_local_rank() == 0
        full = _full_state_dict(recipe.model_parts)
        return {"error": None, "stats": _stats(export), "path": export.path, "steps": recipe.step_scheduler.step,
                "full": full if first_of_stage else None, "mmlu": _mmlu_run(last),
                "full_step_1": at_step_1["full"] if first_of_stage else None, "mmlu_step_1": at_step_1["mmlu"],
                "mmlu_steps": [m["step"] for m in results.get("mmlu_during_training", [])], "lengths": lengths}
    except Exception:  # reported by the recipe's test
        return {"error": traceback.format_exc()}


def _recipe_case(rank: int, recipe_yaml: str) -> dict:
    """AutoModel's ``train_ft`` with the plugin, from the YAML: 3 steps, MMLU at step 2 and at the
    end, a checkpoint at the last step, the export; then a second recipe resumes from the latest
    checkpoint. A failure is returned (the other cases' results stay usable)."""
    import traceback

    try:
        from nemo_automodel.components.config._arg_parser import parse_args_and_load_config

        from nemo_moe_export.integrations.automodel import MoEExportFinetuneRecipe

        stand_in_for_torch_device_cuda_in_build_model()
        recipe = MoEExportFinetuneRecipe(parse_args_and_load_config(recipe_yaml, argv=[]))
        recipe.setup()
        recipe.run_train_validation_loop()
        results = recipe.moe_export_results
        mesh = recipe.model_parts[0].state_dict()["model.layers.1.mlp.experts.gate_and_up_projs"].device_mesh
        full = _full_state_dict(recipe.model_parts)
        resumed = MoEExportFinetuneRecipe(parse_args_and_load_config(recipe_yaml, argv=[]))
        resumed.setup()  # restores the latest checkpoint, the plugin's MMLU history with it
        return {"error": None, "resumed_step": resumed.step_scheduler.step,
                "resumed_mmlu": resumed.moe_export_results.get("mmlu_during_training"),
                "mmlu_during_training": results["mmlu_during_training"], "mmlu": results["mmlu"],
                "stats": _stats(results["export"]), "path": results["export"].path,
                "mesh": tuple(str(getattr(n, "value", n)) for n in mesh.mesh_dim_names),
                "steps": recipe.step_scheduler.step, "full": full if rank == 0 else None}
    except Exception:  # reported by the recipe's test
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int, root: str, data_dir: str, tok_dir: str, recipe_yaml: str,
            pipelined_yaml: str) -> dict:
    import time

    install_cpu_stand_ins()
    out: dict = {"seconds": {}}
    for case, run in (("deepseek_v3_ep", lambda: _ep_case(rank, "deepseek_v3", root, (data_dir, tok_dir))),
                      ("qwen3_moe_ep", lambda: _ep_case(rank, "qwen3_moe", root, None)),
                      ("deepseek_v3_bf16", lambda: _bf16_case(rank, root)),
                      ("deepseek_v3_pp", lambda: _pp_case(rank, root, (data_dir, tok_dir))),
                      ("recipe", lambda: _recipe_case(rank, recipe_yaml)),
                      ("recipe_pp", lambda: _pipelined_recipe_case(rank, pipelined_yaml))):
        started = time.perf_counter()
        out[case] = run()
        out["seconds"][case] = time.perf_counter() - started
    return out


# --------------------------------------------------------------------------------------------------
# Fixtures: one spawn; AutoModel's own checkpoints as the references
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("automodel")
    data_dir, tok_dir = str(root / "mmlu"), str(root / "tok")
    write_mmlu_csvs(data_dir, subjects=MMLU_SUBJECTS)
    build_tokenizer().save_pretrained(tok_dir)
    return {"root": root, "data": data_dir, "tok": tok_dir}


def recipe_yaml(root, data_dir: str, tok_dir: str) -> str:
    """The documented example YAML, on 4 CPU ranks: the tiny model, gloo, local tokenizer and paths;
    the export in the model's dtype (fp32), so it can equal AutoModel's own fp32 checkpoint."""
    import yaml

    with open(os.path.join(ROOT, "examples", "automodel_moe_export.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["dist_env"]["backend"] = "gloo"
    cfg["model"] = {"_target_": "test_automodel.recipe_model"}
    cfg["distributed"]["mp_policy"] = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
                                       "param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": "float32"}
    cfg["dataset"]["tokenizer"] = {"_target_": "transformers.PreTrainedTokenizerFast.from_pretrained",
                                   "pretrained_model_name_or_path": tok_dir}
    cfg["checkpoint"]["checkpoint_dir"] = str(root / "recipe")
    cfg["moe_export"]["mmlu"]["data_path"] = data_dir
    del cfg["moe_export"]["export"]["dtype"]
    path = str(root / "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    # PP2 x EP2 x FSDP2: AutoPipeline's 1F1B over 2 microbatches; MMLU after every step (the batches'
    # lengths change between steps on one pipeline and not the other) and at the end, the export
    cfg["model"] = {"_target_": "test_automodel.recipe_model_4_layers"}
    cfg["distributed"].update(pp_size=2, pipeline={"pp_schedule": "1f1b", "pp_microbatch_size": 1,
                                                   "patch_inner_model": False, "patch_causal_lm_model": False})
    cfg["step_scheduler"].update(local_batch_size=2, global_batch_size=4)
    cfg["checkpoint"] = {"enabled": False, "checkpoint_dir": str(root / "recipe_pp")}
    cfg["moe_export"] = {"mmlu": {**cfg["moe_export"]["mmlu"], "every_n_steps": 1}, "export": {}}
    pipelined = str(root / "recipe_pp.yaml")
    with open(pipelined, "w") as f:
        yaml.safe_dump(cfg, f)
    return path, pipelined


@pytest.fixture(scope="module")
def ranks(inputs):
    out = str(inputs["root"] / "exports")
    os.makedirs(out)
    recipe, pipelined = recipe_yaml(inputs["root"], inputs["data"], inputs["tok"])
    return spawn(_worker, WORLD, out, inputs["data"], inputs["tok"], recipe, pipelined, timeout_s=600,
                 pg_timeout_s=120)


def automodel_reference(family: str, layers: int, full: dict[str, torch.Tensor], directory: str,
                        dtype: torch.dtype = torch.float32):
    """AutoModel's own HF checkpoint of ``full``: its model (built in ``dtype``) loads the weights,
    its adapter's ``to_hf`` names them, safetensors saves them. Returns the loaded (unsharded) model."""
    from safetensors.torch import save_file

    model = build(family, layers, seed=3, dtype=dtype)
    model.load_state_dict(full, strict=True)
    hf = model.state_dict_adapter.to_hf(model.state_dict())
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    return model


def read_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def tensor_bytes_on_disk(directory: str) -> int:
    """Each file's size less its header: the tensor bytes the files hold."""
    total = 0
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        total += os.path.getsize(path) - 8 - header_len
    return total


def assert_same_checkpoint(ours: str, reference: str) -> None:
    got, want = read_checkpoint(ours), read_checkpoint(reference)
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys()))
    for key in want:
        assert got[key].dtype == want[key].dtype, (key, got[key].dtype, want[key].dtype)
        assert got[key].shape == want[key].shape and torch.equal(got[key], want[key]), key


def merged_full(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for key, t in (r["full"] or {}).items():
            assert key not in full or torch.equal(full[key], t), key
            full[key] = t
    return full


@pytest.fixture(scope="module")
def references(ranks, inputs):
    refs = {}
    for case, family, layers in (("deepseek_v3_ep", "deepseek_v3", 2), ("qwen3_moe_ep", "qwen3_moe", 2),
                                 ("deepseek_v3_bf16", "deepseek_v3", 2), ("deepseek_v3_pp", "deepseek_v3", 4),
                                 ("recipe", "deepseek_v3", 2), ("recipe_pp", "deepseek_v3", 4)):
        if any(r[case].get("error") for r in ranks):
            continue
        directory = str(inputs["root"] / "reference" / case)
        dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
        refs[case] = (directory, automodel_reference(family, layers, merged_full([r[case] for r in ranks]), directory,
                                                     dtype))
    if "recipe_pp" in refs:  # the pipelined recipe's weights at step 1, when it evaluated between steps
        directory = str(inputs["root"] / "reference" / "recipe_pp_step_1")
        at_step_1 = [{"full": r["recipe_pp"]["full_step_1"]} for r in ranks]
        refs["recipe_pp_step_1"] = (directory, automodel_reference("deepseek_v3", 4, merged_full(at_step_1), directory))
    return refs


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


EXPORT_CASES = ("deepseek_v3_ep", "qwen3_moe_ep", "deepseek_v3_bf16", "deepseek_v3_pp")


def test_parallelizer_lays_experts_out_on_its_ep_shard_ep_mesh(ranks):
    for case in ("deepseek_v3_ep", "qwen3_moe_ep"):
        assert all(r[case]["placement"] == (("ep_shard", "ep"), ("Shard(dim=1)", "Shard(dim=0)")) for r in ranks)


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_equals_automodels_own_hf_checkpoint(ranks, references, case):
    directory, _ = references[case]
    assert_same_checkpoint(ranks[0][case]["path"], directory)


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_every_tensor_byte_is_written_once(ranks, case):
    path = ranks[0][case]["path"]
    written = sum(r[case]["stats"]["rank_bytes_written"] for r in ranks)
    assert written == ranks[0][case]["stats"]["checkpoint_bytes"] == tensor_bytes_on_disk(path)
    assert all(r[case]["stats"]["rank_bytes_written"] > 0 for r in ranks)


@pytest.mark.parametrize("case", ("deepseek_v3_ep", "qwen3_moe_ep"))
def test_config_json_and_dtypes_are_transformers_save_pretrained_s(ranks, case, tmp_path):
    """The AutoModel door (EP2 x FSDP2): config.json and every tensor's dtype are what transformers'
    save_pretrained writes for the same weights, in the model's fp32 and exported in bf16, where
    transformers keeps DeepSeek-V3's router gate.weight in fp32 (AutoModel's class names only
    e_score_correction_bias; docs/design.md#serving-engines)."""
    from transformers import AutoModelForCausalLM

    from checks import assert_serving_config, stored_tensors

    path = ranks[0][case]["path"]
    for dtype in ("float32", "bfloat16"):
        AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).save_pretrained(tmp_path / dtype)
    assert_serving_config(path, str(tmp_path / "float32"))
    assert_serving_config(path + "_as_bf16", str(tmp_path / "bfloat16"))
    if case == "deepseek_v3_ep":
        assert stored_tensors(path + "_as_bf16")["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_bf16_export_keeps_automodels_dtypes(references):
    """The bf16 case compares bf16 tensors (and the fp32 correction bias AutoModel keeps), not fp32 ones."""
    reference = read_checkpoint(references["deepseek_v3_bf16"][0])
    dtypes = {k: t.dtype for k, t in reference.items()}
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert sum(d == torch.bfloat16 for d in dtypes.values()) == len(dtypes) - 1


@pytest.mark.parametrize("case", ("deepseek_v3_ep", "qwen3_moe_ep"))
def test_transformers_loads_the_export_with_automodels_logits(ranks, case):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ranks[0][case]["path"], dtype=torch.float32)
    probe, _ = token_batch(seed=100)
    with torch.no_grad():
        logits = hf(probe).logits
    sharded = ranks[0][case]["logits"]
    assert sharded.abs().max() > 1.0  # not a degenerate model
    check_figure(relative_error(logits, sharded), FP32_LOGITS, f"{case}: transformers vs AutoModel sharded")


def test_pipeline_export_loads_in_transformers_with_automodels_logits(ranks, references):
    """Under PP the reference forward is AutoModel's single-process model holding the gathered stages."""
    from transformers import AutoModelForCausalLM

    _, automodel = references["deepseek_v3_pp"]
    hf = AutoModelForCausalLM.from_pretrained(ranks[0]["deepseek_v3_pp"]["path"], dtype=torch.float32)
    probe, _ = token_batch(seed=100)
    with torch.no_grad():
        check_figure(relative_error(hf(probe).logits, automodel(probe).logits), FP32_LOGITS,
                     "PP export: transformers vs AutoModel")


def test_autopipeline_stages_keep_global_layer_names_and_trained(ranks):
    by_pp = {r["deepseek_v3_pp"]["pp_rank"]: r["deepseek_v3_pp"]["keys"] for r in ranks}
    layers = {pp: sorted({k.split(".")[2] for k in keys if k.startswith("model.layers.")})
              for pp, keys in by_pp.items()}
    assert layers == {0: ["0", "1"], 1: ["2", "3"]}
    assert "model.embed_tokens.weight" in by_pp[0] and "lm_head.weight" in by_pp[1]
    assert [r["deepseek_v3_pp"]["trained"] for r in ranks if r["deepseek_v3_pp"]["pp_rank"] == 1] == [True, True]


@pytest.mark.parametrize("case", ("deepseek_v3_ep", "qwen3_moe_ep"))
def test_from_hf_into_the_sharded_automodel_model_reproduces_every_parameter(ranks, case):
    for r in ranks:
        assert r[case]["differed_before_load"] > 0  # the fresh model's weights were others
        assert r[case]["still_different"] == []
        assert r[case]["bytes_read"] < r[case]["stats"]["checkpoint_bytes"]  # only this rank's slices


def single_process_mmlu(model, inputs, **options):
    """MMLU of AutoModel's unsharded model in this process, one question per forward."""
    from transformers import PreTrainedTokenizerFast

    from nemo_moe_export.evaluate.evaluator import evaluate_mmlu
    from nemo_moe_export.integrations.automodel import AutoModelCausalLM

    test, dev = load_split_data(inputs["data"])
    tok = PreTrainedTokenizerFast.from_pretrained(inputs["tok"])
    want = evaluate_mmlu(AutoModelCausalLM(model), tok, test, dev, **{**MMLU_OPTS, **options, "batch_size": 1})
    assert len(set(want.predictions)) > 1  # answers depend on the question
    return want


def assert_same_mmlu(got: dict, want, what: str) -> None:
    judge_answers(got, {"pred": want.predictions, "scores": [r["scores"] for r in want.records]}, what)
    assert got["shared_prefix"].startswith("off: ")


def test_mmlu_through_automodels_forward_equals_a_single_process_run(ranks, references, inputs):
    want = single_process_mmlu(references["deepseek_v3_ep"][1], inputs)
    assert ranks[0]["deepseek_v3_ep"]["mmlu"]["layout"] == ((0, 1, 2, 3), (0, 1), (0, 2))
    for r in ranks:
        for policy in ("lockstep", "expert_dp"):
            assert_same_mmlu(r["deepseek_v3_ep"]["mmlu"][policy], want, policy)


def test_mmlu_through_autopipelines_schedule_equals_a_single_process_run(ranks, references, inputs):
    """PP2 x EP2 x FSDP2: every rank (both stages of both pipelines) gets the single-process predictions."""
    want = single_process_mmlu(references["deepseek_v3_pp"][1], inputs)
    for r in ranks:
        assert_same_mmlu(r["deepseek_v3_pp"]["mmlu"], want, f"pp rank {r['deepseek_v3_pp']['pp_rank']}")


def test_mmlu_under_pipeline_stages_runs_in_autopipelines_schedule_eval(ranks):
    """Every stage forward of the evaluation ran in AutoPipeline's own PipelineStage inside a
    forward-only step of its schedule: one eval step per call, its microbatches in order (the stage's
    fwd_cache 0, 1, ... as each starts). After it AutoPipeline is shaped for training again (its
    microbatch rows and the length of the last training step) and its schedule trains."""
    for r in ranks:
        case = r["deepseek_v3_pp"]
        n, forwards = case["n_microbatches"], case["mmlu_forwards"]
        stage = case["pp_rank"]
        assert n == 2 and forwards and len(forwards) % n == 0
        assert forwards == [(stage, False, i) for _ in range(len(forwards) // n) for i in range(n)]
        assert case["after_mmlu"] == (1, SEQ, True)


def test_autopipelines_schedule_gives_automodels_logits_for_rows_it_pads(ranks, references):
    """3 rows over 2 microbatches (a padding row dropped), every position kept, on every rank."""
    _, automodel = references["deepseek_v3_pp"]
    for r in ranks:
        for ids, logits in r["deepseek_v3_pp"]["forwards_after"]:
            with torch.no_grad():
                want = automodel(ids).logits
            assert logits.dtype == want.dtype == torch.float32
            assert logits.shape == want.shape == (3, ids.shape[1], VOCAB)
            check_figure(relative_error(logits, want), FP32_LOGITS, f"pp rank {r['deepseek_v3_pp']['pp_rank']}")


def test_autopipeline_trains_on_after_an_evaluation_with_the_losses_of_its_weights(ranks, references):
    """After MMLU, AutoPipeline's next 1F1B step (one pipeline's stages re-shaped to a shorter batch)
    runs, and each microbatch's loss is the single-process model's on the weights MMLU saw."""
    _, automodel = references["deepseek_v3_pp"]
    last_stage = [r["deepseek_v3_pp"]["next_step"] for r in ranks if r["deepseek_v3_pp"]["pp_rank"] == 1]
    assert sorted(ids.shape[1] for ids, _, _ in last_stage) == [SEQ - 3, SEQ]
    for ids, labels, losses in last_stage:
        with torch.no_grad():  # one row per microbatch (pp_microbatch_size 1)
            want = [cross_entropy(automodel(ids[i:i + 1]).logits, labels[i:i + 1]).item() for i in range(len(ids))]
        assert len(losses) == len(want)
        check_close(losses, want, FP32_SCORES, "AutoPipeline's microbatch losses")


def test_train_ft_recipe_with_the_plugin_trains_evaluates_exports_and_verifies(ranks, references, inputs):
    from nemo_moe_export.export import verify_checkpoint

    errors = [r["recipe"]["error"] for r in ranks if r["recipe"]["error"]]
    assert not errors, errors[0]
    runs = [r["recipe"] for r in ranks]
    assert all(run["steps"] == 3 and run["mesh"] == ("ep_shard", "ep") for run in runs)
    n_questions = sum(MMLU_SUBJECTS.values())
    for run in runs:  # every rank records the same evaluations: at step 2 (every_n_steps) and at the end
        assert [m["step"] for m in run["mmlu_during_training"]] == [2]
        assert run["mmlu"] == runs[0]["mmlu"] and run["mmlu"]["overall"]["n"] == n_questions
    assert os.path.exists(os.path.join(inputs["root"], "recipe", "mmlu", "mmlu_results.json"))  # <checkpoint_dir>/mmlu
    path = runs[0]["path"]
    assert path == os.path.join(str(inputs["root"]), "recipe", "hf")
    assert verify_checkpoint(path).ok
    written = sum(run["stats"]["rank_bytes_written"] for run in runs)
    assert written == runs[0]["stats"]["checkpoint_bytes"] == tensor_bytes_on_disk(path)
    directory, _ = references["recipe"]
    assert_same_checkpoint(path, directory)  # the trained weights, as AutoModel's own adapter writes them
    # and as AutoModel's own final checkpoint wrote them (its per-rank shards, then consolidated)
    assert_same_checkpoint(path, os.path.join(inputs["root"], "recipe", "epoch_0_step_2", "model", "consolidated"))
    initial = build("deepseek_v3").state_dict()
    trained = merged_full(runs)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)  # three steps moved the weights


CONVERT_WORLDS = (2, 3, 4)  # with the parent's own conversion: 1 to 4 ranks


def _convert_automodel(rank: int, world: int, src: str, root: str, config: str) -> dict:
    """One launch of 4 ranks for every rank count: the first n ranks convert as a group of n."""
    import torch.distributed as dist

    from nemo_moe_export.convert.engine import convert_checkpoint

    results = {}
    for n in CONVERT_WORLDS:
        group = dist.new_group(list(range(n)))  # every rank of the world makes every group
        if rank < n:
            result = convert_checkpoint(src, os.path.join(root, f"converted-{n}"), config=config, group=group,
                                        progress_s=None)
            results[n] = {"read": result.rank_bytes_read, "written": result.rank_bytes_written}
    return results


def test_convert_of_automodels_own_checkpoint_equals_the_export(ranks, inputs):
    """AutoModel's own checkpoint of the recipe's last step (its per-rank HF-keyed safetensors shards
    in ``model/``, DCP's sharding records in their headers) converted on 1, 2, 3 and 4 ranks, no model
    built (docs/convert.md): the same files, tensor for tensor, as our export of those weights;
    the ranks read exactly the shards' tensor bytes."""
    from nemo_moe_export.convert.engine import convert_checkpoint

    errors = [r["recipe"]["error"] for r in ranks if r["recipe"]["error"]]
    assert not errors, errors[0]
    root = str(inputs["root"])
    src, export = os.path.join(root, "recipe", "epoch_0_step_2"), os.path.join(root, "recipe", "hf")
    one = convert_checkpoint(src, os.path.join(root, "converted-1"), config=export, progress_s=None)
    assert one.format == "automodel"
    assert_same_checkpoint(os.path.join(root, "converted-1"), export)
    assert one.rank_bytes_read == tensor_bytes_on_disk(os.path.join(src, "model"))
    assert one.rank_bytes_written == tensor_bytes_on_disk(export)
    launched = spawn(_convert_automodel, max(CONVERT_WORLDS), src, root, export)
    for n in CONVERT_WORLDS:
        assert_same_checkpoint(os.path.join(root, f"converted-{n}"), export)
        assert sum(r[n]["read"] for r in launched[:n]) == one.rank_bytes_read, n
        assert sum(r[n]["written"] for r in launched[:n]) == one.rank_bytes_written, n


def test_train_ft_resume_restores_the_plugins_mmlu_history(ranks):
    runs = [r["recipe"] for r in ranks]
    assert not any(run["error"] for run in runs)
    for run in runs:  # the last step's checkpoint; the evaluation at step 2 came back with it, as rank 0 saved it
        assert run["resumed_step"] == 3
        assert run["resumed_mmlu"] == runs[0]["mmlu_during_training"] and len(run["resumed_mmlu"]) == 1


def test_train_ft_under_pipeline_stages_evaluates_and_exports_what_automodel_writes(ranks, references, inputs):
    errors = [r["recipe_pp"]["error"] for r in ranks if r["recipe_pp"]["error"]]
    assert not errors, errors[0]
    runs = [r["recipe_pp"] for r in ranks]
    # evaluations between 1F1B steps (every_n_steps: 1), and training went on after each
    assert all(run["steps"] == 3 and run["mmlu_steps"] == [1, 2, 3] for run in runs)
    # after an evaluation, some step re-shaped AutoPipeline's stages on one pipeline and not the other
    changes = {tuple(a != b for a, b in zip(run["lengths"], run["lengths"][1:])) for run in runs}
    assert len(changes) > 1, changes
    import yaml

    with open(os.path.join(ROOT, "examples", "automodel_moe_export.yaml")) as f:
        k_shot = yaml.safe_load(f)["moe_export"]["mmlu"]["k_shot"]  # the recipe's, not this file's
    at_step_1 = single_process_mmlu(references["recipe_pp_step_1"][1], inputs, k_shot=k_shot)
    want = single_process_mmlu(references["recipe_pp"][1], inputs, k_shot=k_shot)  # the final weights
    for run in runs:  # through AutoPipeline's schedule: between steps 1 and 2, and at the end
        assert_same_mmlu(run["mmlu_step_1"], at_step_1, "recipe_pp at step 1")
        assert_same_mmlu(run["mmlu"], want, "recipe_pp")
    path = runs[0]["path"]
    assert path == os.path.join(str(inputs["root"]), "recipe_pp", "hf")
    assert sum(run["stats"]["rank_bytes_written"] for run in runs) == tensor_bytes_on_disk(path)
    directory, _ = references["recipe_pp"]
    assert_same_checkpoint(path, directory)


def test_recipe_settings_default_their_folders_and_refuse_what_cannot_run():
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.integrations.automodel import recipe_settings

    settings = recipe_settings({"mmlu": {"data_path": "d", "every_n_steps": 5}, "export": {"dtype": "bfloat16"}},
                               "/ckpt")
    assert settings == {"mmlu": {"output_dir": "/ckpt/mmlu", "data_path": "d", "every_n_steps": 5},
                        "export": {"output_dir": "/ckpt/hf", "dtype": "bfloat16"}}
    assert recipe_settings({"export": {"output_dir": "/out"}}, "/ckpt") == {"export": {"output_dir": "/out"}}
    with pytest.raises(InputError, match="unknown moe_export settings.*moe_export.mmlu_eval"):
        recipe_settings({"mmlu_eval": {}}, "/ckpt")
    with pytest.raises(InputError, match="moe_export section of the recipe YAML is not a mapping"):
        recipe_settings(["mmlu"], "/ckpt")
