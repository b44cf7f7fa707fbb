"""The tests' own megatron-core -> HF conversion, key by key, written apart from the adapter's tables.

It follows megatron-core 0.16.1's source (``mlp.py``: ``chunk(x, 2)`` gives gate then up;
``experts.py``: ``GroupedMLP`` views ``weight1`` as [L, H, 2F] and ``weight2`` as [L, F, H];
``attention.py``: ``linear_qkv`` holds per query group its query heads, then k, then v) and
Megatron-Bridge's names. A rank's local expert ``i`` is global expert ``ep_rank * n_local + i``,
derived here from the rank (the adapter reads the model's own ``local_expert_indices`` instead), so
the two can disagree. ``torch.chunk`` is the reference split.
"""

from __future__ import annotations

import re
import zlib

import torch

NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": None,  # family-specific, below
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
}


def hf_tensors(state: dict, *, family: str, ep_rank: int, n_local: int, hidden: int, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 8) -> dict[str, torch.Tensor]:
    """HF tensors of one rank's megatron-core state dict (``_extra_state`` entries skipped)."""
    out: dict[str, torch.Tensor] = {}
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    for key, t in state.items():
        if key.endswith("_extra_state"):
            continue
        if key in top:
            out[top[key]] = t
            continue
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        assert m, f"unexpected megatron key {key}"
        layer, rest = f"model.layers.{m[1]}", m[2]
        for name, value in _layer_tensor(rest, t, family, ep_rank, n_local, hidden, heads, kv_heads, head_dim):
            out[f"{layer}.{name}"] = value
    return out


def _layer_tensor(rest, t, family, ep_rank, n_local, hidden, heads, kv_heads, head_dim):
    if rest == "self_attention.q_layernorm.weight":
        return [("self_attn.q_a_layernorm.weight" if family == "deepseek_v3" else "self_attn.q_norm.weight", t)]
    if NAMES.get(rest):
        return [(NAMES[rest], t)]
    if rest == "self_attention.linear_qkv.weight":
        per_group = t.view(kv_heads, (heads // kv_heads + 2) * head_dim, -1)
        q_rows = heads // kv_heads * head_dim
        return [("self_attn.q_proj.weight", per_group[:, :q_rows].reshape(-1, t.shape[-1])),
                ("self_attn.k_proj.weight", per_group[:, q_rows:q_rows + head_dim].reshape(-1, t.shape[-1])),
                ("self_attn.v_proj.weight", per_group[:, q_rows + head_dim:].reshape(-1, t.shape[-1]))]
    for mlp in ("mlp", "mlp.shared_experts"):
        if rest == f"{mlp}.linear_fc1.weight":
            gate, up = torch.chunk(t, 2, dim=0)
            return [(f"{mlp}.gate_proj.weight", gate), (f"{mlp}.up_proj.weight", up)]
        if rest == f"{mlp}.linear_fc2.weight":
            return [(f"{mlp}.down_proj.weight", t)]
    return _expert_tensor(rest, t, ep_rank, n_local, hidden)


def _expert_tensor(rest, t, ep_rank, n_local, hidden):
    first = ep_rank * n_local
    m = (re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc(\d)\.weight", rest)
         or re.fullmatch(r"mlp\.experts\.linear_fc(?P<fc>\d)\.weight(?P<i>\d+)", rest))
    if m is not None:
        i, fc = (int(m[1]), m[2]) if "local_experts" in rest else (int(m["i"]), m["fc"])
        per = f"mlp.experts.{first + i}"
        if fc == "1":
            gate, up = torch.chunk(t, 2, dim=0)
            return [(f"{per}.gate_proj.weight", gate), (f"{per}.up_proj.weight", up)]
        return [(f"{per}.down_proj.weight", t)]
    if rest == "mlp.experts.weight1":
        w = t.view(n_local, hidden, -1)
        out = []
        for i in range(n_local):
            gate, up = torch.chunk(w[i], 2, dim=1)
            out += [(f"mlp.experts.{first + i}.gate_proj.weight", gate.t()), (f"mlp.experts.{first + i}.up_proj.weight", up.t())]
        return out
    if rest == "mlp.experts.weight2":
        w = t.view(n_local, -1, hidden)
        return [(f"mlp.experts.{first + i}.down_proj.weight", w[i].t()) for i in range(n_local)]
    raise AssertionError(f"no conversion for megatron key ...{rest}")


def global_name(key: str, ep_rank: int, n_local: int) -> str:
    """A megatron-core key with its local expert index replaced by the global id (the tests' derivation)."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"experts.{ep_rank * n_local + int(m[1])}.", key)


def fill_by_global_name(gpt_model, *, ep_rank: int, n_local: int, seed: int = 0) -> None:
    """Give every tensor of a megatron-core model a value drawn from its global name: norms around 1,
    router biases small, the rest N(0, 0.2) (large enough that answers depend on the question)."""
    with torch.no_grad():
        for key, t in gpt_model.state_dict().items():
            if not isinstance(t, torch.Tensor) or key.endswith("_extra_state"):
                continue
            t.copy_(value_by_name(key, global_name(key, ep_rank, n_local), t, seed))


def value_by_name(key: str, name: str, like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The value ``fill_by_global_name`` gives the tensor ``key`` (global name ``name``): norms around 1,
    router biases small, the rest N(0, 0.2), drawn from the name."""
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    noise = torch.randn(like.shape, generator=g)
    if "norm" in key.rsplit(".", 1)[0].rsplit(".", 1)[-1] or key.endswith("layer_norm_weight"):
        value = 1.0 + 0.1 * noise
    elif key.endswith("expert_bias"):
        value = 0.02 * noise
    else:
        value = 0.2 * noise
    return value.to(like.dtype)
