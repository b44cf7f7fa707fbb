"""Test-side reference conversions between in-memory expert layouts (REFERENCE.md section 2)."""

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
