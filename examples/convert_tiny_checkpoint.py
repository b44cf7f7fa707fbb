"""Save a tiny MoE's checkpoint as AutoModel does (HF-keyed torch DCP), then convert it to HF (docs/convert.md).

    python examples/convert_tiny_checkpoint.py [WORKDIR]

One rank here; ``nemo-moe-export convert ... --nproc N`` (or torchrun) runs the same on N ranks.
"""

import os
import sys
import tempfile

import torch.distributed.checkpoint as dcp

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.convert import convert_checkpoint
from nemo_moe_export.tiny_models import tiny_model


def main(work: str) -> None:
    model = tiny_model("qwen3_moe")  # stands in for the trained model
    state = {key: piece.tensor.contiguous() for key, piece in get_adapter(model.config).to_hf(model.state_dict()).items()}
    dcp.save(state, checkpoint_id=os.path.join(work, "ckpt"), no_dist=True)
    model.config.save_pretrained(os.path.join(work, "hf_config"))
    result = convert_checkpoint(os.path.join(work, "ckpt"), os.path.join(work, "hf"),
                                config=os.path.join(work, "hf_config"), dtype="bfloat16")
    print(f"converted the {result.format} checkpoint: {result.tensors} tensors, {result.source_bytes} bytes read, "
          f"{result.rank_bytes_written} written into {result.path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="convert-"))
