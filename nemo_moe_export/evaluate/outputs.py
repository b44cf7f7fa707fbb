"""What one evaluation leaves on disk and in the log, on global rank 0: results JSON, markdown
table, charts and a one-line summary, each named after the task (``<task>`` is its name: ``mmlu``,
``arc_challenge``; headers and titles use its ``title``).

Files go into the callback's ``output_dir``:

* ``<task>_results.json``: per-group (MMLU: subject) / per-category / overall accuracy with counts,
  per-question predictions and scores, the task, the policy, the parallel layout, timing, padding
  waste, and the history of every evaluation so far;
* ``<task>_results.md``: the markdown table of :func:`~nemo_moe_export.evaluate.scoring.results_to_markdown`;
* ``<task>_categories.png``: accuracy bars per category and overall (``acc_norm`` beside ``acc``
  when the task measures it); ``<task>_history.png``: accuracy (overall and per category) over the
  training steps evaluated so far, with the training loss beside it.

Every file is written to a temporary name and renamed, so a dashboard tailing it never reads half.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_moe_export.evaluate.results import MMLUResult
from nemo_moe_export.evaluate.scoring import results_to_markdown
from nemo_moe_export.evaluate.task import Task, load_task

__all__ = ["CATEGORY_PNG", "HISTORY_PNG", "RESULTS_JSON", "RESULTS_MD", "log_summary", "write_outputs"]

logger = logging.getLogger("nemo_moe_export.evaluate.callback")  # the name users configure

RESULTS_JSON = "{task}_results.json"  # .format(task=name): mmlu_results.json
RESULTS_MD = "{task}_results.md"
CATEGORY_PNG = "{task}_categories.png"
HISTORY_PNG = "{task}_history.png"


def write_outputs(output_dir: Path, result: MMLUResult, run: Mapping[str, Any], history: Sequence[dict[str, Any]],
                  loss_history: Sequence[tuple[int, float]], *, plot: bool, task: Task | str = "mmlu"
                  ) -> dict[str, Path]:
    """The JSON, markdown and (with ``plot``) PNG files of ``result``; their paths. ``run`` is what
    was evaluated (step, data path, split, k_shot), ``history`` every evaluation so far."""
    task = load_task(task)
    output_dir.mkdir(parents=True, exist_ok=True)
    step = run["step"]
    payload = {
        "task": task.name, **run,
        "policy": result.policy, "layout": result.layout, "timing": result.timing,
        "padding": result.padding, "scoring": result.scoring, "steps": result.steps,
        "results": result.metrics, "metrics": result.flat_metrics(), "predictions": result.records,
        "history": list(history),
    }
    paths = {"json": output_dir / RESULTS_JSON.format(task=task.name),
             "markdown": output_dir / RESULTS_MD.format(task=task.name)}
    _write_atomic(paths["json"], json.dumps(payload, indent=1) + "\n")
    header = (f"## {task.display_name} ({run['k_shot']}-shot{'' if step is None else f', step {step}'})\n\n"
              f"policy `{result.policy}`, {result.timing['questions_per_s']:.1f} questions/s, "
              f"padding waste {100 * result.padding['waste']:.1f}%\n\n")
    _write_atomic(paths["markdown"], header + results_to_markdown(result.metrics, task))
    if plot:
        paths["png"] = _plot_categories(result.metrics, output_dir / CATEGORY_PNG.format(task=task.name), step,
                                        task.display_name)
        paths["history_png"] = _plot_history(history, loss_history, output_dir / HISTORY_PNG.format(task=task.name),
                                             task)
    return paths


def _write_atomic(path: Path, text: str) -> None:
    """Readers (a dashboard tailing the file) never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def log_summary(result: MMLUResult, step: int | None, task: Task | str = "mmlu") -> None:
    overall = result.metrics["overall"]
    cats = "".join(f"; {c} {100 * e['acc']:.2f}" for c, e in result.metrics["categories"].items())
    norm = f", acc_norm {100 * overall['acc_norm']:.2f}%" if "acc_norm" in overall else ""
    logger.info("%s%s: acc %.2f%%%s (%d/%d%s) | %s, %.1f questions/s, padding waste %.1f%%",
                load_task(task).display_name, "" if step is None else f" at step {step}", 100 * overall["acc"], norm,
                overall["correct"], overall["n"], cats, result.policy, result.timing["questions_per_s"],
                100 * result.padding["waste"])


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display on training nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_categories(metrics: dict[str, Any], path: Path, step: int | None, title: str) -> Path:
    """Per-category accuracy bars, overall last; ``acc_norm`` bars beside them when measured."""
    plt = _pyplot()
    entries = [*metrics["categories"].values(), metrics["overall"]]
    names = [*metrics["categories"], "overall"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if "acc_norm" in metrics["overall"]:
        at = list(range(len(names)))
        ax.bar([x - 0.2 for x in at], [100 * e["acc"] for e in entries], width=0.4, color="tab:blue", label="acc")
        ax.bar([x + 0.2 for x in at], [100 * e["acc_norm"] for e in entries], width=0.4, color="tab:orange",
               label="acc_norm")
        ax.set_xticks(at, names)
    else:
        ax.bar(names, [100 * e["acc"] for e in entries], color=["tab:blue"] * (len(names) - 1) + ["tab:gray"])
    ax.axhline(25.0, color="tab:red", linestyle="--", linewidth=1, label="chance (25%)")
    ax.set_ylim(0, 100)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{title} by category" + ("" if step is None else f" (step {step})"))
    ax.legend(loc="upper right")
    fig.tight_layout()
    _save_atomic(fig, path)
    plt.close(fig)
    return path


def _plot_history(history: Sequence[dict[str, Any]], losses: Sequence[tuple[int, float]], path: Path,
                  task: Task) -> Path:
    """Accuracy (overall bold, categories thin) at each evaluated step; the training loss on a
    second axis. An evaluation without a step (outside training) is drawn at step 0."""
    plt = _pyplot()
    steps = [h["step"] or 0 for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = sorted({k for h in history for k in h["metrics"] if k.endswith("/acc") and k.count("/") == 2})
    for name in names:
        ax.plot(steps, [100 * h["metrics"].get(name, float("nan")) for h in history], linewidth=1, marker=".",
                label=name.split("/")[1])
    ax.plot(steps, [100 * h["metrics"][f"{task.name}/acc"] for h in history], color="black", linewidth=2.5,
            marker="o", label="overall")
    if any(f"{task.name}/acc_norm" in h["metrics"] for h in history):
        ax.plot(steps, [100 * h["metrics"].get(f"{task.name}/acc_norm", float("nan")) for h in history],
                color="black", linestyle="--", linewidth=1.5, marker="o", label="overall acc_norm")
    ax.axhline(25.0, color="tab:red", linestyle="--", linewidth=1)
    ax.set_ylim(0, 100)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{task.display_name} accuracy (%)")
    if losses:
        loss_ax = ax.twinx()
        loss_ax.plot([s for s, _ in losses], [v for _, v in losses], color="tab:gray", alpha=0.6, label="train loss")
        loss_ax.set_ylabel("training loss")
        loss_ax.legend(loc="upper right")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"{task.display_name} accuracy" + (" and training loss" if losses else "") + " over steps")
    fig.tight_layout()
    _save_atomic(fig, path)
    plt.close(fig)
    return path


def _save_atomic(fig: Any, path: Path) -> None:
    """As :func:`_write_atomic`: a dashboard never reads half a PNG."""
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)
