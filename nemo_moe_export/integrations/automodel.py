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
from AutoModel's meshes (:func:`automodel_layout`); under pipeline stages through AutoPipeline's
stage modules behind :class:`AutoPipelineCausalLM` (a forward-only schedule over them):

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

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nemo_moe_export.adapters import StateDictAdapter, get_table
from nemo_moe_export.errors import ExportInputError, current_rank
from nemo_moe_export.hooks import make_context, plugin_hooks
from nemo_moe_export.integrations._install_hint import missing
from nemo_moe_export.pipeline.model import PipelinedCausalLM
from nemo_moe_export.pipeline.stages import PipelineStageError, StageInfo, kept_positions

__all__ = ["AutoModelCausalLM", "AutoModelStateDictAdapter", "AutoPipelineCausalLM", "MoEExportFinetuneRecipe",
           "MoEExportRecipeMixin", "automodel_layout"]

_INSTALL = "pip install --no-deps nemo-automodel==0.7.0 megatron-fsdp==0.5.0 torchao==0.18.0 (see the README)"


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


class AutoPipelineCausalLM(PipelinedCausalLM):
    """AutoModel's pipeline stages (``AutoPipeline``, built) as one transformers-style causal LM,
    forward only: ``.logits`` on every rank of the pipeline group (docs/design.md#nemo-automodel).

    AutoPipeline's own schedule trains (1F1B with its loss) at the training shapes; MMLU batches
    change shape from batch to batch, and re-shaping the training schedule's stages would reset
    their state between optimizer steps. So this runs our forward-only pipeline
    (:class:`~nemo_moe_export.pipeline.PipelinedCausalLM`: ``ScheduleGPipe``/``ScheduleLoopedBFS``
    per batch shape, logits broadcast from the last stage) over AutoPipeline's stage modules
    (``autopipeline.parts``), at AutoPipeline's stage ids and on its pipeline group; the training
    schedule is left untouched. Each stage module runs AutoModel's own forward; on the last stage
    a pre-hook on ``lm_head`` keeps only the scored positions. ``n_microbatches`` (default: the
    stage count) and ``dtype`` (hidden states between stages and logits; default
    ``config.dtype``) as :class:`~nemo_moe_export.pipeline.PipelinedCausalLM` takes them.
    Every call leaves the stage modules' ``fully_shard`` weights resharded, as a training step
    does, so AutoPipeline's next 1F1B step runs after an evaluation between steps
    (docs/design.md#nemo-automodel).
    """

    def __init__(self, autopipeline: Any, n_microbatches: int | None = None, *,
                 dtype: torch.dtype | None = None) -> None:
        stages = list(autopipeline.info.stages or ())
        if not stages:
            raise ExportInputError("AutoPipeline has no stages", key="autopipeline", expected="a built AutoPipeline",
                                   actual="no stages", hint="call autopipeline.build(model, ...) first")
        # before Module.__init__: PipelinedCausalLM's constructor checks the parts through stage_info()
        self._modules_of = {id(s.submod): _AutoModelStage(s.submod, _info_of(s)) for s in stages}
        super().__init__([s.submod for s in stages], [s.stage_index for s in stages], stages[0].num_stages,
                         stages[0].group, n_microbatches, dtype=dtype)

    def stage_info(self, part: nn.Module) -> StageInfo:
        return self._modules_of[id(part)].info

    def stage_module(self, part: nn.Module) -> nn.Module:
        return self._modules_of[id(part)]


def _info_of(stage: Any) -> StageInfo:
    """A torch ``PipelineStage`` of AutoPipeline as our :class:`StageInfo` (layers: the original
    indices its ``model.layers`` keeps)."""
    layers = getattr(getattr(stage.submod, "model", None), "layers", None) or {}
    return StageInfo(stage.stage_index, stage.num_stages, tuple(sorted(int(k) for k in layers.keys())))


class _AutoModelStage(nn.Module):
    """An AutoPipeline stage module called as our pipeline calls a stage, ``(x, attention_mask=,
    logits_to_keep=)`` -> tensor: AutoModel's own forward (the stage module's, which takes input ids
    or hidden states and returns a tensor), with ``logits_to_keep`` (``[rows, n]`` positions per
    row, which AutoModel's forward reads differently) applied in a pre-hook on ``lm_head``; a
    failure is named by stage and rank (:class:`~nemo_moe_export.pipeline.PipelineStageError`)."""

    def __init__(self, part: nn.Module, info: StageInfo) -> None:
        super().__init__()
        self.part, self.info = part, info

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                logits_to_keep: torch.Tensor | None = None) -> torch.Tensor:
        head = getattr(self.part, "lm_head", None)
        handle = None
        if head is not None and logits_to_keep is not None:
            handle = head.register_forward_pre_hook(
                lambda _, args: (kept_positions(args[0], logits_to_keep), *args[1:]))
        try:
            return self.part(x, attention_mask=attention_mask)
        except Exception as exc:
            raise PipelineStageError(self.info.index, current_rank(), exc) from exc
        finally:
            if handle is not None:
                handle.remove()


def automodel_layout(device_mesh: Any, moe_mesh: Any = None) -> Any:
    """The DP / EP / expert-DP / PP groups of AutoModel's meshes (``MeshContext.device_mesh`` and
    ``.moe_mesh``; a collective on every rank of them).

    Under expert parallelism the data groups come from ``moe_mesh`` (``ep_shard`` x ``ep``: the
    ranks of one pipeline stage), the pipeline group from ``device_mesh["pp"]``; without it
    everything comes from ``device_mesh`` (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``).
    """
    from nemo_moe_export.parallel import RankGroup, discover_layout

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
    of ``MMLUCallback`` and ``ExportStep``, as :func:`~nemo_moe_export.hooks.plugin_hooks` takes
    them); what the hooks record is ``self.moe_export_results``.
    """

    moe_export: dict[str, Any] = {}

    def moe_export_setup(self, model: Any, *, tokenizer: Any = None, device_mesh: Any = None,
                         layout: Any = None) -> None:
        from nemo_moe_export.parallel import discover_layout

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
        raise ExportInputError("the moe_export section of the recipe YAML is not a mapping", key="moe_export",
                               expected="a mapping with the sections mmlu and export",
                               actual=type(settings).__name__)
    unknown = sorted(set(settings) - {"mmlu", "export"})
    if unknown:
        raise ExportInputError("unknown moe_export settings in the recipe YAML", key=f"moe_export.{unknown[0]}",
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
        from nemo_moe_export.evaluate.callback import MMLUCallback

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
        AutoPipeline's stage modules (:class:`AutoPipelineCausalLM`, between 1F1B steps and at the
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
                from nemo_moe_export.export import export_hf_checkpoint

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

