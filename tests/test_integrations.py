"""Framework integrations, driven by the real frameworks where they install (Lightning/NeMo does)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from nemo_moe_export.export import verify_checkpoint
from nemo_moe_export.integrations import plugin_hooks
from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu
from nemo_moe_export.tiny_models import tiny_model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = write_synthetic_mmlu(tmp_path_factory.mktemp("data"), n_train=20, n_test=6)
    return root, build_tokenizer(root)


def test_lightning_callback_runs_mmlu_and_export_inside_fit(corpus, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from nemo_moe_export.integrations.nemo import MoEExportCallback

    root, tokenizer = corpus

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_model("deepseek_v3", n_experts=5, vocab_size=len(tokenizer))

        def training_step(self, batch, _):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randint(4, len(tokenizer), (16, 12)))
    module = Module()
    hooks = plugin_hooks(mmlu=dict(data_path=str(root), every_n_steps=2, k_shot=0, output_dir=str(tmp_path / "mmlu"),
                                   progress=False, plot=False),
                         export=dict(output_dir=str(tmp_path / "hf")))
    callback = MoEExportCallback(hooks, tokenizer=tokenizer)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))

    # MMLU ran at steps 2 and 4 and at the end; the export holds the trained weights.
    assert [r["step"] for r in callback.ctx.results["mmlu_during_training"]] == [2, 4]
    assert callback.ctx.results["mmlu"]["overall"]["n"] == 4 * 6
    module.model.save_pretrained(tmp_path / "reference")
    report = verify_checkpoint(tmp_path / "hf", reference=str(tmp_path / "reference"))
    assert report.ok and report.compared == report.tensors, report.summary()
    assert json.loads((tmp_path / "mmlu" / "mmlu_results.json").read_text())


def test_nemo_base_callback_is_used_when_nemo_is_installed():
    pytest.importorskip("nemo.lightning.base_callback")
    from nemo.lightning.base_callback import BaseCallback

    from nemo_moe_export.integrations.nemo import MoEExportCallback

    assert issubclass(MoEExportCallback, BaseCallback)


def test_megatron_bridge_is_import_guarded():
    from nemo_moe_export.integrations.megatron_bridge import megatron_bridge_callback

    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Megatron-Bridge is not installed.*pip install megatron-bridge"):
            megatron_bridge_callback(plugin_hooks())
    else:  # pragma: no cover - only where Megatron-Bridge installs (Python >= 3.12, GPU)
        from megatron.bridge.training.callbacks import Callback

        assert isinstance(megatron_bridge_callback(plugin_hooks()), Callback)


def test_automodel_adapter_and_recipe_mixin(tmp_path):
    from checks import to_grouped_layout

    from nemo_moe_export.integrations.automodel import AutoModelStateDictAdapter, MoEExportRecipeMixin

    model = tiny_model("qwen3_moe", n_experts=4)
    model.save_pretrained(tmp_path / "ref")
    reference = load_file(tmp_path / "ref" / "model.safetensors")
    grouped = to_grouped_layout(model.state_dict())
    adapter = AutoModelStateDictAdapter(model.config)
    hf = adapter.to_hf(grouped)
    assert hf.keys() == reference.keys() and all(torch.equal(hf[k], reference[k]) for k in hf)
    target = {k: torch.zeros_like(v) for k, v in grouped.items()}
    adapter.from_hf(reference, target=target)
    assert all(torch.equal(target[k], grouped[k]) for k in grouped)

    class Recipe(MoEExportRecipeMixin):  # stands in for an AutoModel recipe class
        moe_export = {"export": {"output_dir": str(tmp_path / "hf")}}

    recipe = Recipe()
    recipe.moe_export_setup(model)
    recipe.moe_export_step_end(1)
    recipe.moe_export_train_end()
    assert verify_checkpoint(tmp_path / "hf", reference=str(tmp_path / "ref")).ok
    assert os.path.exists(tmp_path / "hf" / "config.json")
    assert recipe.moe_export_results["export"].path == str(tmp_path / "hf")


def test_export_reuses_the_adapter_built_at_setup(tmp_path):
    """One adapter per run: the export writes with ``ctx.adapter`` from the adapter hook and does not
    look one up again. After setup the config's model_type names no adapter table, so a second
    lookup would fail; the export still succeeds and matches save_pretrained."""
    from nemo_moe_export.errors import InputError
    from nemo_moe_export.integrations import make_context

    model = tiny_model("qwen3_moe", n_experts=4)
    model.save_pretrained(tmp_path / "ref")
    hooks = plugin_hooks(export=dict(output_dir=str(tmp_path / "hf")))
    ctx = make_context(model)
    hooks.on_setup(ctx)
    built = ctx.adapter
    assert built is not None and "qwen3_moe" in built.table.model_types
    model.config.model_type = "not_a_known_family"  # an instance attribute: config.json keeps the class's
    with pytest.raises(InputError, match="no state-dict adapter"):
        plugin_hooks().on_setup(make_context(model))  # what a second lookup would do
    hooks.on_train_end(ctx)
    assert ctx.adapter is built
    report = verify_checkpoint(tmp_path / "hf", reference=str(tmp_path / "ref"))
    assert report.ok and report.compared == report.tensors, report.summary()


def test_hook_protocol_is_one_and_public():
    """The recipe's trainer, the callbacks and the integrations share nemo_moe_export.hooks; the
    plugin's own hooks are assembled in nemo_moe_export.plugin."""
    import inspect

    import nemo_moe_export
    from nemo_moe_export import hooks, integrations, plugin
    from nemo_moe_export.evaluate.callback import MMLUCallback
    from nemo_moe_export.export import ExportStep

    for cls in (MMLUCallback, ExportStep, plugin.AdapterHook, hooks.HookList):
        assert list(inspect.signature(cls.on_setup).parameters) == ["self", "ctx"], cls
        assert list(inspect.signature(cls.on_step_end).parameters) == ["self", "ctx", "step"], cls
        assert list(inspect.signature(cls.on_train_end).parameters) == ["self", "ctx"], cls
    assert issubclass(MMLUCallback, hooks.Hook) and issubclass(plugin.AdapterHook, hooks.Hook)
    assert integrations.plugin_hooks is plugin.plugin_hooks is nemo_moe_export.plugin_hooks
    assert integrations.make_context is hooks.make_context is nemo_moe_export.make_context
