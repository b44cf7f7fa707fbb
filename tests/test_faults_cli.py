"""Faults users hit at the command line, with real processes and real signals.

* Config errors: the whole config is checked before the first training step, and a bad command
  line or config is one line on stderr from one rank, exit status 2, no traceback unless asked.
* Signals: SIGTERM or Ctrl-C (SIGINT) to ``nemo-moe-export ... --nproc N`` stops torchrun and every
  rank, and the launcher exits only after them; an export in flight is discarded, its target
  untouched.

docs/design.md#faults-and-how-each-is-reported
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_moe_export.errors import InputError
from nemo_moe_export.job.compose import load_config

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "nemo_moe_export"]
QUICK = ["trainer.progress=false", "mmlu.enabled=false", "data.n_train=40", "data.n_test=4"]
ERROR_LINE = "nemo-moe-export: error:"


def _cli(args, *, timeout=120, env=ENV):
    started = time.monotonic()
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - started


def _our_frames(text: str) -> list[str]:
    """Traceback frames in our package (torchrun's own report of a failed child is not ours)."""
    return [line for line in text.splitlines() if line.strip().startswith('File "') and "nemo_moe_export" in line]


# --- config errors: one line, one rank, before anything starts --------------------------------------------


@pytest.mark.parametrize("args,says", [
    (["trainer.max_steps=lots"], "Value 'lots' of type 'str' could not be converted to Integer"),
    (["--nproc", "0"], "--nproc must be a positive integer (key '--nproc'): expected an integer >= 1, got '0'"),
    (["stages=[export]", "export.from_checkpoint={tmp}"], "export.from_checkpoint is not a training checkpoint"),
], ids=["wrong-type", "nproc-0", "not-a-checkpoint"])
def test_a_config_error_is_one_line_and_nothing_starts(args, says, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    run_dir = tmp_path / "run"
    args = [a.format(tmp=tmp_path) for a in args]
    nproc = [] if "--nproc" in args else ["--nproc", "2"]
    proc, seconds = _cli(["recipe=deepseek_v3_tiny", f"run_dir={run_dir}", *args, *nproc])
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR_LINE)]
    assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "torch.distributed" not in proc.stderr
    assert not run_dir.exists() and seconds < 60, seconds  # no torchrun, no rank, nothing written


def test_more_ranks_than_cores_warn_and_a_bad_option_is_refused_before_launch(tmp_path):
    cores = len(os.sched_getaffinity(0))
    # The config error after the warning keeps this test from starting cores + 1 ranks.
    proc, _ = _cli(["recipe=deepseek_v3_tiny", f"run_dir={tmp_path / 'run'}", "parallel.device=cpu",
                    "export.overwrite=repalce", "--nproc", cores + 1])
    assert f"warning: --nproc {cores + 1} starts {cores + 1} CPU ranks on {cores} visible core(s)" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR_LINE)]
    refused = "unknown overwrite policy (key 'overwrite'): expected ('error', 'replace'), got 'repalce'"
    assert proc.returncode == 2 and errors == [f"{ERROR_LINE} {refused}"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_debug_asks_for_the_traceback(tmp_path):
    proc, _ = _cli(["recipe=deepseek_v3_tiny", f"run_dir={tmp_path / 'run'}", "export.dtype=bf16", "--debug",
                    "--nproc", "2"])
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "InputError: unknown dtype" in proc.stderr


@pytest.mark.parametrize("argv,says", [
    (["--nproc", "-2"], "got '-2'"), (["--nproc=four"], "got 'four'"), (["--nproc"], "got nothing"),
])
def test_nproc_must_be_a_positive_integer(argv, says):
    from nemo_moe_export.job.compose import split_recipe_args

    with pytest.raises(InputError, match=r"--nproc must be a positive integer \(key '--nproc'\)") as info:
        split_recipe_args(["recipe=deepseek_v3_tiny", *argv])
    assert says in str(info.value)


def test_under_torchrun_only_rank0_says_it(tmp_path):
    """Launched by torchrun itself, every rank checks the config and refuses it; one says why."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "nemo_moe_export", "recipe=deepseek_v3_tiny", f"run_dir={tmp_path / 'run'}", "mmlu.policy=lockstpe"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count(ERROR_LINE) == 1 and "got 'lockstpe'" in out, out
    assert not _our_frames(out), out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,says", [
    (["parallel=ep", "parallel.ep_size=3"],
     r"expert-parallel size must divide the ranks.*divisor of the 4 ranks: \[1, 2, 4\], got 3"),
    (["parallel=ep", "parallel.ep_size=4"],
     r"expert count must divide by the expert-parallel size.*n_experts=6.*\[1, 2\], got 4"),
    (["parallel=hsdp", "parallel.replicate=3"], r"HSDP replicas must divide the ranks.*got 3"),
    (["parallel.strategy=zero3"], r"unknown parallel strategy \(key 'parallel.strategy'\)"),
    (["model.family=mixtral"], r"unknown model family \(key 'model.family'\)"),
    (["trainer.max_steps=0"], r"must be positive \(key 'trainer.max_steps'\)"),
    (["mmlu.k_shot=6"], r"fewer dev questions than few-shot examples \(key 'data.n_dev'\)"),
    (["mmlu.data_path={tmp}/no-data"], r"mmlu.data_path: MMLU data directory not found"),
    (["export.output_dir={tmp}/missing/hf"], r"the export target's folder does not exist"),
    (["stages=[export]", "export.from_checkpoint={tmp}/nowhere"], r"not a training checkpoint.*no such directory"),
], ids=["ep-vs-world", "ep-vs-experts", "hsdp-vs-world", "strategy", "family", "max-steps", "k-shot", "data-path",
        "target-parent", "missing-checkpoint"])
def test_the_whole_config_is_checked_before_any_work(overrides, says, tmp_path):
    """What would fail only after training, or inside init_distributed, fails here for 4 ranks."""
    from nemo_moe_export.job.stages import check_recipe

    run_dir = tmp_path / "run"
    cfg = load_config("deepseek_v3_tiny", [f"run_dir={run_dir}", *[o.format(tmp=tmp_path) for o in overrides]])
    with pytest.raises(InputError, match=says):
        check_recipe(cfg, 4)
    assert not run_dir.exists()


def test_mmlu_data_is_loaded_before_training(tmp_path):
    """A user data set with an empty file is refused before the first step, naming the file."""
    from nemo_moe_export.job.data import write_synthetic_mmlu
    from nemo_moe_export.job.stages import check_recipe

    data = write_synthetic_mmlu(tmp_path / "data", n_train=4, n_dev=2, n_test=3)
    (data / "test" / "parity_test.csv").write_text("")
    cfg = load_config("deepseek_v3_tiny", [f"run_dir={tmp_path / 'run'}", f"mmlu.data_path={data}"])
    with pytest.raises(InputError, match=r"parity_test.csv holds no questions"):
        check_recipe(cfg, 2)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    from nemo_moe_export.job.checks import check_training_checkpoint
    from nemo_moe_export.job.data import build_tokenizer, write_synthetic_mmlu
    from nemo_moe_export.job.trainer import build_model

    cfg = load_config("deepseek_v3_tiny")
    tokenizer = build_tokenizer(write_synthetic_mmlu(tmp_path / "data", n_train=2, n_dev=1, n_test=1))
    checkpoint = tmp_path / "checkpoint"
    dcp.save(build_model(cfg.model, vocab_size=len(tokenizer)).state_dict(), checkpoint_id=checkpoint)
    tokenizer.save_pretrained(checkpoint / "tokenizer")
    check_training_checkpoint(str(checkpoint), cfg.model)  # the model it was saved from fits
    bigger = load_config("deepseek_v3_tiny", ["model.n_experts=8"]).model
    with pytest.raises(InputError, match=r"does not fit the configured model \(4 tensor\(s\) differ\) "
                                               r"\(key 'model.layers.1.mlp.experts.down_proj'\): expected shape "
                                               r"\(8, 128, 64\).*got \(6, 128, 64\)"):
        check_training_checkpoint(str(checkpoint), bigger)


# --- signals ------------------------------------------------------------------------------------------------


def _stat(pid):
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields


def _tree(root):
    """Every process below ``root`` as (pid, start time)."""
    parent = {}
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields:
            parent[int(entry)] = (int(fields[1]), fields[19])
    below, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in parent.items() if ppid in frontier}
        below += [(pid, parent[pid][1]) for pid in frontier]
    return below


def _alive(procs):
    return [pid for pid, started in procs if (f := _stat(pid)) and f[19] == started and f[0] not in "ZX"]


class _Job:
    """``nemo-moe-export ... --nproc 2`` in the background, its output collected line by line."""

    def __init__(self, run_dir, *overrides):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*CLI, "recipe=deepseek_v3_tiny", f"run_dir={run_dir}", *QUICK, *overrides,
                                      "--nproc", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=ENV)
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.procs: list = []

    def wait_for(self, condition, timeout=240):
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.02)

    def stop(self, signum):
        """Send ``signum`` to the launcher alone; seconds until it exited, and the ranks still alive then."""
        self.procs = _tree(self.proc.pid)
        assert len(self.procs) >= 3, self.procs  # torchrun and its two ranks
        started = time.monotonic()
        self.proc.send_signal(signum)
        self.proc.wait(timeout=120)
        seconds = time.monotonic() - started
        self._reader.join(timeout=10)
        return seconds, _alive(self.procs)

    def kill(self):
        for pid in _alive(self.procs) + ([self.proc.pid] if self.proc.poll() is None else []):
            os.kill(pid, signal.SIGKILL)  # only the processes this test started


def test_sigterm_during_an_export_stops_every_rank_and_leaves_the_target_untouched(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "hf").mkdir(parents=True)
    (run_dir / "hf" / "config.json").write_text('{"the": "previous checkpoint"}')
    # 8-byte staging buffers make the bf16 write take seconds: the signal lands inside the export.
    job = _Job(run_dir, "trainer.max_steps=1", "trainer.save_checkpoint=false", "stages=[train,export]",
               "export.overwrite=replace", "export.dtype=bfloat16", "export.staging_bytes=8")
    try:
        job.wait_for(lambda: any("partial" in name for name in os.listdir(run_dir)))
        seconds, alive = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    out = "".join(job.lines)
    print(f"SIGTERM during the export: the launcher exited {seconds:.2f} s after the signal")
    assert seconds < 30 and not alive, (seconds, alive, out)
    assert job.proc.returncode == 128 + signal.SIGTERM, out
    assert sorted(os.listdir(run_dir / "hf")) == ["config.json"], "the previous checkpoint was replaced"
    assert (run_dir / "hf" / "config.json").read_text() == '{"the": "previous checkpoint"}'
    time.sleep(1)  # nothing is left to publish later either
    assert sorted(os.listdir(run_dir / "hf")) == ["config.json"]
    assert not [name for name in os.listdir(run_dir) if "partial" in name], os.listdir(run_dir)
    assert out.count("nemo-moe-export: stopped by SIGTERM\n") == 1 and "Traceback" not in out, out


def test_ctrl_c_during_training_stops_every_rank_before_anything_is_published(tmp_path):
    run_dir = tmp_path / "run"
    job = _Job(run_dir, "trainer.max_steps=2000", "trainer.log_every=5", "stages=[train,export]")
    try:
        job.wait_for(lambda: any("step 5/2000" in line for line in job.lines))
        seconds, alive = job.stop(signal.SIGINT)
    finally:
        job.kill()
    out = "".join(job.lines)
    print(f"SIGINT during training: the launcher exited {seconds:.2f} s after the signal")
    assert seconds < 30 and not alive, (seconds, alive, out)
    assert job.proc.returncode == 128 + signal.SIGINT, out
    time.sleep(1)
    assert not (run_dir / "hf").exists() and not (run_dir / "checkpoint").exists()
    assert out.count("nemo-moe-export: stopped by SIGINT\n") == 1 and "Traceback" not in out, out
