"""Two jobs, one target: one export at a time, a published checkpoint from exactly one job, a
replace that never leaves the target empty, and what dead jobs leave behind cleaned with a message.
Real 4-rank gloo jobs, real files (docs/design.md#export-target-and-concurrent-jobs).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

from nemo_moe_export.export import export_hf_checkpoint, verify_checkpoint
from nemo_moe_export.export.target import ExportTarget
from nemo_moe_export.spawn import spawn
from nemo_moe_export.tiny_models import tiny_model


def _racing_job(rank: int, world: int, target: str, seed: int, role: str) -> dict:
    """Job "a" holds the target (its write waits) until job "b" has reached its own prepare step."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nemo_moe_export.export import SharedFilesystemWriter, export_hf_checkpoint
    from nemo_moe_export.export.target import ExportTarget
    from nemo_moe_export.parallel import PeerError
    from nemo_moe_export.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", n_experts=5, seed=seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    b_arrived = target + ".b-arrived"
    if role == "a":
        real_write = SharedFilesystemWriter.write

        def write_once_b_arrived(self, *args, **kwargs):
            deadline = time.monotonic() + 120
            while not os.path.exists(b_arrived) and time.monotonic() < deadline:
                time.sleep(0.05)
            return real_write(self, *args, **kwargs)

        SharedFilesystemWriter.write = write_once_b_arrived
    else:
        real_prepare = ExportTarget.prepare

        def prepare_and_signal(self):
            open(b_arrived, "w").close()
            return real_prepare(self)

        ExportTarget.prepare = prepare_and_signal
    try:
        export_hf_checkpoint(target, model, timeout_s=60)
        return {"seed": seed, "ok": True}
    except PeerError as exc:
        return {"seed": seed, "ok": False, "step": exc.step, "message": str(exc)}


def _run_job(results: dict, key: str, *args: object) -> None:
    results[key] = spawn(_racing_job, 4, *args, timeout_s=240)


def _published_equals(path: str, model) -> bool:
    """transformers reloads exactly the given (unsharded) model: every tensor, dtype and value."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    expected = model.state_dict()
    return reloaded.keys() == expected.keys() and all(
        reloaded[k].dtype == v.dtype and torch.equal(reloaded[k], v) for k, v in expected.items())


def test_two_jobs_racing_into_one_target_publish_one_whole_checkpoint(tmp_path):
    target = str(tmp_path / "hf")
    results: dict = {}
    first = threading.Thread(target=_run_job, args=(results, "a", target, 1, "a"))
    second = threading.Thread(target=_run_job, args=(results, "b", target, 2, "b"))
    first.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(tmp_path / ".hf.lock") and time.monotonic() < deadline:
        time.sleep(0.02)  # job A has taken the target
    second.start()
    first.join()
    second.join()
    a, b = results["a"], results["b"]
    assert all(r["ok"] for r in a), a
    for r in b:  # refused on every rank, before it wrote anything
        assert not r["ok"] and r["step"] == "prepare", r
        assert "another export job is writing this target" in r["message"] and "refreshed" in r["message"]
    assert verify_checkpoint(target).ok
    assert _published_equals(target, tiny_model("qwen3_moe", n_experts=5, seed=1))  # all of job A
    os.remove(target + ".b-arrived")
    assert sorted(os.listdir(tmp_path)) == ["hf"], "no lock, partial or old directory may stay behind"


def test_replace_keeps_a_checkpoint_at_the_target_at_every_instant(tmp_path):
    target = str(tmp_path / "hf")
    export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4, seed=1))
    seen_missing = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if not os.path.exists(os.path.join(target, "config.json")):
                seen_missing.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for seed in (2, 3, 4):
            export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4, seed=seed), overwrite="replace")
    finally:
        stop.set()
        watcher.join()
    assert seen_missing == []
    assert _published_equals(target, tiny_model("qwen3_moe", n_experts=4, seed=4))
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_replace_of_a_regular_file_leaves_nothing_behind(tmp_path):
    target = tmp_path / "hf"
    target.write_text("not a checkpoint")
    export_hf_checkpoint(str(target), tiny_model("qwen3_moe", n_experts=4), overwrite="replace")
    assert target.is_dir() and verify_checkpoint(str(target)).ok
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_an_interrupted_replace_is_refused_then_restored(tmp_path):
    """A filesystem without an exchange moves the old checkpoint aside first; a crash there leaves
    it at .hf.old and no target. The next export says so, and with replace restores it first."""
    target = str(tmp_path / "hf")
    export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4, seed=1))
    os.rename(target, tmp_path / ".hf.old")  # the state such a crash leaves
    from nemo_moe_export.parallel import PeerError

    with pytest.raises(PeerError, match=r"previous checkpoint sits aside.*\.hf\.old"):
        export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4, seed=2))
    assert os.path.isdir(tmp_path / ".hf.old")  # the refusal touched nothing
    result = export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4, seed=2), overwrite="replace")
    assert any("restored" in note for note in result.notes), result.notes
    assert _published_equals(target, tiny_model("qwen3_moe", n_experts=4, seed=2))
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_what_a_dead_job_left_is_cleaned_with_a_message(tmp_path, caplog):
    target = str(tmp_path / "hf")
    dead = ExportTarget.at(target).for_job("dead-job")
    os.makedirs(dead.partial)
    (open(os.path.join(dead.partial, "model-00001-of-00001.safetensors"), "wb")).write(b"\0" * 4096)
    with open(dead.lock, "w") as f:  # a lock whose holder (a pid that cannot exist) is gone
        json.dump({"export_id": "dead-job", "host": socket.gethostname(), "pid": 2 ** 22 + 7}, f)
    with caplog.at_level("WARNING"):
        result = export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4))
    assert any("stale lock of dead export job dead-job" in n for n in result.notes), result.notes
    assert any("partial directory of a dead export job" in n for n in result.notes), result.notes
    assert "dead export job" in caplog.text
    assert verify_checkpoint(target).ok
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_live_lock_from_another_host_is_respected_until_stale(tmp_path):
    target = str(tmp_path / "hf")
    lock = ExportTarget.at(target).lock
    with open(lock, "w") as f:
        json.dump({"export_id": "elsewhere", "host": "some-other-node", "pid": 1}, f)
    from nemo_moe_export.parallel import PeerError

    with pytest.raises(PeerError, match="another export job is writing this target.*some-other-node"):
        export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4))
    old = time.time() - 3600
    os.utime(lock, (old, old))  # its heartbeat stopped an hour ago
    result = export_hf_checkpoint(target, tiny_model("qwen3_moe", n_experts=4))
    assert any("stale lock" in n for n in result.notes)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_verify_detects_files_from_different_exports(tmp_path):
    """Each file's header and the index name the export that wrote them: a file copied in from
    another export of the same model is caught, although every file is well formed."""
    import shutil

    model = tiny_model("qwen3_moe", n_experts=4)
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    export_hf_checkpoint(first, model, max_shard_size="64KB")
    export_hf_checkpoint(second, model, max_shard_size="64KB")
    assert verify_checkpoint(first).ok and verify_checkpoint(second).ok
    name = sorted(n for n in os.listdir(first) if n.endswith(".safetensors"))[1]
    shutil.copy(os.path.join(second, name), os.path.join(first, name))
    report = verify_checkpoint(first)
    assert not report.ok
    assert any("different exports" in p and name in p for p in report.problems), report.problems
