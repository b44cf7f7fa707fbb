"""Full-vocabulary prompt logprobs from vLLM, run by vLLM's own interpreter (docs/design.md#serving-engines).

vLLM pins its own transformers, so it lives in its own environment; this file imports only the
standard library, torch and vLLM and is run there as a script:
``VLLM_PYTHON vllm_worker.py REQUEST.json``. One process serves every case of the request in turn
(loading vLLM costs more than a tiny model): for each case it loads the checkpoint as written (no
``hf_overrides``), computes the prompt logprobs of each token-id prompt over the whole vocabulary,
and saves ``{name}.pt`` (a list, per prompt, of ``[len - 1, vocab]`` float32 logprobs of tokens 1..)
in the request's ``out`` folder, with ``{name}.json`` (load and run seconds) beside it.

REQUEST.json: ``{"out": DIR, "cases": [{"name", "path", "dtype", "prompts": [[ids]],
"max_model_len", "engine": {extra LLM arguments}}]}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# Run as a script, this file's folder heads sys.path: vLLM must not find the package's modules there.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

# One process, no engine subprocess, a small KV cache, threads as the machine has them
# (set before vLLM is imported, which reads them then).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def _dense(position: dict, vocab: int) -> torch.Tensor:
    row = torch.full((vocab,), float("-inf"))
    for token, logprob in position.items():
        row[token] = logprob.logprob
    return row


def _serve(case: dict, out: str) -> None:
    started = time.monotonic()
    llm = LLM(model=case["path"], dtype=case["dtype"], enforce_eager=True, max_model_len=case["max_model_len"],
              max_logprobs=-1, skip_tokenizer_init=True, **case.get("engine", {}))
    loaded = time.monotonic()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in case["prompts"]], params, use_tqdm=False)
    logprobs = [torch.stack([_dense(pos, vocab) for pos in o.prompt_logprobs[1:]]) for o in outputs]
    torch.save(logprobs, os.path.join(out, case["name"] + ".pt"))
    with open(os.path.join(out, case["name"] + ".json"), "w") as f:
        json.dump({"load_s": round(loaded - started, 2), "run_s": round(time.monotonic() - loaded, 2)}, f)
    del llm
    _release()


def _release() -> None:
    """Let the next case start a fresh engine in this process."""
    cleanup_dist_env_and_memory()
    gc.collect()


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        request = json.load(f)
    failed = 0
    for case in request["cases"]:
        try:
            _serve(case, request["out"])
        except Exception as exc:  # noqa: BLE001 - reported per case, the next case still runs
            failed += 1
            with open(os.path.join(request["out"], case["name"] + ".json"), "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)
            print(f"case {case['name']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            try:
                _release()
            except Exception:  # noqa: BLE001
                pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
