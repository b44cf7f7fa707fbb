"""The reference trainer of the embedded recipe: a tiny transformers MoE, really sharded, really trained.

It exists so the plugin's hooks run inside a genuine distributed training loop on CPU ranks:
``fully_shard`` (FSDP / HSDP), real expert parallelism (all-to-all routing), or both; with
``model.backend: megatron_core`` the same loop trains a megatron-core ``GPTModel`` under
``parallel_state`` (docs/design.md#megatron-core-models). It trains on
the synthetic multiple-choice corpus (``job/data.py``) formatted exactly as the MMLU evaluation
will see it, with the loss on the answer letter only.

Gradient averaging: FSDP2 averages the gradients of the parameters it shards over its mesh. What
it does not shard is averaged here: replicated dense parameters over the world, expert-parallel
experts over their expert-data-parallel group (each expert already sums the gradients of every
token routed to it from its EP peers), both divided by the world size, so every strategy optimises
the same global mean loss.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nemo_moe_export.config import BACKENDS, ModelConfig, ParallelConfig, TrainerConfig
from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.callback import LOSS_HISTORY_KEY
from nemo_moe_export.evaluate.data import load_mmlu
from nemo_moe_export.evaluate.evaluator import phase_coordinator
from nemo_moe_export.evaluate.prompts import build_prompt, select_fewshot
from nemo_moe_export.evaluate.runner import wants_uniform_shapes
from nemo_moe_export.expert_parallel import apply_expert_parallel
from nemo_moe_export.hooks import Hook, RecipeContext
from nemo_moe_export.job.checks import check_strategy
from nemo_moe_export.job.pipelined import shard_pipelined
from nemo_moe_export.megatron.recipe import build_recipe_model
from nemo_moe_export.parallel import (Coordinator, ParallelLayout, bound_groups, discover_layout, dist_info,
                                      init_expert_parallel, model_groups)
from nemo_moe_export.progress import Progress
from nemo_moe_export.tiny_models import build_model

__all__ = ["TrainState", "build_model", "build_sharded_model", "shard_model", "train"]

@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    seconds: float = 0.0


def build_sharded_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, vocab_size: int,
                        pad_token_id: int | None = None, device: str = "cpu") -> tuple[Any, ParallelLayout]:
    """The recipe's model, sharded, with its layout: a transformers model built then sharded as
    ``parallel`` says, or (``model.backend: megatron_core``) a megatron-core model that
    ``parallel_state`` shards while it is built (``nemo_moe_export/megatron/recipe.py``)."""
    if model_cfg.backend not in BACKENDS:
        raise InputError("unknown model backend", key="model.backend", expected=BACKENDS,
                         actual=repr(model_cfg.backend))
    if model_cfg.backend == "megatron_core":
        model, layout = build_recipe_model(model_cfg, parallel_cfg, vocab_size=vocab_size, device=device)
    else:
        model = build_model(model_cfg, vocab_size=vocab_size, pad_token_id=pad_token_id, device=device)
        info = dist_info()
        if parallel_cfg.pp_size > 1 and info.initialized:
            model, layout = shard_pipelined(model, parallel_cfg, info.world_size, device=device,
                                            shard_other_dtypes=_shard_other_dtype_modules)
        else:
            model, layout = shard_model(model, parallel_cfg, device=device)
    # A mesh's or a framework's groups wait torch's 30-minute default unless told: every group the
    # model's collectives run on waits parallel.timeout_s at most (docs/design.md#coordination-protocol).
    bound_groups(model_groups(model, layout), parallel_cfg.timeout_s)
    return model, layout


def shard_model(model: Any, cfg: ParallelConfig, *, device: str = "cpu") -> tuple[Any, ParallelLayout]:
    """Shard ``model`` in place as ``cfg.strategy`` says; returns it with its parallel layout."""
    info = dist_info()
    world = info.world_size
    check_strategy(cfg, world if info.initialized else None)
    if not info.initialized:
        return model, discover_layout()
    if cfg.strategy in ("fsdp", "hsdp"):
        if cfg.strategy == "hsdp":
            mesh = init_device_mesh(device, (cfg.replicate, world // cfg.replicate),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp_shard",))
        _shard_other_dtype_modules(model, mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, discover_layout(mesh)

    layout = init_expert_parallel(cfg.ep_size, timeout_s=cfg.timeout_s)
    apply_expert_parallel(model, layout)
    if cfg.strategy == "ep_fsdp":
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp_shard",))
        experts = {p for p in model.parameters() if isinstance(p, DTensor)}
        _shard_other_dtype_modules(model, mesh, ignored_params=experts)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=experts)
        fully_shard(model, mesh=mesh, ignored_params=experts)
    return model, layout


def _shard_other_dtype_modules(model: Any, mesh: Any, ignored_params: set | None = None) -> None:
    """Give modules whose parameters keep another dtype their own FSDP unit.

    transformers keeps some weights in float32 in a bf16 model (DeepSeek-V3's router
    ``mlp.gate.weight``, ``_keep_in_fp32_modules_strict``), and FSDP2 flattens one dtype per unit.
    """
    dtype = model.dtype
    for module in list(model.modules()):
        own = [p for p in module.parameters(recurse=False) if not ignored_params or p not in ignored_params]
        if module is not model and any(p.dtype != dtype for p in own):
            fully_shard(module, mesh=mesh, ignored_params=ignored_params)


def _sync_unsharded_grads(model: Any, layout: ParallelLayout) -> None:
    """Average what FSDP2 does not: plain replicated params over the data-parallel group (the world,
    or a stage's ranks under pipeline stages), EP experts over edp, both divided by its size."""
    world = layout.dp.size
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p, DTensor):
            if p.device_mesh.mesh_dim_names and "ep" in p.device_mesh.mesh_dim_names:
                grad = p.grad.to_local()
                if layout.edp.size > 1:
                    dist.all_reduce(grad, group=layout.edp.group)
                grad.div_(world)
            continue  # FSDP-managed: already averaged by reduce-scatter
        if not getattr(p, "allreduce", True):  # megatron-core's mark of an expert-parallel parameter
            if layout.edp.size > 1:
                dist.all_reduce(p.grad, group=layout.edp.group)
            p.grad.div_(world)
            continue
        dist.all_reduce(p.grad, group=layout.dp.group)
        p.grad.div_(world)


def _clip_grad_norm(model: Any, max_norm: float, layout: ParallelLayout | None = None) -> float:
    """Global gradient norm over every parameter, whatever its sharding; clips to ``max_norm``.

    Each parameter's norm is taken as a DTensor where it is one (DTensor reduces over its own mesh,
    counting replicas once), so FSDP shards, HSDP replicas and EP experts all count exactly once.
    megatron-core's expert parameters are plain tensors holding other experts on each EP peer:
    their squares are summed over the EP group, so every rank clips by the same norm.
    """
    squares, expert_squares = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad.float())
        if not getattr(p, "allreduce", True):
            expert_squares.append(norm ** 2)
            continue
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    if expert_squares:
        experts = torch.stack(expert_squares).sum()
        if layout is not None and layout.ep.size > 1:
            dist.all_reduce(experts, group=layout.ep.group)
        squares.append(experts)
    total_squares = torch.stack(squares).sum() if squares else torch.zeros(())
    if layout is not None and layout.pp.size > 1:  # each pipeline rank holds other stages' parameters
        dist.all_reduce(total_squares, group=layout.pp.group)
    total = float(total_squares.sqrt())
    if max_norm > 0 and total > max_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(max_norm / (total + 1e-6))
    return total


def _answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each position's next token where ``labels`` name one (the answer letter)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _forward_backward(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The batch's loss, its gradients accumulated: through the model's own pipeline schedule (1F1B,
    ``model.train_step``) for pipeline stages, else one forward and backward."""
    train_step = getattr(model, "train_step", None)  # a model split into pipeline stages runs its schedule
    if train_step is not None:
        return train_step(ids, labels, _answer_loss, attention_mask=mask)
    loss = _answer_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
    loss.backward()
    return loss


def _training_examples(data_root: str, tokenizer: Any, k_shot: int) -> list[list[int]]:
    """Token ids of every training question, formatted as the MMLU evaluation formats it."""
    dev = load_mmlu(data_root, splits=("dev",))
    train = load_mmlu(data_root, splits=("train",))
    by_subject: dict[str, list] = {}
    for q in dev:
        by_subject.setdefault(q.subject, []).append(q)
    examples = []
    for q in train:
        prompt = build_prompt(q, select_fewshot(by_subject.get(q.subject, []), k_shot, q))
        examples.append(tokenizer(prompt + " " + "ABCD"[q.answer])["input_ids"])
    return examples


def _padded_batch(batch: list[list[int]], pad: int, width: int | None, device: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask and labels of ``batch``, right-padded to ``width`` (None: the
    longest example); the loss is on the last token only, the answer letter."""
    width = width or max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
        labels[i, len(x) - 1] = x[-1]
    return ids.to(device), mask.to(device), labels.to(device)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The step's loss averaged over every rank, the number each rank logs."""
    value = loss.detach().clone()
    info = dist_info()
    if info.initialized and info.world_size > 1:
        dist.all_reduce(value)
        value /= info.world_size
    return float(value)


@contextmanager
def _reported(coordinator: Coordinator, step: str) -> Iterator[None]:
    """A training step whose failure on a rank of a group is named by every rank of it: a rank that
    raised reports its exception; a rank whose collective timed out or lost its peer (a stalled,
    failed or dead rank) reports that it waited, and the ranks that sent no report are the culprits
    (``Coordinator.leave``; docs/design.md#coordination-protocol). Alone, the error is raised as is."""
    try:
        yield
    except Exception as exc:
        if not coordinator.active:
            raise
        raise coordinator.leave(step, exc) from exc


def train(model: Any, layout: ParallelLayout, tokenizer: Any, data_root: str, cfg: TrainerConfig, *,
          k_shot: int, hooks: Hook | None = None, ctx: RecipeContext | None = None,
          log: Any = print) -> TrainState:
    """Train with AdamW, loss on the answer letter only, gradients clipped to ``cfg.grad_clip`` by
    their global norm; calls ``hooks.on_step_end(ctx, step)`` after every optimizer step.

    ``k_shot`` formats the training prompts as the MMLU evaluation will (the recipe passes
    ``mmlu.k_shot``; no default here, so the two cannot drift apart).
    """
    if hooks is not None and ctx is None:
        raise InputError("hooks need the context they share", key="ctx",
                         expected="a RecipeContext (nemo_moe_export.hooks.make_context)", actual=None)
    examples = _training_examples(data_root, tokenizer, k_shot)
    if not examples:
        raise InputError("no training questions", key=data_root, expected="train/*_train.csv", actual=0)
    # each data-parallel rank its own stream of examples (the stages of one pipeline share theirs)
    rng = random.Random(cfg.seed * 7919 + layout.dp.rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps))
                                                 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.max_steps) / cfg.max_steps)))
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    # megatron-core's allgather dispatcher exchanges equal-shaped buffers: every rank pads to one width
    uniform_width = max(len(x) for x in examples) if wants_uniform_shapes(model) else None
    state = TrainState()
    progress = Progress(cfg.max_steps, "train", enabled=cfg.progress, min_interval_s=2.0)  # on global rank 0
    start = time.perf_counter()
    # Only read when a step fails: the ranks coupled by data or pipeline parallelism report there
    # (through the store, nothing sent while all is well), so every survivor names the culprit.
    coordinator = phase_coordinator(layout, name="train")
    model.train()
    for step in range(1, cfg.max_steps + 1):
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        ids, mask, labels = _padded_batch(batch, pad, uniform_width, device)
        with _reported(coordinator, f"{step} of {cfg.max_steps}"):
            optimizer.zero_grad(set_to_none=True)
            loss = _forward_backward(model, ids, mask, labels)
            _sync_unsharded_grads(model, layout)
            state.grad_norms.append(_clip_grad_norm(model, cfg.grad_clip, layout))
            optimizer.step()
            schedule.step()
            value = _mean_over_ranks(loss)
        state.step, state.losses = step, state.losses + [value]
        progress.update(1, postfix=f"loss={value:.3f}")
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            log(f"step {step}/{cfg.max_steps} loss {value:.4f} grad norm {state.grad_norms[-1]:.3f} "
                f"lr {schedule.get_last_lr()[0]:.2e}")
        if hooks is not None:
            ctx.results.setdefault(LOSS_HISTORY_KEY, []).append([step, value])  # the MMLU charts read it
            hooks.on_step_end(ctx, step)
    progress.close()
    state.seconds = time.perf_counter() - start
    model.eval()
    return state
