"""Read official FP8 block-quantized DeepSeek-V3 / Kimi K2 checkpoints into high-precision models.

Those checkpoints store most 2-D weights as ``float8_e4m3fn`` with a companion
``{key}_scale_inv`` (fp32, one scale per ``weight_block_size`` block, shape
``[ceil(rows / b0), ceil(cols / b1)]``), and say so in ``config.json``'s ``quantization_config``
(``quant_method: fp8``, ``weight_block_size: [128, 128]``). Norms, embeddings, ``lm_head`` and the
router stay in high precision.

:class:`Fp8BlockSource` wraps the checkpoint for ``StateDictAdapter.from_hf``: a rank asking for a
box of a quantized weight reads that box of the FP8 tensor and only the scale rows and columns the
box touches (a box that starts or ends inside a block still uses that block's scale), then
dequantizes in fp32: ``w.float() * scale`` per element. No rank reads or materialises a full FP8 or
high-precision tensor it does not own (docs/design.md#fp8-block-format).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from nemo_moe_export.adapters.sources import SafetensorsSource, TensorMeta
from nemo_moe_export.errors import ExportInputError

__all__ = ["Fp8BlockSource", "fp8_block_size", "open_source", "quantize_block_fp8"]

SCALE_SUFFIX = "_scale_inv"
_FP8_DTYPES = (torch.float8_e4m3fn,)


def fp8_block_size(checkpoint_dir: str) -> tuple[int, int] | None:
    """The block size when ``config.json`` declares FP8 block quantization, else None.

    Raises on a quantization config this reader cannot honour (another method or format, or a
    block size that is not two positive integers).
    """
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if method != "fp8":
        raise ExportInputError("unsupported quantization method", key="quantization_config.quant_method",
                               expected="'fp8' (block-quantized)", actual=repr(method))
    if fmt != "e4m3":
        raise ExportInputError("unsupported FP8 format", key="quantization_config.fmt", expected="'e4m3'",
                               actual=repr(fmt))
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ExportInputError("unsupported FP8 block size", key="quantization_config.weight_block_size",
                               expected="two positive integers, e.g. [128, 128]", actual=block)
    return int(block[0]), int(block[1])


class Fp8BlockSource:
    """A checkpoint source that dequantizes FP8 block-quantized weights slice by slice."""

    def __init__(self, inner: SafetensorsSource, block: tuple[int, int]) -> None:
        self.inner, self.block = inner, block
        keys = inner.keys()
        self._scales = {k for k in keys if k.endswith(SCALE_SUFFIX)}
        self._quantized: set[str] = set()
        for key in sorted(keys - self._scales):
            meta = inner.meta(key)
            if meta.dtype not in _FP8_DTYPES:
                continue
            scale_key = key + SCALE_SUFFIX
            if scale_key not in keys:
                raise ExportInputError("FP8 weight without its scale", key=key, expected=f"a '{scale_key}' tensor",
                                       actual="missing", hint="the checkpoint is incomplete or not block-quantized")
            if len(meta.shape) != 2:
                raise ExportInputError("FP8 block quantization needs 2-D weights", key=key, expected="2 dims",
                                       actual=f"shape {meta.shape}")
            expected = (math.ceil(meta.shape[0] / block[0]), math.ceil(meta.shape[1] / block[1]))
            got = inner.meta(scale_key)
            if got.shape != expected:
                raise ExportInputError(
                    "FP8 scale has the wrong shape", key=scale_key,
                    expected=f"{expected} for weight {meta.shape} with blocks {list(block)}", actual=got.shape)
            self._quantized.add(key)
        orphans = sorted(s for s in self._scales if s[: -len(SCALE_SUFFIX)] not in self._quantized)
        if orphans:
            raise ExportInputError("FP8 scale without an FP8 weight", key=orphans[0],
                                   expected="a float8_e4m3fn weight beside each scale", actual=f"{len(orphans)} orphan scale(s)")

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def keys(self) -> set[str]:
        return self.inner.keys() - self._scales

    def dequantizes(self, key: str) -> bool:
        return key in self._quantized

    def meta(self, key: str) -> TensorMeta:
        return self.inner.meta(key)

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        weight = self.inner.read(key, offsets, shape)
        if key not in self._quantized:
            return weight
        (r, c), (h, w), (b0, b1) = offsets, shape, self.block
        r0, c0 = r // b0, c // b1  # the block holding the box's first row / column
        r1, c1 = (r + h - 1) // b0 + 1, (c + w - 1) // b1 + 1
        scale = self.inner.read(key + SCALE_SUFFIX, (r0, c0), (r1 - r0, c1 - c0))
        scale = scale.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
        scale = scale[r - r0 * b0: r - r0 * b0 + h, c - c0 * b1: c - c0 * b1 + w]
        return weight.to(torch.float32) * scale.to(torch.float32)

    def close(self) -> None:
        self.inner.close()


def open_source(path: str | os.PathLike[str]) -> Any:
    """A checkpoint source: plain safetensors, or FP8-dequantizing when ``config.json`` says so."""
    path = os.fspath(path)
    inner = SafetensorsSource(path)
    block = fp8_block_size(path) if os.path.isdir(path) else None
    if block is None:
        if any(k.endswith(SCALE_SUFFIX) for k in inner.keys()):
            inner.close()
            raise ExportInputError("checkpoint has FP8 scales but config.json declares no quantization",
                                   key=os.path.join(path, "config.json"),
                                   expected="quantization_config with quant_method 'fp8'", actual="none")
        return inner
    try:
        return Fp8BlockSource(inner, block)
    except BaseException:
        inner.close()
        raise


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, fp32 scale_inv)`` in the official layout (amax / 448 per block).

    For building test and benchmark checkpoints; loading never needs it.
    """
    rows, cols = math.ceil(weight.shape[0] / block[0]), math.ceil(weight.shape[1] / block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[: weight.shape[0], : weight.shape[1]] = weight.float()
    amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (weight.float() / expanded[: weight.shape[0], : weight.shape[1]]).to(torch.float8_e4m3fn), scale_inv
