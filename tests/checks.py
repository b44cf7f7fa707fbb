"""Shared test checks: the grouped-layout reference conversion, the union-of-pieces check, the
tensors a checkpoint folder stores."""

from __future__ import annotations


def to_grouped_layout(state_dict):
    """NeMo AutoModel grouped experts from transformers 5 fused ones.

    ``gate_and_up_projs[e] = gate_up_proj[e].T`` ([H, 2I], gate columns first) and
    ``down_projs[e] = down_proj[e].T`` ([I, H]); every other key is unchanged.
    """
    out = {}
    for key, value in state_dict.items():
        if key.endswith("experts.gate_up_proj"):
            key, value = key.replace("gate_up_proj", "gate_and_up_projs"), value.transpose(1, 2).contiguous()
        elif key.endswith("experts.down_proj"):
            key, value = key.replace("down_proj", "down_projs"), value.transpose(1, 2).contiguous()
        out[key] = value.detach()
    return out


def assert_pieces_tile_reference(dumps_by_rank, reference):
    """The union over ranks of ``to_hf`` pieces equals ``reference`` ({hf_key: tensor}) exactly.

    ``dumps_by_rank[r]`` lists ``(key, offsets, global_shape, primary, tensor)`` of rank ``r``. Every
    piece must hold the reference's data at its box, every key must be produced, and every element
    must be covered by exactly one primary piece (so a writer of primaries writes each byte once).
    """
    import torch

    assembled = {k: torch.zeros_like(v) for k, v in reference.items()}
    coverage = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in reference.items()}
    seen = set()
    for rank, dump in enumerate(dumps_by_rank):
        for key, offsets, global_shape, primary, tensor in dump:
            assert key in reference, f"rank {rank} produced {key}, which save_pretrained does not write"
            assert global_shape == tuple(reference[key].shape), key
            box = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))
            assert torch.equal(reference[key][box], tensor), f"rank {rank}: wrong data for {key} at {offsets}"
            seen.add(key)
            if primary:
                assembled[key][box] = tensor
                coverage[key][box] += 1
    assert seen == set(reference), f"keys never produced: {sorted(set(reference) - seen)}"
    for key in reference:
        assert bool((coverage[key] == 1).all()), f"{key}: elements written {coverage[key].unique().tolist()} times"
        assert torch.equal(assembled[key], reference[key]), key


def stored_tensors(path: str) -> dict:
    """Every tensor of the safetensors files in the folder ``path``, by key."""
    import os

    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def assert_serving_config(path: str, reference: str | None = None, *, model_type: str | None = None) -> dict:
    """``config.json`` of the export in ``path`` is what serving engines load (docs/design.md#serving-engines):
    a causal-LM ``architectures`` entry (transformers' class for the ``model_type``), ``dtype`` and
    ``torch_dtype`` equal to the dtype its files hold, the family's official keys with the table's
    values; with ``reference`` (a ``save_pretrained`` folder of the same weights), every key that
    ``config.json`` holds there holds the same value here, and every tensor has its dtype there.
    Returns the config."""
    import json
    import os

    from nemo_moe_export.adapters.tables_serving import causal_lm_class, serving_table
    from nemo_moe_export.export.config_json import files_dtype

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    model_type = model_type or config["model_type"]
    assert config["model_type"] == model_type, (config["model_type"], model_type)
    assert config["architectures"] == [causal_lm_class(model_type).__name__], config["architectures"]
    assert config["architectures"][0].endswith("ForCausalLM")
    tensors = stored_tensors(path)
    written = str(files_dtype((t.dtype, t.numel()) for t in tensors.values())).removeprefix("torch.")
    assert config["dtype"] == config["torch_dtype"] == written, (config["dtype"], config["torch_dtype"], written)
    table = serving_table(model_type)
    for key, value in (table.fixed.items() if table else ()):
        assert config[key] == value, (key, config.get(key), value)
    if model_type in ("deepseek_v3", "kimi_k2"):  # the official checkpoints' values (tests/test_planner.py)
        assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    if reference is not None:
        with open(os.path.join(reference, "config.json")) as f:
            expected = json.load(f)
        differ = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
        assert not differ, f"config.json keys unlike save_pretrained's (ours, theirs): {differ}"
        theirs = stored_tensors(reference)
        dtypes = {k: (t.dtype, theirs[k].dtype) for k, t in tensors.items() if k in theirs and t.dtype != theirs[k].dtype}
        assert not dtypes, f"dtypes unlike save_pretrained's (ours, theirs): {dtypes}"
    return config
