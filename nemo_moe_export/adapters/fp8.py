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

The format's block math lives here too, the one home for the loader, the FP8 export
(``export/quantize.py``) and the tests' checkpoints: :func:`block_scales` (scale per block from its
amax), :func:`quantize_with_scales` and :func:`quantize_block_fp8` (a whole tensor at once).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from nemo_moe_export.adapters.protocol import TensorMeta
from nemo_moe_export.adapters.sources import SafetensorsSource
from nemo_moe_export.errors import InputError

__all__ = ["E4M3_MAX", "FP8_BLOCK", "FP8_DTYPE", "SCALE_SUFFIX", "Fp8BlockSource", "block_scales", "fp8_block_size",
           "official_quantization_config", "open_source", "quantize_block_fp8", "quantize_with_scales"]

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
_FP8_DTYPES = (FP8_DTYPE,)
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: the largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)  # weight_block_size of the official checkpoints, and of what we export


def fp8_block_size(checkpoint_dir: str) -> tuple[int, int] | None:
    """The block size when ``config.json`` declares FP8 block quantization, else None.

    Raises on a quantization config this reader cannot honour (another method or format, or a
    block size that is not two positive integers).
    """
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.exists(path):
        return None
    config = _read_config(path)
    text = config.get("text_config")
    quant = config.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise InputError("quantization_config is not an object", key=f"{path}: quantization_config",
                         expected='e.g. {"quant_method": "fp8", "weight_block_size": [128, 128]}',
                         actual=repr(quant))
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if method != "fp8":
        raise InputError("unsupported quantization method", key="quantization_config.quant_method",
                         expected="'fp8' (block-quantized)", actual=repr(method))
    if fmt != "e4m3":
        raise InputError("unsupported FP8 format", key="quantization_config.fmt", expected="'e4m3'",
                         actual=repr(fmt))
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise InputError("unsupported FP8 block size", key="quantization_config.weight_block_size",
                         expected="two positive integers, e.g. [128, 128]", actual=block)
    return int(block[0]), int(block[1])


def _read_config(path: str) -> dict[str, Any]:
    """``config.json`` as a dict; an unreadable one is an error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise InputError("unreadable config.json", key=path, expected="a JSON object",
                         actual=f"{type(exc).__name__}: {exc}",
                         hint="re-copy the checkpoint's config.json") from exc
    if not isinstance(config, dict):
        raise InputError("config.json is not a JSON object", key=path, expected="a JSON object",
                         actual=type(config).__name__)
    return config


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
                raise InputError("FP8 weight without its scale", key=key, expected=f"a '{scale_key}' tensor",
                                 actual="missing", hint="the checkpoint is incomplete or not block-quantized")
            if len(meta.shape) != 2:
                raise InputError("FP8 block quantization needs 2-D weights", key=key, expected="2 dims",
                                 actual=f"shape {meta.shape}")
            expected = (math.ceil(meta.shape[0] / block[0]), math.ceil(meta.shape[1] / block[1]))
            got = inner.meta(scale_key)
            if got.shape != expected:
                raise InputError(
                    "FP8 scale has the wrong shape", key=scale_key,
                    expected=f"{expected} for weight {meta.shape} with blocks {list(block)}", actual=got.shape)
            self._quantized.add(key)
        orphans = sorted(s for s in self._scales if s[: -len(SCALE_SUFFIX)] not in self._quantized)
        if orphans:
            raise InputError("FP8 scale without an FP8 weight", key=orphans[0],
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
    try:
        block = fp8_block_size(path) if os.path.isdir(path) else None
    except BaseException:
        inner.close()
        raise
    if block is None:
        if any(k.endswith(SCALE_SUFFIX) for k in inner.keys()):
            inner.close()
            raise InputError("checkpoint has FP8 scales but config.json declares no quantization",
                             key=os.path.join(path, "config.json"),
                             expected="quantization_config with quant_method 'fp8'", actual="none")
        return inner
    try:
        return Fp8BlockSource(inner, block)
    except BaseException:
        inner.close()
        raise


# --------------------------------------------------------------------------------------------------
# The block math, one home for the loader, the FP8 export and the tests' checkpoints
# (docs/design.md#fp8-block-format)
# --------------------------------------------------------------------------------------------------


def official_quantization_config(scale_fmt: str | None = None) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` of an official DeepSeek-V3 FP8 checkpoint, with
    ``scale_fmt`` when its scales are powers of two (``"ue8m0"``, as DeepSeek-V3.1 declares)."""
    config: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": list(FP8_BLOCK)}
    if scale_fmt is not None:
        config["scale_fmt"] = scale_fmt
    return config


def block_scales(amax: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """``weight_scale_inv`` of each block from its ``amax`` (max |w| over the block): ``amax / 448``
    in fp32. A block whose scale is 0 (an all-zero block) gets 1.0, as transformers' own quantizer
    gives it: any finite scale decodes its zeros to 0, and 1.0 is a power of two, so it is also
    valid under ``ue8m0``. With ``scale_fmt="ue8m0"`` the scale is rounded up to a power of two,
    exactly (from the float's exponent, not through ``log2``).

    The divisor is a tensor on ``amax``'s device, not a Python number: CUDA turns a division by a
    scalar into a multiplication by its reciprocal, which is an ulp off ``amax / 448`` for some
    values, so the same weights would get other scales on a GPU than on a CPU."""
    amax = amax.to(torch.float32)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_fmt == "ue8m0":
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, 0.5 <= mantissa < 1
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
    return scale


def quantize_with_scales(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` of ``values / scale`` in fp32, saturated to +/-448 (``scale`` broadcasts).

    Divides in place on a fresh fp32 copy: the same IEEE division, about 5x faster on CPU than a
    broadcast into a new tensor (measured on 128 x 7168 blocks)."""
    scaled = values.to(torch.float32, copy=True).div_(scale)
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                       scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, fp32 scale_inv)`` of a whole 2-D weight in the official layout: per
    ``block`` (edge blocks zero-padded for the amax) :func:`block_scales`, then
    :func:`quantize_with_scales`. The FP8 export computes the same per rank slice (``export/quantize.py``)."""
    rows, cols = math.ceil(weight.shape[0] / block[0]), math.ceil(weight.shape[1] / block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=weight.dtype, device=weight.device)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale_inv = block_scales(amax, scale_fmt)
    expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return quantize_with_scales(weight, expanded[: weight.shape[0], : weight.shape[1]]), scale_inv
