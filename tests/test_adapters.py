"""Single-process adapter behaviour: tables, layouts, and every refusal of bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_moe_export.adapters import get_adapter, supported_model_types
from nemo_moe_export.errors import InputError
from nemo_moe_export.tiny_models import tiny_model
from checks import to_grouped_layout


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    model = tiny_model("deepseek_v3", n_experts=5)
    path = tmp_path_factory.mktemp("ds")
    model.save_pretrained(path)
    return model, str(path)


def _snapshot(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def _unchanged(sd, before):
    return all(torch.equal(v, before[k]) for k, v in sd.items())


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "kimi_linear"])
def test_unsharded_to_hf_equals_save_pretrained(family, tmp_path):
    model = tiny_model(family, n_experts=3, seed=3)
    model.save_pretrained(tmp_path)
    ref = load_file(tmp_path / "model.safetensors")
    adapter = get_adapter(model.config)
    pieces = adapter.to_hf(model.state_dict())
    assert set(pieces) == set(ref)
    for key, piece in pieces.items():
        assert tuple(piece.tensor.shape) == piece.global_shape and piece.primary and torch.equal(piece.tensor, ref[key]), key
    meta = adapter.hf_metadata(model.state_dict())
    assert {k: (m.shape, m.dtype) for k, m in meta.items()} == {k: (tuple(v.shape), v.dtype) for k, v in ref.items()}


def test_tied_embeddings_are_written_once(tmp_path):
    model = tiny_model("qwen3_moe", n_experts=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    ref = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in ref and "lm_head.weight" in model.state_dict()
    pieces = get_adapter(model.config).to_hf(model.state_dict())
    assert set(pieces) == set(ref)
    fresh = tiny_model("qwen3_moe", n_experts=3, tie_word_embeddings=True, seed=9)
    get_adapter(fresh.config).from_hf(fresh.state_dict(), str(tmp_path))
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_grouped_layout_round_trips_through_hf_dict(deepseek):
    model, path = deepseek
    ref = load_file(os.path.join(path, "model.safetensors"))
    grouped = {k: v.clone() for k, v in to_grouped_layout(model.state_dict()).items()}
    adapter = get_adapter(model.config)
    pieces = adapter.to_hf(grouped)
    assert set(pieces) == set(ref)
    for key, piece in pieces.items():
        assert torch.equal(piece.tensor, ref[key]), key
    # HF gate_proj is gate_and_up_projs[e, :, :I].T (docs/design.md#key-names)
    gup = grouped["model.layers.1.mlp.experts.gate_and_up_projs"]
    inter = gup.shape[2] // 2
    assert torch.equal(ref["model.layers.1.mlp.experts.3.gate_proj.weight"], gup[3, :, :inter].T)
    target = {k: torch.zeros_like(v) for k, v in grouped.items()}
    report = adapter.from_hf(target, ref)  # an HF-keyed dict is a source too
    assert _unchanged(target, grouped)
    assert report.expert_bytes_read == sum(v.numel() * 4 for k, v in ref.items() if ".experts." in k)


def test_kimi_k3_style_table_maps_language_model_prefix(deepseek):
    """K3 keeps the text model under ``language_model.`` and names experts w1/w3/w2."""
    model, path = deepseek
    ref = load_file(os.path.join(path, "model.safetensors"))
    sd = {"language_model." + k: v for k, v in model.state_dict().items()}
    adapter = get_adapter({"model_type": "kimi_k3", "num_experts": 5})
    pieces = adapter.to_hf(sd)
    renames = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def k3_name(key):
        key = "language_model." + key
        if ".mlp.experts." in key:
            head, proj, tail = key.rsplit(".", 2)
            key = f"{head}.{renames[proj]}.{tail}"
        return key.replace(".mlp.", ".block_sparse_moe.")  # every layer, as Kimi Linear does

    expected = {k3_name(k): v for k, v in ref.items()}
    assert set(pieces) == set(expected)
    for key, piece in pieces.items():
        assert torch.equal(piece.tensor, expected[key]), key


def test_unknown_model_type_lists_supported():
    with pytest.raises(InputError) as info:
        get_adapter({"model_type": "mixtral", "num_local_experts": 8})
    msg = str(info.value)
    assert "mixtral" in msg and all(t in msg for t in supported_model_types())


def test_expert_count_mismatch_names_key_and_counts(deepseek):
    model, _ = deepseek
    config = dict(model.config.to_dict(), n_routed_experts=6)
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*6 experts.*got 5"):
        get_adapter(config).to_hf(model.state_dict())


def test_missing_sibling_expert_tensor(deepseek):
    model, _ = deepseek
    sd = dict(model.state_dict())
    del sd["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(InputError, match=r"missing an expert tensor.*model\.layers\.1"):
        get_adapter(model.config).to_hf(sd)


def test_mismatched_expert_shapes(deepseek):
    model, _ = deepseek
    sd = dict(model.state_dict())
    sd["model.layers.1.mlp.experts.down_proj"] = torch.zeros(5, 32, 8)
    with pytest.raises(InputError, match="down projection does not match"):
        get_adapter(model.config).to_hf(sd)


def _rewrite(path, out, edit):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.4.up_proj.weight"),
         r"missing from the checkpoint \(key 'model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight'"),
        (lambda t: t.update({"model.layers.1.mlp.experts.5.up_proj.weight": torch.zeros(16, 32)}),
         r"no place in the model \(key 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'.*strict=False"),
        (lambda t: t.update({"model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(32, 15)}),
         r"wrong shape \(key 'model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight'\): expected \(32, 16\), got \(32, 15\)"),
        (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.bfloat16)}),
         r"wrong dtype \(key 'model\.norm\.weight'\): expected torch\.float32, got torch\.bfloat16"),
    ],
    ids=["missing-expert", "extra-expert", "wrong-shape", "wrong-dtype"],
)
def test_from_hf_refuses_bad_checkpoints_before_touching_the_model(deepseek, tmp_path, edit, pattern):
    model, path = deepseek
    bad = _rewrite(path, tmp_path / "bad", edit)
    target = tiny_model("deepseek_v3", n_experts=5, seed=7)
    before = _snapshot(target.state_dict())
    with pytest.raises(InputError, match=pattern):
        get_adapter(target.config).from_hf(target.state_dict(), bad)
    assert _unchanged(target.state_dict(), before)


def test_from_hf_dtype_cast_is_opt_in(deepseek, tmp_path):
    model, path = deepseek
    bad = _rewrite(path, tmp_path / "bf16", lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    target = tiny_model("deepseek_v3", n_experts=5, seed=7)
    get_adapter(target.config).from_hf(target.state_dict(), bad, allow_dtype_cast=True)
    assert torch.equal(target.model.norm.weight, model.model.norm.weight.to(torch.bfloat16).float())


def test_from_hf_reads_sharded_checkpoints_through_the_index(deepseek, tmp_path):
    model, _ = deepseek
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    target = tiny_model("deepseek_v3", n_experts=5, seed=7)
    get_adapter(target.config).from_hf(target.state_dict(), str(tmp_path))
    assert _unchanged(target.state_dict(), _snapshot(model.state_dict()))


@pytest.mark.parametrize("official", ["deepseek_v3", "kimi_k2", "qwen3_moe"])
def test_config_json_carries_every_official_key_a_transformers_config_lacks(official, tmp_path):
    """The published config as transformers holds it (its class drops the table's keys, or spells
    them otherwise) is written back with every official key at its official value, or one the
    serving table names as not needed (docs/design.md#serving-engines)."""
    import copy

    from official_configs import DEEPSEEK_V3, KIMI_K2, QWEN3_235B
    from nemo_moe_export.adapters.tables_serving import serving_table
    from nemo_moe_export.export.config_json import write_config_json
    from nemo_moe_export.planner.model import hf_config_from_dict

    values = copy.deepcopy({"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2, "qwen3_moe": QWEN3_235B}[official])
    table = serving_table(values["model_type"])
    # A config built by transformers has no fixed key (tests/test_export.py builds one); the
    # derived ones it reads and writes back in its own spelling.
    held = hf_config_from_dict({k: v for k, v in copy.deepcopy(values).items() if k not in table.fixed})
    held.save_pretrained(tmp_path / "transformers")
    plain = json.loads((tmp_path / "transformers" / "config.json").read_text())
    assert not set(plain) & {*table.fixed, *table.derived}, "the table restates a key transformers writes"
    write_config_json(str(tmp_path), held, torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    ignored = {"transformers_version"} | set(serving_table(values["model_type"]).not_needed)
    if official == "kimi_k2":  # written as DeepSeek-V3's class writes it: the published kimi_k2 type
        ignored.add("model_type")  # needs Moonshot's remote code (auto_map); the model is the same
    differ = {k: (written.get(k), v) for k, v in values.items() if k not in ignored and written.get(k) != v}
    assert not differ, f"official keys written otherwise (ours, official): {differ}"
