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
