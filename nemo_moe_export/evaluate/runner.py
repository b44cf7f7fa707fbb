"""Step 3 of an evaluation, the *forward*: one right-padded batch through the model, scored per row.

:class:`ForwardRunner` knows nothing about ranks or steps (the driver,
:mod:`~nemo_moe_export.evaluate.evaluator`, decides what runs when); it only turns rows into a
padded batch, calls the model transformers-style and reads each row's continuation scores.

Padding and exactness
---------------------
Rows are right-padded and each row is read at its own last real positions; with a causal model
the real positions never see the padding, so padded results equal unpadded ones up to fp32 noise
(predictions, not raw logits, are what is compared for "identical"). Logits are projected only at
the positions scored (``logits_to_keep`` with a per-row position tensor), which keeps memory at
``rows x scored positions x vocab`` instead of ``rows x length x vocab``. ``padding_waste`` =
padded tokens / all tokens fed (dummy batches included).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from nemo_moe_export.evaluate.prepare import Row
from nemo_moe_export.evaluate.scoring import continuation_logprob

__all__ = ["ForwardRunner", "PaddingTally", "inference", "pad_token_id", "wants_uniform_shapes"]


@dataclass
class PaddingTally:
    """Tokens fed to the model, real and padded; summed over ranks for ``MMLUResult.padding``."""

    real_tokens: int = 0
    fed_tokens: int = 0  # rows x padded length, summed over every forward (dummies included)

    def add(self, real: int, rows: int, length: int) -> None:
        self.real_tokens += real
        self.fed_tokens += rows * length


@dataclass
class _PaddedBatch:
    ids: torch.Tensor  # [rows, length], right-padded
    mask: torch.Tensor  # [rows, length], 1 at real tokens
    positions: torch.Tensor  # [rows, n_keep]: each row's last n_keep real positions


class ForwardRunner:
    """Runs right-padded batches through ``model`` and scores each row's continuations."""

    def __init__(self, model: Any, rows: Sequence[Row], pad_id: int, softmax_dtype: torch.dtype | None) -> None:
        self.model, self.rows, self.pad_id, self.softmax_dtype = model, rows, pad_id, softmax_dtype
        self.device = _model_device(model)
        self.tally = PaddingTally()
        params = inspect.signature(model.forward).parameters
        self.keeps_positions = "logits_to_keep" in params
        self.row_positions = _accepts_row_positions()
        self.takes_use_cache = "use_cache" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    def run(self, members: Sequence[int], shape: tuple[int, int] | None) -> dict[int, list[float]]:
        """Scores by row id of the ``members`` rows (none for a dummy step: ``members`` empty).

        ``shape`` is the ``(rows, length)`` to pad to, or None for the batch's own shape."""
        rows = [self.rows[i] for i in members]
        batch = self._pad(rows, shape)
        logits = self._kept_logits(batch.ids.to(self.device), batch.mask.to(self.device),
                                   batch.positions.to(self.device))
        return {row.row_id: [continuation_logprob(logits[i], c, dtype=self.softmax_dtype)
                             for c in row.continuations] for i, row in enumerate(rows)}

    def _pad(self, rows: Sequence[Row], shape: tuple[int, int] | None) -> _PaddedBatch:
        """``rows`` right-padded to ``shape``; the padding rows (and a dummy step's one row) get a
        single real token, so no row is fully masked."""
        lengths = [len(r.input_ids) for r in rows]
        n_rows, length = shape if shape is not None else (max(len(rows), 1), max(lengths, default=1))
        n_keep = max((r.scored_positions for r in rows), default=1)
        ids = torch.full((n_rows, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n_rows, length), dtype=torch.long)
        mask[len(rows):, 0] = 1
        positions = torch.zeros((n_rows, n_keep), dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            mask[i, :n] = 1
            # the row's last n_keep real positions (clamped at 0; the clamped ones are never read)
            positions[i] = (torch.arange(n - n_keep, n)).clamp(min=0)
        self.tally.add(sum(lengths), n_rows, length)
        return _PaddedBatch(ids, mask, positions)

    def _kept_logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[rows, n_keep, vocab]`` logits at ``positions`` of each row (projected only there when
        the model takes ``logits_to_keep``, transformers >= 5)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self.takes_use_cache:
            kwargs["use_cache"] = False
        if not self.keeps_positions:
            logits = self.model(**kwargs).logits
            return torch.take_along_dim(logits, positions.unsqueeze(-1), dim=1)
        if self.row_positions:
            logits = self.model(**kwargs, logits_to_keep=positions).logits
        else:
            logits = self._logits_at_shared_positions(kwargs, positions)
        if tuple(logits.shape[:2]) != tuple(positions.shape):
            raise RuntimeError(f"model ignored logits_to_keep positions: logits {tuple(logits.shape)}, "
                               f"positions {tuple(positions.shape)}")
        return logits

    def _logits_at_shared_positions(self, kwargs: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """For transformers that take only a 1-D ``logits_to_keep``: project the union of every
        row's positions once, then let each row pick its own."""
        union, inverse = torch.unique(positions, return_inverse=True)
        logits = self.model(**kwargs, logits_to_keep=union).logits
        if logits.dim() == 3 and logits.shape[1] == union.numel():
            logits = torch.take_along_dim(logits, inverse.unsqueeze(-1), dim=1)
        return logits


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
