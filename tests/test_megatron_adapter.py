"""The megatron-core tables, by name, in one process: every experts layout megatron-core has
(``SequentialMLP``, Transformer Engine's grouped ``linear_fc1.weight{i}``, the legacy
``GroupedMLP``'s transposed ``weight1``/``weight2``), TE's fused norm names, Qwen3's interleaved
``linear_qkv`` and the local-to-global expert ids of each EP rank.

State dicts are megatron-core names with random values (TE and grouped-gemm do not install here; the
real local-spec model is tested on gloo ranks in ``test_megatron_models.py``). What the adapter
writes is compared with ``tests/megatron_reference.py`` (the tests' own per-key conversion), and
the HF names and shapes with ``save_pretrained`` of the same HF config.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_reference import hf_tensors
from nemo_moe_export.adapters import InMemoryFormat, LocalExperts, get_adapter
from nemo_moe_export.errors import InputError

H, VOCAB, DENSE_FFN, FFN = 16, 20, 24, 6
EP = 2

DSV3 = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=DENSE_FFN, moe_intermediate_size=FFN,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
            first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=2)
QWEN3 = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=DENSE_FFN, moe_intermediate_size=FFN,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts_per_tok=2,
             mlp_only_layers=[0])


def _attention(family: str, te: bool) -> dict[str, tuple[int, ...]]:
    if family == "qwen3_moe":
        out = {"self_attention.linear_qkv.weight": (2 * (2 + 2) * 4, H), "self_attention.q_layernorm.weight": (4,),
               "self_attention.k_layernorm.weight": (4,), "self_attention.linear_proj.weight": (H, 16)}
        out["self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"] = (H,)
        return out
    out = {"input_layernorm.weight": (H,), "self_attention.linear_q_down_proj.weight": (8, H),
           "self_attention.linear_q_up_proj.weight": (4 * 8, 8), "self_attention.linear_kv_down_proj.weight": (8 + 4, H),
           "self_attention.linear_kv_up_proj.weight": (4 * 8, 8), "self_attention.linear_proj.weight": (H, 4 * 4)}
    if te:
        out |= {"self_attention.linear_q_up_proj.layer_norm_weight": (8,),
                "self_attention.linear_kv_up_proj.layer_norm_weight": (8,)}
    else:
        out |= {"self_attention.q_layernorm.weight": (8,), "self_attention.kv_layernorm.weight": (8,)}
    return out


def _experts(layout: str, n_local: int) -> dict[str, tuple[int, ...]]:
    if layout == "sequential":
        return {name: shape for i in range(n_local) for name, shape in (
            (f"mlp.experts.local_experts.{i}.linear_fc1.weight", (2 * FFN, H)),
            (f"mlp.experts.local_experts.{i}.linear_fc2.weight", (H, FFN)))}
    if layout == "te_grouped":
        return {name: shape for i in range(n_local) for name, shape in (
            (f"mlp.experts.linear_fc1.weight{i}", (2 * FFN, H)), (f"mlp.experts.linear_fc2.weight{i}", (H, FFN)))}
    return {"mlp.experts.weight1": (H, n_local * 2 * FFN), "mlp.experts.weight2": (n_local * FFN, H)}


def megatron_state(family: str, layout: str, te: bool, n_experts: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """One EP rank's megatron-core state dict: layer 0 dense, layer 1 MoE (with TE, the dense MLP's
    norm is fused into ``linear_fc1``); values depend on the rank, so experts differ across ranks."""
    shapes = {"embedding.word_embeddings.weight": (VOCAB, H), "decoder.final_layernorm.weight": (H,),
              "output_layer.weight": (VOCAB, H)}
    dense = {"mlp.linear_fc1.weight": (2 * DENSE_FFN, H), "mlp.linear_fc2.weight": (H, DENSE_FFN),
             ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"): (H,)}
    moe = {"pre_mlp_layernorm.weight": (H,), "mlp.router.weight": (n_experts, H),
           **_experts(layout, n_experts // EP)}
    if family == "deepseek_v3":
        moe |= {"mlp.router.expert_bias": (n_experts,), "mlp.shared_experts.linear_fc1.weight": (2 * FFN, H),
                "mlp.shared_experts.linear_fc2.weight": (H, FFN)}
    for layer, parts in ((0, {**_attention(family, te), **dense}), (1, {**_attention(family, te), **moe})):
        shapes |= {f"decoder.layers.{layer}.{k}": v for k, v in parts.items()}
    g = torch.Generator().manual_seed(ep_rank)
    state = {k: torch.randn(v, generator=g) for k, v in shapes.items()}
    state["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1._extra_state"] = None  # TE/megatron metadata
    return state


def hf_config(family: str, n_experts: int, by_ep_rank=None, ep_rank: int = 0):
    from nemo_moe_export.megatron.hf_config import MegatronDeepseekV3Config, MegatronQwen3MoeConfig

    if family == "deepseek_v3":
        config = MegatronDeepseekV3Config(**DSV3, n_routed_experts=n_experts)
    else:
        config = MegatronQwen3MoeConfig(**QWEN3, num_experts=n_experts)
    n_local = n_experts // EP
    by_ep_rank = by_ep_rank or tuple(tuple(range(r * n_local, (r + 1) * n_local)) for r in range(EP))
    config.in_memory_format = InMemoryFormat("megatron_core", {"decoder.layers.1.mlp": LocalExperts(by_ep_rank, ep_rank)})
    return config


def _tensors(state):
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def saved_names(tmp_path_factory):
    """HF names and shapes ``save_pretrained`` writes for each family's stock config."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    out = {}
    for family, config in (("deepseek_v3", DeepseekV3Config(**DSV3, n_routed_experts=6)),
                           ("qwen3_moe", Qwen3MoeConfig(**QWEN3, num_experts=6))):
        path = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            out[family] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return out


CASES = [(f, layout, te) for f in ("deepseek_v3", "qwen3_moe") for layout, te in
         (("sequential", False), ("te_grouped", True), ("legacy_grouped", False))]


@pytest.mark.parametrize("family,layout,te", CASES, ids=[f"{f}-{lay}{'-te' if te else ''}" for f, lay, te in CASES])
def test_each_ep_rank_maps_its_experts_to_their_global_ids(family, layout, te, saved_names):
    """Per EP rank: the pieces are the reference conversion (views of the rank's tensors), the
    global names and shapes are save_pretrained's, and from_hf of the whole checkpoint rebuilds
    the rank's tensors exactly."""
    n_experts = 6
    states = [megatron_state(family, layout, te, n_experts, r) for r in range(EP)]
    references = [hf_tensors(s, family=family, ep_rank=r, n_local=n_experts // EP, hidden=H, heads=4,
                             kv_heads=2, head_dim=4) for r, s in enumerate(states)]
    checkpoint = {k: v for ref in references for k, v in ref.items()}  # dense tensors of rank 1 win
    for rank, state in enumerate(states):
        adapter = get_adapter(hf_config(family, n_experts, ep_rank=rank))
        tensors = _tensors(state)
        metadata = adapter.hf_metadata(tensors)
        assert {k: m.shape for k, m in metadata.items()} == saved_names[family]
        pieces = adapter.to_hf(tensors)
        assert set(pieces) == set(references[rank])
        for key, piece in pieces.items():
            want = references[rank][key]
            assert tuple(piece.tensor.shape) == piece.global_shape and piece.tensor.dtype == want.dtype and torch.equal(piece.tensor, want), key
            source = tensors[piece.source_key]
            is_view = piece.tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
            assert is_view or key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")), key
        loaded = {k: torch.zeros_like(v) for k, v in tensors.items()}
        adapter.from_hf(loaded, checkpoint | references[rank])  # this rank's dense copies, every expert
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors), family


def test_expert_ids_come_from_the_model_not_the_rank():
    """A model whose EP ranks hold experts in another order (rank 0 holds 3..5) is written so."""
    state = _tensors(megatron_state("qwen3_moe", "sequential", False, 6, 0))
    adapter = get_adapter(hf_config("qwen3_moe", 6, by_ep_rank=((3, 4, 5), (0, 1, 2)), ep_rank=0))
    pieces = adapter.to_hf(state)
    fc1 = state["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(pieces["model.layers.1.mlp.experts.3.gate_proj.weight"].tensor, fc1[:FFN])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in pieces
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in adapter.hf_metadata(state)  # every rank lists all


@pytest.mark.parametrize("case,pattern", [
    ("overlapping_ids", "do not number every expert exactly once"),
    ("no_local_experts", "does not know which experts this rank holds"),
    ("unknown_key", "no rule maps this in-memory key"),
    ("wrong_weight1", "cannot view the tensor as 3 experts"),
    ("local_index_too_large", "local expert index beyond"),
])
def test_bad_megatron_inputs_are_refused_before_anything_is_read(case, pattern):
    state = _tensors(megatron_state("deepseek_v3", "sequential", False, 6, 0))
    config = hf_config("deepseek_v3", 6)
    if case == "overlapping_ids":
        config = hf_config("deepseek_v3", 6, by_ep_rank=((0, 1, 2), (0, 1, 2)))
    elif case == "no_local_experts":
        config.in_memory_format = InMemoryFormat("megatron_core", {})
    elif case == "unknown_key":
        state["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(3)
    elif case == "wrong_weight1":
        state = _tensors(megatron_state("deepseek_v3", "legacy_grouped", False, 6, 0))
        state["decoder.layers.1.mlp.experts.weight1"] = torch.zeros(H, 5)
    else:
        state["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] = torch.zeros(2 * FFN, H)
    with pytest.raises(InputError, match=pattern):
        get_adapter(config).hf_metadata(state)


def test_config_json_is_the_stock_class_and_the_adapter_uses_the_megatron_table(tmp_path):
    from transformers import AutoConfig, Qwen3MoeConfig

    config = hf_config("qwen3_moe", 6)
    assert get_adapter(config).table.model_types == ("megatron_core:qwen3_moe",)
    assert get_adapter(Qwen3MoeConfig(**QWEN3, num_experts=6)).table.model_types == ("qwen3_moe",)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "in_memory_format" not in written and written["model_type"] == "qwen3_moe"
    assert type(AutoConfig.from_pretrained(tmp_path)) is Qwen3MoeConfig


def test_only_the_cpu_recipe_applies_the_cuda_stand_ins():
    """The product code calls megatron-core as it is: of the package, only the recipe's CPU path
    imports ``cpu_patches`` (the tests apply it themselves)."""
    import re
    from pathlib import Path

    import nemo_moe_export

    root = Path(nemo_moe_export.__file__).parent
    imports_it = re.compile(r"^\s*(from \S+ )?import [^\n]*\bcpu_patches\b", re.M)  # any import form
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if p.name != "cpu_patches.py" and imports_it.search(p.read_text()))
    assert users == ["megatron/recipe.py"]
    assert not imports_it.search("x = 'cpu_patches'") and imports_it.search("from a import b, cpu_patches")
