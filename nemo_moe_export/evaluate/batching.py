"""Step 2 of an evaluation, *batching*: the global list of forwards, and which one each rank runs at each step.

No communication happens here: every rank computes the same global plan from the same prepared
rows and derives its own steps from it, so all ranks agree on the step count without asking each
other. :func:`plan_fingerprint` digests the plan so the driver can compare it across ranks once
(docs/design.md#coordination-protocol).

Batches (docs/design.md#batches-sized-by-tokens)
-------------------------------------------------
Rows are sorted by length, longest first (as lm-eval does, so an out-of-memory shows on the first
batch), and cut into batches either of ``batch_size`` rows or, with a token budget, of as many rows
as fit ``rows x (cached prefix + padded length) <= token_budget`` (similar lengths share a batch,
which keeps padding low). :func:`default_tokens_per_batch` derives the budget from the model's
device memory.

Shared prefixes (docs/design.md#shared-prefix-evaluation)
----------------------------------------------------------
Rows of the subjects in :func:`~nemo_moe_export.evaluate.prefixes.find_shared_prefixes` are planned
in *units*: one *prefix* forward computes the KV cache of a few subjects' prefixes, then *suffix*
forwards run those subjects' rows (several subjects packed into one forward) continuing from that
cache. A prefix forward is a step like any other: every rank still runs exactly one forward per
step. Units are built independently of the number of ranks, so every layout runs the same
forwards; a unit's suffix rows attend at most :data:`UNIT_BATCHES` budgets (big subjects are
split into several units, each computing the prefix again), so units stay small enough to
balance over ranks.

Sharding policies (:data:`~nemo_moe_export.evaluate.options.POLICIES`; docs/design.md#mmlu-definition)
---------------------------------------------------------------------------------------------------
Units go to shards longest first, each to the shard with the fewest steps so far (ties: the lowest
shard), so with one-batch units (no shared prefix) rank ``r`` of ``S`` takes batches ``r, r + S,
...`` and each step holds ``S`` consecutive batches of the length-sorted order.

* ``lockstep`` (default): shards are the whole data-parallel group, EP peers included, so every
  rank does distinct, useful work; step counts are equalised with dummy forwards. Our EP all-to-all
  takes uneven splits, so EP peers may run forwards of different shapes.
* ``expert_dp``: the known fix. EP peers run identical forwards; shards are the expert-DP group
  only. Step counts are equalised over the whole DP group as well, so an FSDP shard group
  spanning several EP groups cannot hang either.
* ``naive``: dense-DP shards with uneven step counts and no dummy forwards. **Unsafe with EP or
  FSDP** (it is what hangs); it exists only so a test can show the hazard is real and that it is
  reported as an error rather than a hang.

When shapes must match across ranks (``uniform_shapes``; e.g. a dispatcher with fixed-capacity
buffers or sequence-parallel regions), every rank pads its step to the same ``[rows, length]``,
planned up front from the global plan (the largest batch of that step), so no extra communication
is needed. ``uniform_shapes=None`` detects it
(:func:`~nemo_moe_export.evaluate.runner.wants_uniform_shapes`); shared prefixes are then off.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.options import POLICIES
from nemo_moe_export.evaluate.prefix_attention import shares_prefix_keys
from nemo_moe_export.evaluate.prefixes import SharedPrefix
from nemo_moe_export.evaluate.prepare import PreparedQuestions, Row
from nemo_moe_export.options import require
from nemo_moe_export.parallel import ParallelLayout

__all__ = ["Batch", "StepPlan", "default_tokens_per_batch", "plan_batches", "plan_fingerprint", "plan_steps"]

UNIT_BATCHES = 4
"""A unit's suffix rows attend at most this many token budgets (or ``batch_size`` rows this many times)."""


@dataclass(frozen=True)
class Batch:
    """One forward of the global plan.

    A *rows* batch feeds whole rows; a *prefix* batch (``prefixes``) computes the KV cache of those
    shared prefixes, left-padded to ``length``; a *suffix* batch (``after``) feeds its rows without
    their prefix, continuing from the cache of prefix batch ``after`` (``context`` tokens long).
    """

    batch_id: int
    rows: tuple[int, ...]  # row ids (none in a prefix batch)
    length: int  # padded length of what is fed
    real_tokens: int
    prefixes: tuple[int, ...] = ()  # SharedPrefix ids this prefix batch computes
    after: int | None = None  # the prefix batch a suffix batch continues
    context: int = 0  # cached tokens each row of a suffix batch attends before its own

    @property
    def kind(self) -> str:
        return "prefix" if self.prefixes else "rows" if self.after is None else "suffix"

    @property
    def n_rows(self) -> int:
        return len(self.prefixes) if self.prefixes else len(self.rows)


def plan_batches(rows: Sequence[Row], batch_size: int, *, token_budget: int = 0,
                 prefixes: Sequence[SharedPrefix] = (), packed: bool = False) -> list[Batch]:
    """The global list of forwards; ``token_budget`` > 0 sizes batches by tokens instead of rows.

    Rows of ``prefixes`` are planned in units (a prefix batch, then its suffix batches); the other
    rows in batches of whole rows, first. With ``packed`` (prefix and suffix forwards packed into
    one row, the prefix's keys shared: :mod:`.prefix_attention`) a forward costs the tokens it
    feeds, no padding and no copied prefix. Deterministic: ties are broken by row id."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError("batch_size must be a positive integer", key="batch_size", expected=">= 1",
                         actual=batch_size)
    budget = _Budget(batch_size, token_budget)
    shared = {r for p in prefixes for r in p.rows}
    batches: list[Batch] = []
    plain = sorted((r for r in rows if r.row_id not in shared), key=lambda r: (-len(r.input_ids), r.row_id))
    for members in _cut([len(r.input_ids) for r in plain], 0, budget):
        chosen = [plain[i] for i in members]
        batches.append(Batch(len(batches), tuple(r.row_id for r in chosen), len(chosen[0].input_ids),
                             sum(len(r.input_ids) for r in chosen)))
    for unit in _units(rows, prefixes, budget, packed):
        _plan_unit(batches, rows, unit, budget, packed)
    return batches


@dataclass(frozen=True)
class _Budget:
    """What one forward may hold: ``batch_size`` rows, or with ``tokens`` > 0 that many attended tokens."""

    batch_size: int
    tokens: int

    def fits(self, n_rows: int, length: int, context: int) -> bool:
        """Whether ``n_rows`` rows of ``length`` tokens after ``context`` cached ones make one forward."""
        return n_rows * (context + length) <= self.tokens if self.tokens > 0 else n_rows <= self.batch_size

    def fits_packed(self, n_rows: int, tokens: int) -> bool:
        """Whether ``n_rows`` rows of ``tokens`` in all make one packed forward (no padding, no cached prefix)."""
        return tokens <= self.tokens if self.tokens > 0 else n_rows <= self.batch_size

    def share(self, attended: int) -> float:
        """The part of one forward a row attending ``attended`` tokens takes."""
        return attended / self.tokens if self.tokens > 0 else 1 / self.batch_size


def _cut(lengths: Sequence[int], context: int, budget: _Budget, packed: bool = False) -> list[list[int]]:
    """Indices of length-sorted (longest first) rows, cut into batches; a batch holds one row at least."""
    batches: list[list[int]] = []
    fed = 0  # tokens of the last batch, packed
    for i, length in enumerate(lengths):
        fits = (budget.fits_packed(len(batches[-1]) + 1, fed + length) if packed
                else budget.fits(len(batches[-1]) + 1, lengths[batches[-1][0]], context)) if batches else False
        if fits:
            batches[-1].append(i)
            fed += length
        else:
            batches.append([i])
            fed = length
    return batches


@dataclass
class _Unit:
    """One prefix forward and the rows continuing from it: ``members[prefix_id] -> row ids``."""

    lengths: dict[int, int]  # prefix_id -> prefix length, in the order the prefixes were added
    members: dict[int, list[int]]
    load: float = 0.0  # in forwards' worth of attended tokens

    def takes(self, prefix: SharedPrefix, cost: float, budget: _Budget, packed: bool) -> bool:
        """An empty unit takes anything (a forward holds one row at least)."""
        if not self.lengths:
            return True
        if prefix.prefix_id in self.lengths:
            return self.load + cost <= UNIT_BATCHES
        fits = (budget.fits_packed(len(self.lengths) + 1, sum(self.lengths.values()) + prefix.length) if packed
                else budget.fits(len(self.lengths) + 1, max([prefix.length, *self.lengths.values()]), 0))
        return self.load + cost <= UNIT_BATCHES and fits

    def add(self, prefix: SharedPrefix, row_id: int, cost: float) -> None:
        self.lengths[prefix.prefix_id] = prefix.length
        self.members.setdefault(prefix.prefix_id, []).append(row_id)
        self.load += cost


def _units(rows: Sequence[Row], prefixes: Sequence[SharedPrefix], budget: _Budget, packed: bool) -> list[_Unit]:
    """Longest prefixes first, packed into units while the prefix forward and the unit's rows fit.
    A subject opens a new unit unless it fits whole in the current one; one too big for any unit
    is split over several (each computes the prefix again)."""
    units: list[_Unit] = []
    for prefix in sorted(prefixes, key=lambda p: (-p.length, p.prefix_id)):
        members = sorted(prefix.rows, key=lambda r: (-len(rows[r].input_ids), r))
        costs = [budget.share(len(rows[r].input_ids) - (prefix.length if packed else 0)) for r in members]
        if not units or not units[-1].takes(prefix, sum(costs), budget, packed):
            units.append(_Unit({}, {}))
        for row_id, cost in zip(members, costs):
            if not units[-1].takes(prefix, cost, budget, packed):
                units.append(_Unit({}, {}))
            units[-1].add(prefix, row_id, cost)
    return units


def _plan_unit(batches: list[Batch], rows: Sequence[Row], unit: _Unit, budget: _Budget, packed: bool) -> None:
    """Append one prefix batch and the suffix batches of its rows (several subjects mixed)."""
    context = max(unit.lengths.values())
    prefix_batch = Batch(len(batches), (), context, sum(unit.lengths.values()), prefixes=tuple(unit.lengths))
    batches.append(prefix_batch)
    cut_at = {r: unit.lengths[p] for p, members in unit.members.items() for r in members}
    suffix = sorted(cut_at, key=lambda r: (-(len(rows[r].input_ids) - cut_at[r]), r))
    lengths = [len(rows[r].input_ids) - cut_at[r] for r in suffix]
    for members in _cut(lengths, context, budget, packed):
        batches.append(Batch(len(batches), tuple(suffix[i] for i in members), lengths[members[0]],
                             sum(lengths[i] for i in members), after=prefix_batch.batch_id, context=context))


@dataclass(frozen=True)
class StepPlan:
    """What this rank runs at each step.

    ``batch_of_step[s]`` is a global batch id, or None for a dummy forward (result discarded).
    ``shapes[s]`` is the ``(rows, length)`` every rank pads step ``s`` to when shapes must match,
    else None (each batch keeps its own shape, dummies are one token).
    """

    policy: str
    shard_rank: int
    shard_size: int
    batch_of_step: tuple[int | None, ...]
    shapes: tuple[tuple[int, int], ...] | None

    @property
    def n_steps(self) -> int:
        return len(self.batch_of_step)


def plan_steps(batches: Sequence[Batch], policy: str, layout: ParallelLayout, *,
               uniform_shapes: bool | None = None) -> StepPlan:
    """This rank's steps under ``policy``; every rank derives its own from the same global plan.

    ``lockstep`` shards over the DP group, ``expert_dp`` over the expert-DP group (EP peers share a
    shard index, hence identical forwards); both run the same number of steps everywhere, the
    most any shard has. ``naive`` shards over the DP group and runs only its own forwards (uneven
    step counts: unsafe). ``uniform_shapes``: plan one padded shape per step for every rank. The
    driver resolves the option's ``None`` ("detect from the model") before planning; here, with
    no model, ``None`` plans each batch at its own shape.
    """
    require(policy in POLICIES, "MMLU option", "policy", f"one of {list(POLICIES)}", policy)
    group = layout.edp if policy == "expert_dp" else layout.dp
    shard_rank, shard_size = group.rank, group.size
    sequences = _shard_sequences(batches, shard_size)
    if policy == "naive":
        return StepPlan(policy, shard_rank, shard_size, tuple(sequences[shard_rank]), None)
    n_steps = max(len(s) for s in sequences)
    padded = [tuple(s) + (None,) * (n_steps - len(s)) for s in sequences]
    shapes = None
    if uniform_shapes:
        shapes = tuple(_step_shape([batches[p[s]] for p in padded if p[s] is not None]) for s in range(n_steps))
    return StepPlan(policy, shard_rank, shard_size, padded[shard_rank], shapes)


def _shard_sequences(batches: Sequence[Batch], shard_size: int) -> list[list[int]]:
    """Each shard's batch ids in order: units (a prefix batch with its suffix batches, or one rows
    batch) longest first, each to the shard with the fewest steps so far."""
    units: list[list[int]] = []
    for b in batches:
        if b.kind == "suffix":
            units[-1].append(b.batch_id)
        else:
            units.append([b.batch_id])
    sequences: list[list[int]] = [[] for _ in range(shard_size)]
    for unit in sorted(units, key=len, reverse=True):  # stable: equal units keep the plan's order
        min(sequences, key=len).extend(unit)  # min() returns the first, i.e. lowest, shard on a tie
    return sequences


def _step_shape(step_batches: Sequence[Batch]) -> tuple[int, int]:
    """The shape every rank pads one step to: the most rows and the longest row of the step."""
    return max(len(b.rows) for b in step_batches), max(b.length for b in step_batches)


def plan_fingerprint(prepared: PreparedQuestions, batches: Sequence[Batch], plan: StepPlan) -> str:
    """Equal on all ranks iff they tokenized the same rows into the same global batches and steps."""
    h = hashlib.sha256(prepared.digest.encode())
    h.update(repr((plan.policy, plan.shard_size, plan.n_steps if plan.policy != "naive" else None)).encode())
    h.update(repr([(b.rows, b.prefixes, b.after, b.length) for b in batches]).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# The default token budget (docs/design.md#batches-sized-by-tokens)
# --------------------------------------------------------------------------------------------------

CUDA_MEMORY_FRACTION = 0.25  # of the GPU's total memory, for one forward's activations
CPU_ACTIVATION_BYTES = 192 << 20  # CPU ranks share the host's memory and caches
SCORES_LENGTH = 1024  # keys per query a materialised score matrix is sized for (a long 5-shot prompt)
MIN_TOKENS, MAX_TOKENS = 2048, 131072  # past this GPUs gain nothing either
# Full prompts are padded to their batch's longest row: past this a GPU forward is saturated (95-101
# TFLOP/s from 16k to 131k tokens on an H200, benchmarks/RESULTS.md "MMLU speed") and bigger batches
# only pad more (131k ran at 0.86x a 16k budget). 32k was at or above the best fixed batch size in
# both workloads measured (12 and 24 questions per subject); 16k fell 2% short in the second.
# Packed shared-prefix forwards are not padded and gain up to MAX_TOKENS.
FULL_PROMPT_MAX_TOKENS = 32768


def default_tokens_per_batch(model: Any, *, shared_prefix: bool) -> int:
    """``tokens_per_batch=None``: the activation memory of the model's device over what one
    attended token costs (:func:`bytes_per_token`), rounded down to a multiple of 1024, at most
    :data:`MAX_TOKENS`, and for full prompts (``shared_prefix=False``) at most
    :data:`FULL_PROMPT_MAX_TOKENS`.

    It reads the device's *total* memory (not what is free), so every rank of one GPU type derives
    the same budget and the plan fingerprints agree. On CPU, and with eager attention, the kernel
    materialises every query's attention scores, so a token costs those too: with a padding mask
    torch's CPU attention is its math kernel, and bigger batches get slower, not faster."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    scores = device.type != "cuda" or getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager"
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory * CUDA_MEMORY_FRACTION
    else:
        memory = CPU_ACTIVATION_BYTES
    packed = shared_prefix and shares_prefix_keys(model)
    tokens = int(memory // bytes_per_token(model, scores=scores, expanded_keys=packed)) // 1024 * 1024
    return max(MIN_TOKENS, min(MAX_TOKENS if shared_prefix else FULL_PROMPT_MAX_TOKENS, tokens))


def bytes_per_token(model: Any, *, scores: bool = False, expanded_keys: bool = False) -> int:
    """A rough upper bound of the memory one attended token needs in a forward, from the config:
    its KV cache over every layer (with ``expanded_keys``, the keys and values a packed prefix
    forward keeps, which for MLA are the expanded heads, not the latents), the keys and values one
    attention layer expands, the activations of a dense or MoE MLP (``top_k x
    moe_intermediate_size``) and, with ``scores``, one layer's fp32 attention scores over
    :data:`SCORES_LENGTH` keys."""
    c = getattr(model, "config", None)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    width = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    hidden = int(getattr(c, "hidden_size", 1024))
    heads = int(getattr(c, "num_attention_heads", 16))
    head_dim = int(getattr(c, "qk_head_dim", None) or getattr(c, "head_dim", None) or hidden // heads)
    v_dim = int(getattr(c, "v_head_dim", None) or head_dim)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    latent = getattr(c, "kv_lora_rank", None)
    cache = ((int(latent) + int(getattr(c, "qk_rope_head_dim", 0))) if latent and not expanded_keys
             else kv_heads * (head_dim + v_dim))
    top_k = int(getattr(c, "num_experts_per_tok", None) or getattr(c, "num_experts_per_token", None) or 1)
    mlp = max(int(getattr(c, "intermediate_size", 4 * hidden)),
              top_k * int(getattr(c, "moe_intermediate_size", None) or 0))
    layers = int(getattr(c, "num_hidden_layers", 1))
    per_token = layers * cache + heads * (head_dim + v_dim) * 2 + 3 * mlp + 8 * hidden
    return math.ceil(per_token * width) + (heads * SCORES_LENGTH * 4 if scores else 0)
