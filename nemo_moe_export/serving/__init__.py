"""Serving an export with an engine: vLLM's prompt logprobs against transformers on the same files
(docs/design.md#serving-engines). ``vllm_worker.py`` runs in vLLM's own interpreter."""
