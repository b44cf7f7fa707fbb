"""Everything about a recipe's config that can be checked before any process group, model or step.

A late config error costs a whole training run, so the recipe refuses, up front and in one line,
whatever it can know is wrong from the config, the world size and the filesystem
(docs/design.md#faults-and-how-each-is-reported):

* keys and stages (``validate_config``, :func:`check_stages`);
* the parallel layout against the world size and the model: the strategy and device are known
  ones, HSDP replicas and the EP size divide the ranks, the EP size divides the expert count;
* the model, trainer and synthetic-data numbers (a family we can build, positive sizes and counts,
  enough dev questions for ``k_shot``);
* paths that must exist: ``mmlu.data_path`` (loaded, so an empty or non-UTF-8 file is named now),
  ``export.from_checkpoint`` (a training checkpoint whose tensors fit the configured model) and the
  export target's parent.

``job/stages.py`` runs these, and then builds every stage's options, on every rank before
``init_distributed``; the ``--nproc`` launcher runs the same checks once before it starts torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nemo_moe_export.config import BACKENDS, STAGES, model_dtype, validate_config
from nemo_moe_export.convert.index import read_dcp_metadata
from nemo_moe_export.errors import InputError
from nemo_moe_export.evaluate.data import load_mmlu, require_dev_examples
from nemo_moe_export.evaluate.task import load_questions, load_task
from nemo_moe_export.job.data import SUBJECTS
from nemo_moe_export.job.foreign import check_foreign, foreign_format
from nemo_moe_export.megatron.recipe import check_megatron_pipeline
from nemo_moe_export.parallel import DEVICES
from nemo_moe_export.tiny_models import FAMILIES, build_model

__all__ = ["STRATEGIES", "check_config", "check_export_target", "check_stages", "check_strategy", "export_target"]

STRATEGIES = ("fsdp", "hsdp", "ep", "ep_fsdp")  # what trainer.shard_model lays out

CHECKPOINT_METADATA = ".metadata"  # what torch.distributed.checkpoint writes beside its shards


def check_config(cfg: Any, world_size: int | None = None) -> list[str]:
    """Check ``cfg`` for a run on ``world_size`` ranks (None: one process, nothing is sharded);
    returns the stages to run."""
    validate_config(cfg)
    stages = check_stages(cfg)
    check_parallel(cfg.parallel, cfg.model, world_size)
    _check_model(cfg.model)
    _check_trainer(cfg.trainer, stages)
    _check_microbatches(cfg.parallel, cfg.trainer, stages)
    _check_data(cfg, stages)
    if cfg.export.from_checkpoint:
        foreign = foreign_format(cfg.export.from_checkpoint)
        if foreign is None:
            check_training_checkpoint(cfg.export.from_checkpoint, cfg.model)
        else:  # another framework's: converted, never loaded (job/foreign.py)
            check_foreign(cfg, stages, foreign)
    if "export" in stages:
        _check_target_parent(export_target(cfg, os.path.abspath(cfg.run_dir)), os.path.abspath(cfg.run_dir))
    return stages


def check_stages(cfg: Any) -> list[str]:
    """Stages must be known, unique and in pipeline order; a stage run alone must have its inputs."""
    stages = list(cfg.stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InputError("unknown stage", key="stages", expected=f"a subset of {list(STAGES)}",
                         actual=unknown)
    if len(set(stages)) != len(stages) or stages != sorted(stages, key=STAGES.index):
        raise InputError("stages must be unique and in pipeline order", key="stages",
                         expected=[s for s in STAGES if s in stages], actual=stages)
    if "train" not in stages and {"mmlu", "export"} & set(stages) and not cfg.export.from_checkpoint:
        raise InputError(
            "mmlu/export without train need a trained checkpoint", key="export.from_checkpoint",
            expected="a checkpoint directory written by the train stage ({run_dir}/checkpoint)", actual=None,
            hint="run with stages=[export] export.from_checkpoint=runs/<name>/checkpoint",
        )
    return stages


def export_target(cfg: Any, run_dir: str) -> str:
    """Where the export writes (and verify reads): ``export.output_dir``, else ``{run_dir}/hf``."""
    return os.path.abspath(cfg.export.output_dir or os.path.join(run_dir, "hf"))


def check_export_target(target: str, overwrite: str) -> None:
    """Refuse an existing export target up front when ``overwrite`` is ``"error"``: re-running a
    recipe into the same ``run_dir`` fails in a second, not after training (the export step
    itself would refuse it only then)."""
    if overwrite == "error" and os.path.exists(target):
        raise InputError(
            "export target already exists", key="export.output_dir",
            expected=f"no directory at {target} (export.overwrite=error)", actual="an existing path",
            hint="pass export.overwrite=replace to replace it atomically after training, "
                 "or choose another run_dir or export.output_dir",
        )


def _check_target_parent(target: str, run_dir: str) -> None:
    """The export writes beside its target: the parent must exist (``run_dir`` is created by the run)."""
    parent = os.path.dirname(target)
    if parent != run_dir and not os.path.isdir(parent):
        raise InputError("the export target's folder does not exist", key="export.output_dir",
                         expected=f"an existing directory {parent}", actual="missing",
                         hint="create it first, or point export.output_dir into an existing folder")


# --- parallel layout and model ----------------------------------------------------------------------


def check_parallel(parallel: Any, model: Any, world_size: int | None) -> None:
    """The strategy and device are known; on ``world_size`` ranks, HSDP replicas and the EP size
    divide the ranks and the EP size divides the expert count (experts split in equal blocks)."""
    check_strategy(parallel)
    _choice("parallel.device", parallel.device, DEVICES, "unknown device")
    _positive("parallel.timeout_s", parallel.timeout_s, number=True)
    _positive("parallel.ep_size", parallel.ep_size)
    _positive("parallel.replicate", parallel.replicate)
    _positive("parallel.pp_size", parallel.pp_size)
    _positive("parallel.stages_per_rank", parallel.stages_per_rank)
    _check_model_parallel(parallel)
    if world_size is None:
        return  # one process: nothing is sharded (trainer.shard_model)
    stage_ranks = _check_pipeline(parallel, model, world_size)
    check_strategy(parallel, stage_ranks)
    if parallel.strategy in ("ep", "ep_fsdp"):
        ep = parallel.ep_size
        if stage_ranks % ep:
            raise InputError(
                "the expert-parallel size must divide the ranks" + _of_a_stage(parallel), key="parallel.ep_size",
                expected=f"a divisor of the {stage_ranks} ranks: {_divisors(stage_ranks)}", actual=ep,
                hint="change parallel.ep_size or the number of ranks (--nproc)")
        if model.n_experts % ep:
            fits = [d for d in _divisors(world_size) if model.n_experts % d == 0]
            raise InputError(
                "the expert count must divide by the expert-parallel size", key="parallel.ep_size",
                expected=f"a divisor of model.n_experts={model.n_experts} and of {world_size} ranks: {fits}",
                actual=ep, hint=f"or make model.n_experts a multiple of {ep}")


def check_strategy(parallel: Any, stage_ranks: int | None = None) -> None:
    """``parallel.strategy`` is a known one and, on ``stage_ranks`` ranks (a pipeline stage's; None:
    not known yet), HSDP replicas divide them: the one check of both, which the recipe runs up
    front and ``trainer.shard_model`` again on the ranks it shards."""
    _choice("parallel.strategy", parallel.strategy, STRATEGIES, "unknown parallel strategy")
    if parallel.strategy != "hsdp" or stage_ranks is None:
        return
    _positive("parallel.replicate", parallel.replicate)
    if stage_ranks % parallel.replicate:
        raise InputError(
            "HSDP replicas must divide the ranks" + _of_a_stage(parallel), key="parallel.replicate",
            expected=f"a divisor of the {stage_ranks} ranks: {_divisors(stage_ranks)}", actual=parallel.replicate)


def _check_model_parallel(parallel: Any) -> None:
    """TP, CP, expert TP and sequence parallelism are the planner's (``nemo-moe-export plan``) for
    now: the recipe builds none of those meshes, so it refuses them rather than run without them."""
    for name in ("tp_size", "cp_size", "etp_size"):
        _positive(f"parallel.{name}", getattr(parallel, name))
        if getattr(parallel, name) != 1:
            raise InputError("the recipe does not run this kind of parallelism", key=f"parallel.{name}",
                             expected=1, actual=getattr(parallel, name),
                             hint="plan such a job with `nemo-moe-export plan --tp/--cp/--etp`; torch TP "
                                  "models export through nemo_moe_export.job.tensor_parallel")
    if parallel.sequence_parallel:
        raise InputError("the recipe does not run sequence parallelism", key="parallel.sequence_parallel",
                         expected=False, actual=True, hint="plan such a job with `nemo-moe-export plan --sp`")


def _of_a_stage(parallel: Any) -> str:
    pp = getattr(parallel, "pp_size", 1) or 1  # the planner's layouts may have no pipeline fields
    return f" of a pipeline stage (the world / parallel.pp_size={pp})" if pp > 1 else ""


def _check_pipeline(parallel: Any, model: Any, world_size: int) -> int:
    """Pipeline stages fit the ranks and the layers (docs/design.md#pipeline-stages); returns the
    ranks of one stage (the world without pipeline stages)."""
    pp = parallel.pp_size
    if world_size % pp:
        raise InputError("the pipeline size must divide the ranks", key="parallel.pp_size",
                         expected=f"a divisor of the {world_size} ranks: {_divisors(world_size)}", actual=pp)
    if pp == 1 and parallel.stages_per_rank == 1 and not parallel.layers_per_stage:
        return world_size
    if model.backend == "megatron_core":  # one model chunk per rank, megatron's first/last-stage split
        check_megatron_pipeline(parallel, model)
    stages = pp * parallel.stages_per_rank
    split = list(parallel.layers_per_stage or [])
    if split and (len(split) != stages or sum(split) != model.num_layers or min(split) < 1):
        raise InputError("parallel.layers_per_stage does not split the decoder layers", key="parallel.layers_per_stage",
                         expected=f"{stages} counts >= 1 (pp_size x stages_per_rank) summing to "
                                  f"model.num_layers={model.num_layers}", actual=split)
    if stages > model.num_layers:
        raise InputError("more pipeline stages than decoder layers", key="parallel.pp_size",
                         expected=f"pp_size x stages_per_rank <= model.num_layers={model.num_layers}",
                         actual=f"{pp} x {parallel.stages_per_rank} = {stages}")
    if parallel.microbatches < 0:
        raise InputError("negative microbatch count", key="parallel.microbatches",
                         expected=">= 0 (0: twice the stages)", actual=parallel.microbatches)
    return world_size // pp


def _check_model(model: Any) -> None:
    _choice("model.backend", model.backend, BACKENDS, "unknown model backend")
    _choice("model.family", model.family, FAMILIES, "unknown model family")
    model_dtype(model)
    for name in ("n_experts", "hidden_size", "moe_intermediate_size", "num_layers"):
        _positive(f"model.{name}", getattr(model, name))


def _check_trainer(trainer: Any, stages: list[str]) -> None:
    if "train" in stages:
        _positive("trainer.max_steps", trainer.max_steps)
    _positive("trainer.batch_size", trainer.batch_size)
    _positive("trainer.log_every", trainer.log_every)
    _positive("trainer.lr", trainer.lr, number=True)
    for name in ("warmup_steps", "grad_clip", "weight_decay"):
        value = getattr(trainer, name)
        if value < 0:
            raise InputError("must not be negative", key=f"trainer.{name}", expected=">= 0", actual=value)


def _check_microbatches(parallel: Any, trainer: Any, stages: list[str]) -> None:
    """A pipelined training batch splits into equal microbatches (unequal ones would weigh rows
    unequally in the loss)."""
    if parallel.pp_size == 1 or "train" not in stages:
        return
    microbatches = parallel.microbatches or 2 * parallel.pp_size * parallel.stages_per_rank
    if trainer.batch_size % microbatches:
        raise InputError("the training batch must split into equal microbatches", key="trainer.batch_size",
                         expected=f"a multiple of {microbatches} microbatches (parallel.microbatches, "
                                  "0: twice the stages)", actual=trainer.batch_size)


# --- data and checkpoints --------------------------------------------------------------------------


def _check_data(cfg: Any, stages: list[str]) -> None:
    """The data the run will read: the synthetic corpus' numbers, or ``mmlu.data_path`` loaded now
    (as the evaluation's task reads it; the trainer reads MMLU-format data only, the synthetic
    corpus for any other task)."""
    evaluates = cfg.mmlu.enabled and bool({"train", "mmlu", "verify"} & set(stages))
    if "train" not in stages and not evaluates:
        return
    task = load_task(cfg.mmlu.task)
    if cfg.mmlu.data_path is None:
        if evaluates and task.dataset_format != "mmlu":
            raise InputError(f"task {task.name!r} needs its documents", key="mmlu.data_path",
                             expected=f"the folder of {task.name}'s files", actual=None,
                             hint="the synthetic corpus the recipe writes is MMLU-shaped")
        _check_synthetic_data(cfg, stages, evaluates)
        return
    subjects = list(cfg.mmlu.subjects) if cfg.mmlu.subjects else None
    if task.dataset_format != "mmlu":  # the trainer's data is the synthetic corpus
        _check_synthetic_data(cfg, stages, evaluates=False)
        if evaluates:
            _load_data(lambda: load_questions(task, cfg.mmlu.data_path, splits=[cfg.mmlu.split], subjects=subjects))
        return
    splits = ["dev"] + (["train"] if "train" in stages else []) + ([cfg.mmlu.split] if evaluates else [])
    questions = _load_data(lambda: load_mmlu(cfg.mmlu.data_path, splits=splits, subjects=subjects))
    if evaluates:
        subjects_evaluated = {q.subject for q in questions if q.split == cfg.mmlu.split}
        require_dev_examples([q for q in questions if q.split == "dev"], subjects_evaluated, cfg.mmlu.k_shot)


def _load_data(load: Callable[[], Any]) -> Any:
    try:
        return load()
    except InputError as exc:  # the loader names the file; say which setting led there
        raise InputError(f"mmlu.data_path: {exc.problem}", key=exc.key, expected=exc.expected,
                         actual=exc.actual, hint=exc.hint) from exc


def _check_synthetic_data(cfg: Any, stages: list[str], evaluates: bool) -> None:
    data = cfg.data
    unknown = sorted(set(data.subjects or ()) - set(SUBJECTS))
    if unknown:
        raise InputError("unknown synthetic subject", key="data.subjects", expected=f"some of {list(SUBJECTS)}",
                         actual=unknown, hint="or give your own data with mmlu.data_path")
    written = set(data.subjects or SUBJECTS)
    missing = sorted(set(cfg.mmlu.subjects or ()) - written)
    if evaluates and missing:
        raise InputError("MMLU subject(s) not in the synthetic corpus", key="mmlu.subjects",
                         expected=f"some of {sorted(written)}", actual=missing)
    if evaluates and cfg.mmlu.split != "test":
        raise InputError("the synthetic corpus has no such split", key="mmlu.split", expected="'test'",
                         actual=repr(cfg.mmlu.split), hint="or give your own data with mmlu.data_path")
    _positive("data.n_dev", data.n_dev)
    if "train" in stages:
        _positive("data.n_train", data.n_train)
    if evaluates:
        _positive("data.n_test", data.n_test)
        if data.n_dev < cfg.mmlu.k_shot:
            raise InputError("fewer dev questions than few-shot examples", key="data.n_dev",
                             expected=f">= mmlu.k_shot={cfg.mmlu.k_shot}", actual=data.n_dev)


def check_training_checkpoint(path: str, model: Any) -> None:
    """``path`` is what the train stage saves (a torch DCP checkpoint plus ``tokenizer/``), and its
    tensors are the ones the configured model has, shape for shape."""
    problem = _not_a_training_checkpoint(path)
    if problem:
        raise InputError(
            "export.from_checkpoint is not a training checkpoint", key="export.from_checkpoint",
            expected=f"a directory written by the train stage ({CHECKPOINT_METADATA} and tokenizer/)",
            actual=f"{path}: {problem}", hint="point it at {run_dir}/checkpoint of a finished training run")
    if model.backend != "transformers":
        return  # megatron-core's dist_checkpointing names its tensors its own way; it checks them on load
    stored = _stored_shapes(path)
    expected = _model_shapes(model, stored)
    differ = sorted(k for k in set(stored) | set(expected) if stored.get(k) != expected.get(k))
    if differ:
        key = differ[0]
        raise InputError(
            f"export.from_checkpoint does not fit the configured model ({len(differ)} tensor(s) differ)",
            key=key, expected=f"shape {expected.get(key, 'absent')} (the model config builds)",
            actual=f"{stored.get(key, 'absent')} in {path}",
            hint="use the model preset and overrides the checkpoint was trained with (its run's config.json)")


def _not_a_training_checkpoint(path: str) -> str | None:
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "a file, not a directory"
    missing = [n for n in (CHECKPOINT_METADATA, "tokenizer") if not os.path.exists(os.path.join(path, n))]
    if missing:
        return f"no {' or '.join(missing)} in it (found {sorted(os.listdir(path))[:10]})"
    return None


def _stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The stored tensors' shapes, from the checkpoint's ``.metadata`` read through the conversion's
    restricted unpickler (only DCP's own records: a file a user hands us names no other global)."""
    try:
        metadata = read_dcp_metadata(os.path.join(path, CHECKPOINT_METADATA))
    except InputError as exc:  # a truncated or foreign .metadata file
        raise InputError("unreadable training checkpoint metadata", key="export.from_checkpoint",
                         expected="a torch.distributed.checkpoint .metadata file",
                         actual=f"{os.path.join(path, CHECKPOINT_METADATA)}: {exc.actual}",
                         ) from exc
    return {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}


def _model_shapes(model_cfg: Any, stored: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes of the configured model's state dict, built on the meta device (no memory, no init);
    the vocabulary is the checkpoint's own (its tokenizer's), as the restore builds it."""
    embedding = next((shape for key, shape in stored.items() if key.endswith("embed_tokens.weight")), (2,))
    model = build_model(model_cfg, vocab_size=embedding[0], device="meta")
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


# --- small checks ------------------------------------------------------------------------------------


def _choice(key: str, value: Any, allowed: tuple[str, ...], problem: str) -> None:
    if value not in allowed:
        raise InputError(problem, key=key, expected=f"one of {list(allowed)}", actual=repr(value))


def _positive(key: str, value: Any, *, number: bool = False) -> None:
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise InputError("must be positive", key=key, expected="a number > 0" if number else "an integer >= 1",
                         actual=repr(value))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
