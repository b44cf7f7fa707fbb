"""Step 3 of an evaluation, the *forward*: one batch of the plan through the model, scored on the device.

:class:`ForwardRunner` knows nothing about ranks or steps (the driver,
:mod:`~nemo_moe_export.evaluate.evaluator`, decides what runs when); it turns one
:class:`~nemo_moe_export.evaluate.batching.Batch` into model inputs, calls the model
transformers-style and scores each row. Scores stay on the device until :meth:`ForwardRunner.scores`
reads them all at once: a step costs no host/device synchronisation of its own.

Padding and exactness
---------------------
Rows are right-padded and each row is read at its own last real positions; with a causal model
the real positions never see the padding, so padded results equal unpadded ones up to fp32 noise
(predictions, not raw logits, are what is compared for "identical"). Logits are projected only at
the positions scored, which keeps memory at ``rows x scored positions x vocab``: with a 2-D
``logits_to_keep`` where transformers takes one (recent 5.x), else by gathering those positions
in a forward pre-hook of the output embedding (``get_output_embeddings()``), else from the full
logits. ``padding_waste`` = padded tokens / all tokens fed (dummy forwards included).

Shared prefixes (docs/design.md#shared-prefix-evaluation)
---------------------------------------------------------
A suffix batch feeds each row without its prefix, position ids continuing after it. How the rows
get their prefix depends on the model:

* **packed** (:mod:`.prefix_attention`, softmax-attention models of its table): a prefix forward
  feeds its prefixes end to end in one row and captures every layer's keys and values; a suffix
  forward feeds its rows end to end in one row (one prefix's rows adjacent) and attends to those
  keys without copying them. No padding, no mask, no cache.
* **copied** (others, e.g. Kimi Linear's linear-attention state): a prefix forward feeds its
  prefixes left-padded (position ids count from each prefix's first real token, so a
  linear-attention state starts from zeros untouched by the padding) with ``use_cache=True`` and
  keeps the cache; a suffix forward copies that cache's rows over its own rows
  (``reorder_cache``, as transformers' cache appends the suffix's keys to it) and masks the
  prefix padding.

Models whose forward takes no cache argument or no ``position_ids`` evaluate full prompts
(:func:`cache_support`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from nemo_moe_export.evaluate import prefix_attention
from nemo_moe_export.evaluate.batching import Batch
from nemo_moe_export.evaluate.prefixes import SharedPrefix
from nemo_moe_export.evaluate.prepare import Row
from nemo_moe_export.evaluate.scoring import batch_continuation_logprobs

__all__ = ["ForwardRunner", "PaddingTally", "cache_support", "inference", "pad_token_id", "wants_uniform_shapes"]


@dataclass
class PaddingTally:
    """Tokens fed to the model, real and padded; summed over ranks for ``MMLUResult.padding``."""

    real_tokens: int = 0
    fed_tokens: int = 0  # rows x padded length, summed over every forward (dummies included)
    forwards: int = 0
    prefix_forwards: int = 0
    attended_tokens: int = 0  # rows x (cached prefix + padded length): what the attention read

    def add(self, real: int, rows: int, length: int, context: int = 0) -> None:
        self.real_tokens += real
        self.fed_tokens += rows * length
        self.attended_tokens += rows * (context + length)
        self.forwards += 1


@dataclass
class _PrefixCache:
    """What a prefix batch left for the suffix batches that continue it."""

    batch_id: int
    cache: Any  # transformers' cache (copied), or the keys a packed prefix forward captured
    mask: torch.Tensor | None  # [prefixes, length], left-padded (copied only)
    lengths: torch.Tensor  # [prefixes]
    slot: dict[int, int]  # prefix_id -> row of the cache (copied) or prefix of the packed forward


class ForwardRunner:
    """Runs the plan's batches through ``model`` and keeps each row's continuation scores."""

    def __init__(self, model: Any, rows: Sequence[Row], pad_id: int, softmax_dtype: torch.dtype | None,
                 prefixes: Sequence[SharedPrefix] = ()) -> None:
        self.model, self.rows, self.pad_id, self.softmax_dtype = model, rows, pad_id, softmax_dtype
        self.prefixes = {p.prefix_id: p for p in prefixes}
        self.prefix_of_row = {r: p.prefix_id for p in prefixes for r in p.rows}
        self.packed = bool(prefixes) and prefix_attention.shares_prefix_keys(model)
        self.device = _model_device(model)
        self.tally = PaddingTally()
        params = inspect.signature(model.forward).parameters
        self.keeps_positions = "logits_to_keep" in params
        self.row_positions = self.keeps_positions and _accepts_row_positions()
        self.takes_use_cache = "use_cache" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        self.cache_kwarg = _cache_kwarg(params)
        head = getattr(model, "get_output_embeddings", None)
        self.head = head() if callable(head) else None
        self._prefix: _PrefixCache | None = None
        self._scores: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def run(self, batch: Batch | None, shape: tuple[int, int] | None) -> None:
        """One forward: ``batch``, or a dummy (``None``: one token, or ``shape``, result discarded).

        ``shape`` is the ``(rows, length)`` to pad a rows batch to, or None for its own shape."""
        if batch is not None and batch.kind == "prefix":
            self._prefix = None  # the previous unit's cache is no longer needed: free it first
            (self._run_packed_prefix if self.packed else self._run_prefix)(batch)
            return
        prefix = self._prefix if batch is not None and batch.kind == "suffix" else None
        if batch is not None and batch.kind == "suffix" and (prefix is None or prefix.batch_id != batch.after):
            raise RuntimeError(f"suffix batch {batch.batch_id} needs the cache of prefix batch {batch.after}; plan bug")
        if prefix is not None and self.packed:
            self._run_packed_suffix(batch, prefix)
            return
        rows = [] if batch is None else [self.rows[i] for i in batch.rows]
        cut = [self.prefixes[self.prefix_of_row[r.row_id]].length if prefix else 0 for r in rows]
        ids, mask, positions = self._pad([r.input_ids[c:] for r, c in zip(rows, cut)], rows, shape,
                                         context=prefix.mask.shape[1] if prefix else 0)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if prefix is not None:
            kwargs.update(self._continue_from(prefix, rows, mask))
        self._score(rows, self._kept_logits(kwargs, positions))

    def scores(self) -> dict[int, list[float]]:
        """Scores by row id of every row run so far, read from the device at once."""
        if not self._scores:
            return {}
        width = max(s.shape[1] for _, s in self._scores)  # batches of rows with 5 choices are wider
        values = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=float("nan"))
                            for _, s in self._scores]).tolist()
        ids = [r for row_ids, _ in self._scores for r in row_ids]
        return {r: v[:len(self.rows[r].choices)] for r, v in zip(ids, values)}

    def _score(self, rows: Sequence[Row], logits: torch.Tensor) -> None:
        if rows:
            self._scores.append((tuple(r.row_id for r in rows),
                                 batch_continuation_logprobs(logits[:len(rows)], [r.continuations for r in rows],
                                                             dtype=self.softmax_dtype)))

    # --- inputs ---------------------------------------------------------------------------------

    def _pad(self, tokens: Sequence[Sequence[int]], rows: Sequence[Row], shape: tuple[int, int] | None, *,
             context: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tokens`` right-padded to ``shape`` (ids, mask, each row's last ``n_keep`` positions);
        padding rows (and a dummy step's one row) get a single real token, so no row is fully masked."""
        lengths = [len(t) for t in tokens]
        n_rows, length = shape if shape is not None else (max(len(tokens), 1), max(lengths, default=1))
        n_keep = max((r.scored_positions for r in rows), default=1)
        ids = [list(t) + [self.pad_id] * (length - len(t)) for t in tokens]
        ids += [[self.pad_id] * length] * (n_rows - len(tokens))
        mask = [[1] * n + [0] * (length - n) for n in lengths] + [[1] + [0] * (length - 1)] * (n_rows - len(tokens))
        # the row's last n_keep real positions (clamped at 0; the clamped ones are never read)
        positions = [[max(p, 0) for p in range(n - n_keep, n)] for n in lengths]
        positions += [[0] * n_keep] * (n_rows - len(tokens))
        self.tally.add(sum(lengths), n_rows, length, context)
        return (torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True),
                torch.tensor(mask, dtype=torch.long).to(self.device, non_blocking=True),
                torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True))

    def _tensor(self, values: Sequence[Any]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    # --- shared prefixes, copied: transformers' cache ----------------------------------------------

    def _run_prefix(self, batch: Batch) -> None:
        """The prefixes left-padded, their cache kept for the suffix batches that follow."""
        prefixes = [self.prefixes[p] for p in batch.prefixes]
        length = batch.length
        mask_t = self._tensor([[0] * (length - p.length) + [1] * p.length for p in prefixes])
        kwargs: dict[str, Any] = {"input_ids": self._tensor([[self.pad_id] * (length - p.length) + list(p.token_ids)
                                                             for p in prefixes]),
                                  "attention_mask": mask_t, "use_cache": True,
                                  "position_ids": (mask_t.cumsum(1) - 1).clamp(min=0)}
        if self.keeps_positions:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cache is None or not hasattr(cache, "reorder_cache"):
            raise RuntimeError(f"{type(self.model).__name__} returned no reorderable cache from use_cache=True; "
                               "evaluate with shared_prefix=False")
        self._prefix = _PrefixCache(batch.batch_id, cache, mask_t, self._tensor([p.length for p in prefixes]),
                                    {p.prefix_id: i for i, p in enumerate(prefixes)})
        self.tally.add(batch.real_tokens, len(prefixes), length)
        self.tally.prefix_forwards += 1

    def _continue_from(self, prefix: _PrefixCache, rows: Sequence[Row], mask: torch.Tensor) -> dict[str, Any]:
        """Cache, mask and position ids that put each row's prefix in front of what it feeds."""
        select = self._tensor([prefix.slot[self.prefix_of_row[r.row_id]] for r in rows])
        cache = copy.deepcopy(prefix.cache)  # the unit's later batches need the original
        cache.reorder_cache(select)
        positions = prefix.lengths.index_select(0, select)[:, None] + torch.arange(mask.shape[1], device=self.device)
        return {self.cache_kwarg: cache, "use_cache": True, "position_ids": positions,
                "attention_mask": torch.cat([prefix.mask.index_select(0, select), mask], dim=1)}

    # --- shared prefixes, packed: keys shared, no padding (prefix_attention) -----------------------

    def _run_packed_prefix(self, batch: Batch) -> None:
        """The prefixes end to end in one row, their keys captured for the suffix batches that follow."""
        prefixes = [self.prefixes[p] for p in batch.prefixes]
        keys = prefix_attention.PrefixKeys(tuple(accumulate((p.length for p in prefixes), initial=0)))
        kwargs: dict[str, Any] = {"input_ids": self._tensor([[t for p in prefixes for t in p.token_ids]]),
                                  "position_ids": self._tensor([[i for p in prefixes for i in range(p.length)]])}
        if self.keeps_positions:
            kwargs["logits_to_keep"] = 1
        if self.takes_use_cache:
            kwargs["use_cache"] = False
        with prefix_attention.packed(self.model, [p.length for p in prefixes], capture=keys):
            self.model(**kwargs)
        self._prefix = _PrefixCache(batch.batch_id, keys, None, self._tensor([p.length for p in prefixes]),
                                    {p.prefix_id: i for i, p in enumerate(prefixes)})
        self.tally.add(batch.real_tokens, 1, batch.real_tokens)
        self.tally.prefix_forwards += 1

    def _run_packed_suffix(self, batch: Batch, prefix: _PrefixCache) -> None:
        """The batch's rows without their prefixes, end to end in one row; the rows of one prefix
        adjacent, so each prefix's keys are attended by one call."""
        rows = sorted((self.rows[i] for i in batch.rows), key=lambda r: prefix.slot[self.prefix_of_row[r.row_id]])
        prefix_of = [self.prefixes[self.prefix_of_row[r.row_id]] for r in rows]
        tokens = [r.input_ids[p.length:] for r, p in zip(rows, prefix_of)]
        lengths = [len(t) for t in tokens]
        n_keep = max(r.scored_positions for r in rows)
        starts = list(accumulate(lengths, initial=0))
        # each row's last n_keep positions in the packed row (clamped to the row; the clamped ones are never read)
        kept = [[max(stop - n_keep + k, start) for k in range(n_keep)] for start, stop in zip(starts, starts[1:])]
        kwargs: dict[str, Any] = {
            "input_ids": self._tensor([[t for row in tokens for t in row]]),
            "position_ids": self._tensor([[p.length + i for p, n in zip(prefix_of, lengths) for i in range(n)]])}
        if self.takes_use_cache:
            kwargs["use_cache"] = False
        positions = self._tensor([[k for row in kept for k in row]])
        with prefix_attention.packed(self.model, lengths, prefix=prefix.cache,
                                     slots=[prefix.slot[p.prefix_id] for p in prefix_of]):
            logits = self._kept_logits(kwargs, positions)
        self.tally.add(starts[-1], 1, starts[-1], context=sum(p.length for p in prefix_of))
        self._score(rows, logits.reshape(len(rows), n_keep, -1))

    # --- the forward and its logits --------------------------------------------------------------

    def _kept_logits(self, kwargs: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """``[rows, n_keep, vocab]`` logits at ``positions`` of each row, projected only there when
        the model lets us (see the module docstring)."""
        if self.takes_use_cache:
            kwargs.setdefault("use_cache", False)
        if self.row_positions:
            logits = self.model(**kwargs, logits_to_keep=positions).logits
        elif isinstance(self.head, torch.nn.Module):
            with _gathered_before(self.head, positions):
                logits = self.model(**kwargs).logits
        else:
            logits = torch.take_along_dim(self.model(**kwargs).logits, positions.unsqueeze(-1), dim=1)
        if tuple(logits.shape[:2]) != tuple(positions.shape):
            raise RuntimeError(f"model ignored the kept positions: logits {tuple(logits.shape)}, "
                               f"positions {tuple(positions.shape)}")
        return logits


@contextmanager
def _gathered_before(head: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Feed ``head`` (the output embedding) only the hidden states at ``positions`` of each row."""

    def gather(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        return (torch.take_along_dim(hidden, positions.unsqueeze(-1), dim=1), *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def inference(model: Any) -> Iterator[None]:
    """Eval mode without autograd for the forwards; the model's training flag is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def cache_support(model: Any) -> str | None:
    """Why ``model`` cannot evaluate shared prefixes, or None when it can: it must not declare a
    reason itself (``cache_unsupported_reason``: pipeline stages keep no KV cache) and its forward
    must take a cache (``cache`` in transformers >= 5.2x, ``past_key_values`` before),
    ``use_cache`` and ``position_ids``."""
    declared = getattr(model, "cache_unsupported_reason", None)
    if declared:
        return f"{type(model).__name__}: {declared}"
    params = inspect.signature(model.forward).parameters
    missing = [name for name, ok in (("cache or past_key_values", _cache_kwarg(params) is not None),
                                     ("use_cache", "use_cache" in params), ("position_ids", "position_ids" in params))
               if not ok]
    return f"{type(model).__name__}.forward takes no {', '.join(missing)}" if missing else None


def _cache_kwarg(params: Any) -> str | None:
    """The name under which this transformers release takes a cache: probed, not read off a version."""
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _accepts_row_positions() -> bool:
    """Whether transformers' models take a 2-D ``[rows, positions]`` ``logits_to_keep`` (its
    ``slice_logits_to_keep``, in recent 5.x). Earlier 5.x releases index ``hidden[:, positions]``,
    which only a 1-D tensor of positions gets right."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep  # noqa: F401
    except ImportError:
        return False
    return True


def _model_device(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def pad_token_id(tokenizer: Any, vocab_size: int | None) -> int:
    """Any valid id will do (right padding never reaches a real position); prefer the tokenizer's."""
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int) and 0 <= value < (vocab_size or value + 1):
            return value
    return 0


def wants_uniform_shapes(model: Any) -> bool:
    """What ``uniform_shapes=None`` resolves to: on for Megatron-core modules, which exchange
    fixed-shape buffers across ranks; off for transformers models, since our EP experts
    (:class:`~nemo_moe_export.expert_parallel.ExpertParallelExperts`) and FSDP2's all-gathers do
    not depend on the input shape."""
    return any(type(m).__module__.startswith("megatron.") for m in model.modules())
