"""Where users look: MMLU charts in the run directory and metrics in the training framework's logger."""

from __future__ import annotations

import csv

import pytest
import torch

from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu
from nemo_moe_export.tiny_models import tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = write_synthetic_mmlu(tmp_path_factory.mktemp("data"), n_train=20, n_test=6)
    return root, build_tokenizer(root)


def _assert_png(path, min_size=(300, 200)):
    """A real PNG: the signature, Pillow's own verification, and decoded pixels that are not blank."""
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= min_size[0] and image.size[1] >= min_size[1]
        pixels = torch.tensor(list(image.convert("L").getdata()), dtype=torch.float32)
    assert pixels.std() > 5, f"{path} is blank"


def test_charts_are_valid_pngs_of_accuracy_by_category_and_over_steps(corpus, tmp_path):
    from nemo_moe_export.evaluate.callback import LOSS_HISTORY_KEY, MMLUCallback
    from nemo_moe_export.hooks import make_context

    root, tokenizer = corpus
    model = tiny_model("deepseek_v3", n_experts=4, vocab_size=len(tokenizer))
    logged = []
    callback = MMLUCallback(root, every_n_steps=2, k_shot=0, output_dir=tmp_path / "mmlu", progress=False,
                            log_fn=lambda metrics, step: logged.append(("log_fn", step)))
    callback.add_metrics_logger(lambda metrics, step: logged.append(("logger", step, metrics["mmlu/acc"])))
    ctx = make_context(model, tokenizer)
    for step in range(1, 5):
        ctx.results.setdefault(LOSS_HISTORY_KEY, []).append([step, 3.0 / step])
        callback.on_step_end(ctx, step)
    assert callback.loss_history == [(1, 3.0), (2, 1.5), (3, 1.0), (4, 0.75)]
    assert [entry[:2] for entry in logged] == [("log_fn", 2), ("logger", 2), ("log_fn", 4), ("logger", 4)]
    for name in ("mmlu_categories.png", "mmlu_history.png"):
        _assert_png(tmp_path / "mmlu" / name)

    quiet = MMLUCallback(root, k_shot=0, output_dir=tmp_path / "quiet", progress=False, plot=False)
    quiet.evaluate(model, tokenizer)
    assert not list((tmp_path / "quiet").glob("*.png"))


def test_lightning_loggers_get_mmlu_metrics_at_the_training_step(corpus, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from nemo_moe_export.integrations import plugin_hooks
    from nemo_moe_export.integrations.nemo import MoEExportCallback

    root, tokenizer = corpus

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_model("deepseek_v3", n_experts=4, vocab_size=len(tokenizer))

        def training_step(self, batch, _):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randint(4, len(tokenizer), (16, 12)))
    hooks = plugin_hooks(mmlu=dict(data_path=str(root), every_n_steps=2, k_shot=0, output_dir=str(tmp_path / "mmlu"),
                                   progress=False, at_train_end=False))
    callback = MoEExportCallback(hooks, tokenizer=tokenizer)
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, callbacks=[callback], logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path),
                         log_every_n_steps=1)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))

    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    mmlu = [(int(r["step"]), float(r["mmlu/acc"])) for r in rows if r.get("mmlu/acc")]
    during = callback.ctx.results["mmlu_during_training"]
    assert mmlu == [(r["step"], r["mmlu/acc"]) for r in during] and [s for s, _ in mmlu] == [2, 4]
    assert {"mmlu/other/acc", "mmlu/questions_per_s"} <= set(rows[0])
    assert any(r.get("train_loss") for r in rows), "the loss the module logs is in the same file"
    assert [s for s, _ in callback.ctx.results["train_loss"]] == [1, 2, 3, 4]
    _assert_png(tmp_path / "mmlu" / "mmlu_history.png")
