"""Single-process export: option refusals before any write, overwrite policy, exact odd dtypes."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from nemo_moe_export.errors import InputError
from nemo_moe_export.export import export_hf_checkpoint, plan_export, verify_checkpoint
from nemo_moe_export.parallel import PeerError
from nemo_moe_export.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", n_experts=4)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(dtype="int8"), "export dtype must be floating point"),
        (dict(dtype="bfloat17"), "unknown dtype"),
        (dict(overwrite="sometimes"), "unknown overwrite policy"),
        (dict(max_shard_size="lots"), "unreadable size"),
        (dict(writer_threads=0), "writer_threads must be a positive integer"),
        (dict(filesystem="nfs"), "unknown filesystem mode"),
        (dict(staging_bytes=12), "staging buffer size must be a positive multiple of 8 bytes"),
        (dict(writer_ranks=[1]), "writer_ranks must name ranks of the group"),
        (dict(timeout_s=0), "timeout must be positive"),
        (dict(keep_dtype=["(unclosed"]), "keep_dtype entries must be regular expressions"),
        (dict(colour="red"), "unknown export option"),
        (dict(replica_mismatch="median"), "unknown replica_mismatch policy"),
        (dict(replica_mismatch="rank:7"), "replica_mismatch names a rank outside the export group"),
        (dict(passthrough="yes"), "passthrough must be true or false"),
    ],
)
def test_refused_options_write_nothing(model, tmp_path, kwargs, pattern):
    with pytest.raises(PeerError, match=pattern):
        export_hf_checkpoint(tmp_path / "out", model, **kwargs)
    assert os.listdir(tmp_path) == []


def test_existing_target_is_refused_then_replaced_atomically(model, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(PeerError, match=r"export target already exists.*overwrite=\"replace\""):
        export_hf_checkpoint(target, model)
    assert os.listdir(target) == ["keep.txt"]
    export_hf_checkpoint(target, model, overwrite="replace")
    assert "keep.txt" not in os.listdir(target) and verify_checkpoint(target).ok
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial or old directory left behind


def test_integer_and_zero_dim_tensors_are_kept_exact(model, tmp_path):
    sd = dict(model.state_dict())
    sd["model.step"] = torch.tensor(123456789012, dtype=torch.int64)  # 0-dim, beyond float precision
    sd["model.flags"] = torch.tensor([True, False, True])
    export_hf_checkpoint(tmp_path / "out", state_dict=sd, config=model.config, dtype="bfloat16")
    index_files = {f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")}
    found = {}
    for name in index_files:
        with safe_open(tmp_path / "out" / name, "pt") as f:
            for key in f.keys():
                found[key] = f.get_tensor(key)
    assert found["model.step"].dtype == torch.int64 and found["model.step"].item() == 123456789012
    assert found["model.flags"].tolist() == [True, False, True]
    assert found["model.norm.weight"].dtype == torch.bfloat16


def test_plan_tiles_files_and_is_deterministic(model):
    from nemo_moe_export.adapters import get_adapter

    meta = get_adapter(model.config).hf_metadata(model.state_dict())
    a, b = plan_export(meta, max_shard_size="10KB"), plan_export(dict(reversed(meta.items())), max_shard_size="10KB")
    assert [(f.name, f.header) for f in a.files] == [(f.name, f.header) for f in b.files]
    for f in a.files:
        spans = sorted((a.tensors[k].data_start, a.tensors[k].nbytes) for k in f.keys)
        cursor = len(f.header)
        for start, nbytes in spans:
            assert start == cursor
            cursor += nbytes
        assert cursor == f.size
    from nemo_moe_export.export.plan import natural_key

    assert sorted(["experts.10.w", "experts.9.w", "layers.2.x"], key=natural_key) == [
        "experts.9.w", "experts.10.w", "layers.2.x"]


def test_direct_write_path_does_not_copy(model, tmp_path):
    """fp32 CPU shards in fp32 go out as zero-copy byte views: nothing is staged."""
    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export.plan import plan_export as plan
    from nemo_moe_export.export.writer import write_headers, write_pieces

    adapter = get_adapter(model.config)
    p = plan(adapter.hf_metadata(model.state_dict()), max_shard_size="10KB")
    write_headers(p, str(tmp_path), [f.name for f in p.files])
    stats = write_pieces(p, adapter.to_hf(model.state_dict()).values(), str(tmp_path))
    assert stats.staged_bytes == 0 and stats.bytes_written == p.total_tensor_bytes
    p16 = plan(adapter.hf_metadata(model.state_dict()), dtype=torch.bfloat16, max_shard_size="10KB")
    write_headers(p16, str(tmp_path), [f.name for f in p16.files])
    stats16 = write_pieces(p16, adapter.to_hf(model.state_dict()).values(), str(tmp_path), staging_bytes=4096)
    assert stats16.staged_bytes == p16.total_tensor_bytes


@pytest.mark.parametrize("threads", [1, 3])
def test_staged_writes_with_several_writer_threads_are_exact(model, tmp_path, threads):
    """A cast export goes through the staging buffers; any number of pwrite threads writes the same
    bytes, and the stats account for the copy and write time of the step."""
    result = export_hf_checkpoint(tmp_path / "out", model, dtype="bfloat16", max_shard_size="10KB",
                                  staging_bytes=4096, writer_threads=threads)
    assert result.io["writer_threads"] == threads
    assert result.io["staged_bytes"] == result.io["bytes_written"] == result.checkpoint_bytes
    assert 0 < result.io["write_seconds"] and 0 < result.io["copy_seconds"]
    from nemo_moe_export.adapters import get_adapter

    reference = {k: p.tensor.to(torch.bfloat16) if p.tensor.is_floating_point() else p.tensor
                 for k, p in get_adapter(model.config).to_hf(model.state_dict()).items()}
    report = verify_checkpoint(tmp_path / "out", reference=reference)
    assert report.ok and report.compared == len(reference), report.summary()


def test_options_object_mapping_and_overrides_are_one_set_of_options(model, tmp_path):
    """``options`` may be an ExportOptions or a mapping; keyword overrides win over it."""
    from nemo_moe_export.export import ExportOptions

    base = ExportOptions(dtype="float16", max_shard_size="10KB")
    result = export_hf_checkpoint(tmp_path / "a", model, base, dtype="bfloat16")
    assert result.files > 1
    with safe_open(tmp_path / "a" / f"model-00001-of-{result.files:05d}.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    again = export_hf_checkpoint(tmp_path / "b", model, {"max_shard_size": "10KB", "dtype": "bfloat16"})
    assert (again.files, again.checkpoint_bytes) == (result.files, result.checkpoint_bytes)
    assert base.dtype == "float16"  # the caller's options are not changed by an override


def test_export_step_is_a_target_plus_options_and_a_hook(model, tmp_path):
    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export import ExportOptions, ExportStep
    from nemo_moe_export.hooks import RecipeContext

    step = ExportStep(tmp_path / "out", ExportOptions(dtype="bfloat16"), max_shard_size="10KB")
    assert step.output_dir == str(tmp_path / "out")
    assert step.options == ExportOptions(dtype="bfloat16", max_shard_size="10KB")
    with pytest.raises(InputError, match="unknown overwrite policy"):
        ExportStep(tmp_path / "never", overwrite="sometimes")  # refused when configured, not at the end
    ctx = RecipeContext(model=model, layout=None, adapter=get_adapter(model.config))
    step.on_train_end(ctx)
    result = ctx.results["export"]
    assert result.path == str(tmp_path / "out") and result.files > 1
    assert verify_checkpoint(result.path).ok


def test_storage_writer_is_chosen_once_from_the_options():
    from nemo_moe_export.export import ExportOptions, LocalFilesystemWriter, SharedFilesystemWriter, writer_for
    from nemo_moe_export.parallel import Coordinator

    coordinator = Coordinator()
    shared = writer_for(ExportOptions(writer_threads=2), coordinator)
    assert type(shared) is SharedFilesystemWriter and shared.writer_ranks == [0] and shared.writer_threads == 2
    local = writer_for(ExportOptions(filesystem="local"), coordinator)
    assert type(local) is LocalFilesystemWriter and local.writer_ranks == [0]  # the ranks on rank 0's host


def test_local_filesystem_mode_in_one_process(model, tmp_path):
    """With one rank the local-filesystem writer has nobody to exchange with and writes everything."""
    result = export_hf_checkpoint(tmp_path / "out", model, filesystem="local", max_shard_size="10KB",
                                  staging_bytes=4096)
    assert result.rank_bytes_written == result.checkpoint_bytes and result.files > 1
    assert verify_checkpoint(tmp_path / "out").ok


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_linear"])
@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_config_json_and_dtypes_are_save_pretrained_s_for_a_model_built_from_config(family, dtype, tmp_path):
    """A model as a training job holds it (``from_config``: its config has no ``architectures``):
    config.json has every key ``save_pretrained`` writes, the causal-LM class and the files' dtype,
    and every tensor is in the dtype save_pretrained writes (docs/design.md#serving-engines)."""
    from transformers import AutoModelForCausalLM

    from checks import assert_serving_config
    from nemo_moe_export.tiny_models import tiny_config

    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_config(tiny_config(family))
    assert not trained.config.architectures
    export_hf_checkpoint(str(tmp_path / "export"), trained, dtype=dtype)
    reference = AutoModelForCausalLM.from_config(tiny_config(family), dtype=getattr(torch, dtype or "float32"))
    reference.load_state_dict(trained.state_dict())
    reference.save_pretrained(tmp_path / "reference")
    config = assert_serving_config(str(tmp_path / "export"), str(tmp_path / "reference"))
    assert config["dtype"] == (dtype or "float32")
