"""NeMo AutoModel: its models, its meshes and its ``train_ft`` recipe (docs/design.md#nemo-automodel).

AutoModel's MoE models (DeepSeek-V3, Kimi K2, Qwen3-MoE, ...) keep the routed experts grouped,
``mlp.experts.gate_and_up_projs`` [E, H, 2I] and ``mlp.experts.down_projs`` [E, I, H]; every other
key already has its HF name. The shared adapter tables cover that layout, so the export, ``to_hf``
and ``from_hf`` take AutoModel's model (or its pipeline stage modules) as they are, after
``parallelize_model`` or ``AutoPipeline``, reading each tensor's placements:

    from nemo_moe_export import export_hf_checkpoint
    export_hf_checkpoint("out/hf", model)                       # FSDP2 / EP: AutoModel's model
    export_hf_checkpoint("out/hf", autopipeline.parts, pp_group=mesh_context.device_mesh["pp"].get_group())

MMLU runs through AutoModel's own forward behind :class:`AutoModelCausalLM`, with the groups read
from AutoModel's meshes (:func:`automodel_layout`); under pipeline stages through AutoPipeline's own
schedule behind :class:`AutoPipelineCausalLM` (one forward-only ``eval()`` step of it per call):

    from nemo_moe_export import evaluate_mmlu
    layout = automodel_layout(mesh_context.device_mesh, mesh_context.moe_mesh)
    result = evaluate_mmlu(AutoModelCausalLM(model), tokenizer, test, dev, layout=layout)
    result = evaluate_mmlu(AutoPipelineCausalLM(autopipeline), tokenizer, test, dev, layout=layout)  # PP

AutoModel has no callback registry; a recipe subclass is the hook point. The recipe YAML names
``nemo_moe_export.integrations.automodel.MoEExportFinetuneRecipe`` (``TrainFinetuneRecipeForNextTokenPrediction``
with MMLU every N steps and at the end, and the no-gather export at the end) and configures it in a
``moe_export:`` section (``examples/automodel_moe_export.yaml``). Any other
recipe class can mix in :class:`MoEExportRecipeMixin` and call its three methods.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nemo_moe_export.adapters import StateDictAdapter, get_table
from nemo_moe_export.errors import InputError, current_rank
from nemo_moe_export.evaluate.callback import MMLUCallback
from nemo_moe_export.export import export_hf_checkpoint
from nemo_moe_export.hooks import make_context
from nemo_moe_export.integrations._install_hint import missing
from nemo_moe_export.parallel import RankGroup, discover_layout
from nemo_moe_export.pipeline.model import PipelinedCausalLM, reshard_stages
from nemo_moe_export.pipeline.stages import PipelineStageError, StageInfo, kept_positions
from nemo_moe_export.plugin import plugin_hooks

__all__ = ["AutoModelCausalLM", "AutoModelStateDictAdapter", "AutoPipelineCausalLM", "MoEExportFinetuneRecipe",
           "MoEExportRecipeMixin", "automodel_layout"]

_INSTALL = "pip install --no-deps nemo-automodel==0.7.0 megatron-fsdp==0.5.0 torchao==0.18.0 (see docs/automodel.md)"


class AutoModelCausalLM:
    """An AutoModel causal LM as the MMLU evaluator and the export call transformers models.

    AutoModel's forward takes ``logits_to_keep`` but reads a tensor of it as positions along the
    sequence, shared by every row, where transformers takes one list of positions per row; and it
    keeps no KV cache. This view's forward takes only ``input_ids``, ``attention_mask`` and
    ``position_ids``, so the evaluator projects the kept positions through a hook on the output
    embedding and evaluates full prompts (docs/design.md#nemo-automodel). Everything else
    (``config``, ``state_dict()``, ``eval()``, ``parameters()``, the fp32 patterns the export
    casting reads) is the model's own.
    """

    cache_unsupported_reason = "NeMo AutoModel's forward keeps no KV cache"

    def __init__(self, model: Any) -> None:
        self.__dict__["model"] = model

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:  # copy / pickle look attributes up before __init__ ran
            raise AttributeError(name)
        return getattr(model, name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Any:
        return self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)

    __call__ = forward


_KEPT = "nemo_moe_export_kept_positions"
"""The keyword that carries the scored positions ``[rows, n]`` to the stages: torch's schedule splits
it with the rows; our pre-hook takes it out before AutoModel's forward (which reads a
``logits_to_keep`` tensor differently) sees it."""


class AutoPipelineCausalLM(PipelinedCausalLM):
    """AutoModel's pipeline (``AutoPipeline``, built) as one transformers-style causal LM, forward
    only: ``.logits`` on every rank of the pipeline group (docs/design.md#nemo-automodel).

    Each call is one ``eval()`` step of AutoPipeline's own schedule (torch's forward-only step of
    it: 1F1B / interleaved, whichever AutoPipeline built) over its own ``PipelineStage`` objects and
    stage modules, so every stage runs AutoModel's own forward. AutoPipeline fixes the microbatch
    count (``pp_batch_size // pp_microbatch_size``) and shapes its stages per microbatch rows and
    length; a call pads its rows to a multiple of that count (one-token rows, dropped after), has
    AutoPipeline re-shape its stages to the call's microbatch (its ``update_seq_len``) and shapes
    them back to the training microbatch and length after, so AutoPipeline's next training step
    runs as it would have. On the last stage a pre-hook on ``lm_head`` keeps only the scored
    positions, which travel to it as a keyword the schedule splits with the rows; the last stage's
    logits are broadcast over the pipeline group. Every call starts and ends with the stage modules'
    ``fully_shard`` weights resharded, as a training step leaves them. ``dtype``: the returned
    logits' (default ``config.dtype``).
    """

    def __init__(self, autopipeline: Any, n_microbatches: int | None = None, *,
                 dtype: torch.dtype | None = None) -> None:
        stages = list(autopipeline.info.stages or ())
        if not stages or autopipeline.info.schedule is None:
            raise InputError("AutoPipeline has no stages", key="autopipeline", expected="a built AutoPipeline",
                             actual="no stages", hint="call autopipeline.build(model, ...) first")
        scheduled = autopipeline.pp_batch_size // autopipeline.pp_microbatch_size  # what AutoPipeline builds
        if n_microbatches not in (None, scheduled):
            raise InputError("AutoPipeline's schedule fixes the microbatch count", key="n_microbatches",
                             expected=scheduled, actual=n_microbatches,
                             hint="leave n_microbatches out: pp_batch_size // pp_microbatch_size")
        if any(getattr(s.submod, "_pp_return_hidden_states", False) is True for s in stages):
            raise InputError("AutoPipeline's last stage returns hidden states, not logits",
                             key="_pp_return_hidden_states", expected=False, actual=True,
                             hint="AutoModel's recipe sets it for a linear cross-entropy loss; evaluate MMLU "
                                  "with a logits loss (e.g. MaskedCrossEntropy)")
        # before Module.__init__: PipelinedCausalLM's constructor checks the parts through stage_info()
        self._infos = {id(s.submod): _info_of(s) for s in stages}
        super().__init__([s.submod for s in stages], [s.stage_index for s in stages], stages[0].num_stages,
                         stages[0].group, scheduled, dtype=dtype)
        self.autopipeline = autopipeline
        self._hooks = _StageHooks(stages)

    def stage_info(self, part: nn.Module) -> StageInfo:
        return self._infos[id(part)]

    def run(self, rows: int, length: int, kept: int, *args: Any, loss_fn: Any = None, **kwargs: Any) -> Any:
        """One ``schedule.eval`` of AutoPipeline's schedule over ``rows`` (a multiple of the
        microbatch count) x ``length`` tokens; the last stage's ``[rows, kept, vocab]`` logits on
        the rank holding it, None elsewhere."""
        if loss_fn is not None:
            raise InputError("AutoPipelineCausalLM only evaluates", key="loss_fn", expected=None,
                             actual=loss_fn, hint="train with autopipeline.step (AutoModel's recipe does)")
        pipeline = self.autopipeline
        schedule, stages = pipeline.info.schedule, pipeline.info.stages
        keep = kwargs.pop("logits_to_keep", None)
        if keep is not None:
            kwargs[_KEPT] = keep
        with _stage_shapes(pipeline, rows // self.n_microbatches, length), self._hooks:
            reshard_stages(self.parts)  # the state a training step leaves, whatever the other pipelines did
            try:
                return schedule.eval(*args, target=_ignored_targets(pipeline, rows, kept, self.device), **kwargs)
            except Exception as exc:
                if self._hooks.running is None:  # not this rank's stage: the failure reports name the peer's
                    raise
                raise PipelineStageError(self._hooks.running, current_rank(), exc) from exc
            finally:
                for stage in stages:
                    stage.clear_runtime_states()  # eval keeps each microbatch's activations (no backward pops them)
                reshard_stages(self.parts)


class _StageHooks:
    """While entered, on AutoPipeline's stage modules: a forward pre-hook that takes the kept
    positions out of the keywords (and records which stage runs, to name it if it fails) and, on the
    stage holding ``lm_head``, a pre-hook there that projects only those positions."""

    def __init__(self, stages: list[Any]) -> None:
        self.stages = stages
        self.handles: list[Any] = []
        self.running: int | None = None
        self.kept: torch.Tensor | None = None

    def __enter__(self) -> _StageHooks:
        self.running = self.kept = None
        for stage in self.stages:
            # prepend: before FSDP's own pre-forward, so that no other hook sees the keyword
            self.handles.append(stage.submod.register_forward_pre_hook(
                functools.partial(self._enter_stage, stage.stage_index), with_kwargs=True, prepend=True))
            self.handles.append(stage.submod.register_forward_hook(self._leave_stage))
            head = getattr(stage.submod, "lm_head", None)
            if isinstance(head, nn.Module):
                self.handles.append(head.register_forward_pre_hook(self._keep_positions))
        return self

    def __exit__(self, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.kept = None

    def _enter_stage(self, index: int, _module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.running, self.kept = index, kwargs.pop(_KEPT, None)
        return args, kwargs

    def _leave_stage(self, *_: Any) -> None:
        self.running = self.kept = None

    def _keep_positions(self, _module: Any, args: tuple) -> tuple | None:
        return None if self.kept is None else (kept_positions(args[0], self.kept), *args[1:])


@contextlib.contextmanager
def _stage_shapes(pipeline: Any, microbatch_rows: int, length: int) -> Iterator[None]:
    """AutoPipeline's stages shaped for microbatches of ``microbatch_rows`` x ``length`` by its own
    ``update_seq_len`` (stage metadata, receive buffers, runtime initializers), then shaped back to
    the training microbatch and the length AutoPipeline was last shaped for (else its ``pp_seq_len``;
    with neither, the recipe's next ``update_seq_len`` shapes it)."""
    current = pipeline._pp_current_seq_len
    training = (pipeline.pp_microbatch_size, current if current is not None else pipeline.pp_seq_len)
    _reshape(pipeline, microbatch_rows, length)
    try:
        yield
    finally:
        _reshape(pipeline, *training)


def _reshape(pipeline: Any, microbatch_rows: int, length: int | None) -> None:
    pipeline.pp_microbatch_size = microbatch_rows
    # update_seq_len re-shapes only when the length differs from the one it last shaped for; the
    # microbatch rows are not part of that check, so it is told it has shaped for none
    pipeline._pp_current_seq_len = None
    if length is not None:
        pipeline.update_seq_len(length)


def _ignored_targets(pipeline: Any, rows: int, kept: int, device: torch.device) -> torch.Tensor | None:
    """The last stage's targets for ``eval``: torch's schedules compute their loss on the last stage
    whenever they have one, eval included, so it gets labels of the loss's ``ignore_index``
    everywhere (``[rows, kept]``, the shape of the logits it sees), scoring nothing."""
    loss_fn = getattr(pipeline.info.schedule, "_loss_fn", None)
    if not pipeline.info.has_last_stage or loss_fn is None:
        return None
    ignore = getattr(loss_fn, "ignore_index", -100)  # -100: torch's and AutoModel's default
    return torch.full((rows, kept), int(ignore), dtype=torch.long, device=device)


def _info_of(stage: Any) -> StageInfo:
    """A torch ``PipelineStage`` of AutoPipeline as our :class:`StageInfo` (layers: the original
    indices its ``model.layers`` keeps)."""
    layers = getattr(getattr(stage.submod, "model", None), "layers", None) or {}
    return StageInfo(stage.stage_index, stage.num_stages, tuple(sorted(int(k) for k in layers.keys())))


def automodel_layout(device_mesh: Any, moe_mesh: Any = None) -> Any:
    """The DP / EP / expert-DP / PP groups of AutoModel's meshes (``MeshContext.device_mesh`` and
    ``.moe_mesh``; a collective on every rank of them).

    Under expert parallelism the data groups come from ``moe_mesh`` (``ep_shard`` x ``ep``: the
    ranks of one pipeline stage), the pipeline group from ``device_mesh["pp"]``; without it
    everything comes from ``device_mesh`` (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``).
    """
    if moe_mesh is None or "ep" not in (moe_mesh.mesh_dim_names or ()) or moe_mesh["ep"].size() == 1:
        return discover_layout(device_mesh, use_megatron=False)
    layout = discover_layout(moe_mesh, use_megatron=False)
    names = device_mesh.mesh_dim_names or ()
    if "pp" in names and device_mesh["pp"].size() > 1:
        layout = replace(layout, pp=RankGroup.of(device_mesh["pp"].get_group()))
    return layout


class MoEExportRecipeMixin:
    """Adds ``moe_export_setup`` / ``moe_export_step_end`` / ``moe_export_train_end`` to a recipe.

    Settings come from ``self.moe_export = {"mmlu": {...}, "export": {...}}`` (keyword arguments
    of ``MMLUCallback`` and ``ExportStep``, as :func:`~nemo_moe_export.plugin.plugin_hooks` takes
    them); what the hooks record is ``self.moe_export_results``.
    """

    moe_export: dict[str, Any] = {}

    def moe_export_setup(self, model: Any, *, tokenizer: Any = None, device_mesh: Any = None,
                         layout: Any = None) -> None:
        self._moe_hooks = plugin_hooks(**self.moe_export)
        self._moe_ctx = make_context(model, tokenizer, layout if layout is not None else discover_layout(device_mesh))
        self._moe_hooks.on_setup(self._moe_ctx)

    def moe_export_step_end(self, step: int) -> None:
        self._moe_hooks.on_step_end(self._moe_ctx, step)

    def moe_export_train_end(self) -> None:
        self._moe_hooks.on_train_end(self._moe_ctx)

    @property
    def moe_export_results(self) -> dict[str, Any]:
        """``ctx.results``: ``"mmlu_during_training"``, ``"mmlu"``, ``"export"`` as the hooks ran."""
        return self._moe_ctx.results


def recipe_settings(section: Any, checkpoint_dir: str | None) -> dict[str, Any]:
    """The plugin's settings from a recipe YAML's ``moe_export:`` section (``mmlu`` and ``export``,
    each optional). Output folders default to ``{checkpoint_dir}/mmlu`` and ``{checkpoint_dir}/hf``."""
    settings = _plain(section) if section is not None else {}
    if not isinstance(settings, dict):
        raise InputError("the moe_export section of the recipe YAML is not a mapping", key="moe_export",
                         expected="a mapping with the sections mmlu and export",
                         actual=type(settings).__name__)
    unknown = sorted(set(settings) - {"mmlu", "export"})
    if unknown:
        raise InputError("unknown moe_export settings in the recipe YAML", key=f"moe_export.{unknown[0]}",
                         expected="the sections mmlu and export", actual=unknown,
                         hint="MMLU options go under moe_export.mmlu, export options under moe_export.export")
    base = checkpoint_dir or "."
    out: dict[str, Any] = {}
    if settings.get("mmlu") is not None:
        out["mmlu"] = {"output_dir": os.path.join(base, "mmlu"), **settings["mmlu"]}
    if settings.get("export") is not None:
        out["export"] = {"output_dir": os.path.join(base, "hf"), **settings["export"]}
    return out


def _plain(node: Any) -> Any:
    """A config node (AutoModel's ``ConfigNode``, OmegaConf, a mapping) as plain dicts and lists."""
    to_dict = getattr(node, "to_dict", None)
    if callable(to_dict):
        node = to_dict()
    if isinstance(node, Mapping):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node


class PluginState:
    """What the plugin carries across a resume: the MMLU evaluations so far (the callback's history
    and ``ctx.results["mmlu_during_training"]``). AutoModel's ``BaseRecipe`` tracks any attribute
    with ``state_dict`` / ``load_state_dict`` and saves it with the recipe's checkpoints; the
    recipe assigns one before its ``setup()`` loads a checkpoint, and applies what was restored once
    the hooks exist (``attach``)."""

    def __init__(self) -> None:
        self._hooks: Any = None
        self._ctx: Any = None
        self.restored: dict[str, Any] | None = None

    def attach(self, hooks: Any, ctx: Any) -> None:
        self._hooks, self._ctx = hooks, ctx
        if self.restored is None:
            return
        for callback in self._mmlu_callbacks():
            callback.history = list(self.restored["mmlu_history"])
        if self.restored["mmlu_during_training"]:
            ctx.results["mmlu_during_training"] = list(self.restored["mmlu_during_training"])

    def _mmlu_callbacks(self) -> list[Any]:
        return [h for h in getattr(self._hooks, "hooks", ()) if isinstance(h, MMLUCallback)]

    def state_dict(self) -> dict[str, Any]:
        callbacks = self._mmlu_callbacks()
        results = self._ctx.results if self._ctx is not None else {}
        return {"mmlu_history": list(callbacks[0].history) if callbacks else [],
                "mmlu_during_training": list(results.get("mmlu_during_training", []))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.restored = {"mmlu_history": list(state.get("mmlu_history", [])),
                         "mmlu_during_training": list(state.get("mmlu_during_training", []))}


def _finetune_recipe_class() -> type:
    """``TrainFinetuneRecipeForNextTokenPrediction`` with the plugin; built on first use, so that
    importing this module does not import AutoModel."""
    try:
        from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction
    except ImportError as exc:
        raise missing("NeMo AutoModel", _INSTALL) from exc

    class MoEExportFinetuneRecipe(MoEExportRecipeMixin, TrainFinetuneRecipeForNextTokenPrediction):
        """AutoModel's fine-tuning recipe plus MMLU every ``moe_export.mmlu.every_n_steps`` steps and
        at the end, and the no-gather HF export at the end, configured by the YAML's ``moe_export:``.

        Hook points (AutoModel has no callback registry): ``setup`` (the settings are validated and
        the adapter built before the first step; the MMLU history comes back with a checkpoint,
        :class:`PluginState`), ``_run_train_optim_step`` (after each optimizer step) and
        ``run_train_validation_loop`` (after the loop). Under pipeline stages MMLU runs through
        AutoPipeline's own schedule (:class:`AutoPipelineCausalLM`, between 1F1B steps and at the
        end), and the export takes the stage modules with the pipeline group.
        """

        def setup(self) -> None:
            self.moe_export_state = PluginState()  # tracked before super().setup() loads a checkpoint
            super().setup()
            settings = recipe_settings(self.cfg.get("moe_export", None),
                                       self.cfg.get("checkpoint.checkpoint_dir", None))
            if self.pp_enabled:
                # no hook exports a list of stages: the export runs at the end with the pipeline group
                self._moe_pipeline_export = settings.pop("export", None)
                model = AutoPipelineCausalLM(self.pp)
            else:
                model = AutoModelCausalLM(self.model_parts[0])
            self.moe_export = settings
            layout = automodel_layout(self.device_mesh, self.moe_mesh)
            self.moe_export_setup(model, tokenizer=self.tokenizer, layout=layout)
            self.moe_export_state.attach(self._moe_hooks, self._moe_ctx)

        def _run_train_optim_step(self, batches: Any, max_grad_norm: float | None = None) -> Any:
            log_data = super()._run_train_optim_step(batches, max_grad_norm)
            # the scheduler counts the step once the loop body is done; this is step + 1
            self.moe_export_step_end(self.step_scheduler.step + 1)
            return log_data

        def run_train_validation_loop(self) -> None:
            super().run_train_validation_loop()
            self.moe_export_train_end()
            export = getattr(self, "_moe_pipeline_export", None)
            if export is not None:
                export = dict(export)
                self.moe_export_results["export"] = export_hf_checkpoint(
                    export.pop("output_dir"), list(self.model_parts), tokenizer=self.tokenizer,
                    pp_group=self.device_mesh["pp"].get_group(), **export)

    MoEExportFinetuneRecipe.__module__ = __name__
    return MoEExportFinetuneRecipe


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "MoEExportFinetuneRecipe":
        if name not in _LAZY:
            _LAZY[name] = _finetune_recipe_class()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AutoModelStateDictAdapter(StateDictAdapter):
    """AutoModel's adapter interface on top of the shared engine.

    ``to_hf(state_dict)`` returns ``{hf_key: tensor}`` for the parts this rank holds (views, global
    expert ids); ``from_hf(hf_state_dict, device_mesh=None, target=None)`` fills ``target`` (the
    model's sharded state dict) from an HF-keyed dict, reading only this rank's slices.
    """

    def __init__(self, config: Any, model_type: str | None = None) -> None:
        model_type = model_type or getattr(config, "model_type", None) or config["model_type"]
        super().__init__(config, get_table(model_type))

    def to_hf(self, state_dict: Any, **_: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {key: shard.tensor for key, shard in super().to_hf(state_dict).items()}

    def from_hf(self, hf_state_dict: Any, device_mesh: Any = None, *, target: Any = None,  # type: ignore[override]
                **kwargs: Any) -> Any:
        if target is None:
            raise TypeError("pass target=model.state_dict() (the sharded tensors to fill)")
        super().from_hf(target, hf_state_dict, **kwargs)
        return target

