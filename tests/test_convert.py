"""Checkpoint conversion (docs/convert.md): torchtitan DCP checkpoints -> HF on 1, 2, 3 and 4 ranks.

The checkpoints are torchtitan's own (``tests/torchtitan_fixture.py``: its models, its optimizer
container, its checkpointer's layout, saved under FSDP on 2 ranks). Each conversion must equal,
tensor for tensor (dtype and value), this repo's in-job export of a transformers model loaded with
torchtitan's own ``to_hf`` of the same weights; transformers loads it with no missing or unexpected
key; the ranks read exactly the model's stored bytes (torch's own reading of the metadata counts
them) and write each byte once. Bad input is refused before any file exists.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from checks import assert_serving_config
from convert_fixtures import (FAMILIES, in_job_export, reference_model, stored_model_bytes, tensors_of,
                              torchtitan_checkpoints, torchtitan_path)

from nemo_moe_export.convert import read_index
from nemo_moe_export.convert.engine import convert_checkpoint
from nemo_moe_export.errors import InputError
from nemo_moe_export.parallel import PeerError
from nemo_moe_export.spawn import spawn

pytestmark = pytest.mark.skipif(torchtitan_path() is None, reason="no torchtitan: `make setup-torchtitan` installs "
                                                                  "it in .torchtitan")
WORLDS = (1, 2, 3, 4)
SKIPPED = ("optimizer.", "train_state")


def in_hf_checkpoint(family: str, key: str) -> bool:
    """A stored tensor the HF checkpoint holds: not the optimizer's or train state, and not Qwen3's
    expert bias (its HF format has none; torchtitan's own to_hf drops it too)."""
    return not key.startswith(SKIPPED) and not (family == "qwen3_moe" and key.endswith(".moe.expert_bias_E"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    return torchtitan_checkpoints(str(tmp_path_factory.mktemp("torchtitan")))


def _convert_on_subgroups(rank: int, world: int, saved: str, out: str) -> dict:
    """One launch of 4 ranks for every case: the first n ranks convert as a group of n."""
    results = {}
    for n in WORLDS:
        group = dist.new_group(list(range(n)))  # every rank of the world makes every group
        for family in FAMILIES:
            if rank < n:
                result = convert_checkpoint(os.path.join(saved, family, "dcp"), os.path.join(out, f"{family}-{n}"),
                                            config=os.path.join(saved, family), dtype="bfloat16", group=group,
                                            progress_s=0.0 if n == 4 else None)
                results[(family, n)] = result
    return results


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("converted"))
    return out, spawn(_convert_on_subgroups, 4, saved, out, timeout_s=240)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_on_1_to_4_ranks_equals_the_in_job_export(family, saved, converted, tmp_path):
    out, results = converted
    model, info = reference_model(os.path.join(saved, family), str(tmp_path))
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected = tensors_of(in_job_export(model, str(tmp_path / "export"), dtype="bfloat16"))
    assert any(t.dtype == torch.bfloat16 for t in expected.values())
    for n in WORLDS:
        got = tensors_of(os.path.join(out, f"{family}-{n}"))
        assert sorted(got) == sorted(expected), n
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), (n, key)
    assert_serving_config(os.path.join(out, f"{family}-4"), str(tmp_path / "export"))


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_read_are_the_stored_model_bytes_and_written_once(family, saved, converted):
    out, results = converted
    stored, items = stored_model_bytes(os.path.join(saved, family, "dcp"), lambda key: in_hf_checkpoint(family, key))
    files = tensors_of(os.path.join(out, f"{family}-4"))
    written = sum(t.numel() * t.element_size() for t in files.values())
    for n in WORLDS:
        ranks = [results[r][(family, n)] for r in range(n)]
        assert sum(r.rank_bytes_read for r in ranks) == stored == ranks[0].source_bytes
        assert sum(r.items for r in ranks) == items
        assert sum(r.rank_bytes_written for r in ranks) == written == ranks[0].checkpoint_bytes
        if n > 1:  # balanced by source bytes: no rank reads more than its share and one item
            largest = max(c.length for t in read_index(os.path.join(saved, family, "dcp")).tensors.values()
                          for c in t.chunks)
            assert max(r.rank_bytes_read for r in ranks) <= stored / n + largest


def test_transformers_loads_the_conversion_with_no_missing_key(converted):
    from transformers import AutoModelForCausalLM

    out, _ = converted
    for family in FAMILIES:
        _, info = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"{family}-3"), output_loading_info=True)
        assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (family, info)


# ------------------------------------------------------------------------------------------------
# Bad input: refused before any file exists
# ------------------------------------------------------------------------------------------------


def _copy(saved: str, family: str, tmp_path) -> str:
    dcp_dir = str(tmp_path / "dcp")
    shutil.copytree(os.path.join(saved, family, "dcp"), dcp_dir)
    return dcp_dir


def _refused(src: str, tmp_path, config: str, pattern: str, **kwargs) -> InputError:
    out = tmp_path / "out"
    before = set(os.listdir(tmp_path))
    with pytest.raises(PeerError) as raised:
        convert_checkpoint(src, str(out), config=config, progress_s=None, **kwargs)
    cause = raised.value.__cause__
    assert isinstance(cause, InputError) and pattern in str(cause), str(cause)
    assert set(os.listdir(tmp_path)) == before  # nothing written: no target, no partial directory
    return cause


def test_missing_or_truncated_metadata_is_refused(saved, tmp_path):
    src = _copy(saved, "qwen3_moe", tmp_path)
    config = os.path.join(saved, "qwen3_moe")
    with open(os.path.join(src, ".metadata"), "rb") as f:
        data = f.read()
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(data[: len(data) // 2])
    assert ".metadata" in _refused(src, tmp_path, config, "the checkpoint's DCP metadata cannot be read").key
    os.remove(os.path.join(src, ".metadata"))
    _refused(src, tmp_path, config, "the checkpoint has no DCP metadata file")


def test_a_foreign_pickle_global_in_metadata_is_refused(saved, tmp_path):
    import pickle

    src = _copy(saved, "qwen3_moe", tmp_path)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(os.system, f)  # a global no DCP metadata names: never resolved, never called
    cause = _refused(src, tmp_path, os.path.join(saved, "qwen3_moe"), "the checkpoint's DCP metadata cannot be read")
    assert "is not a DCP metadata record" in str(cause)


def test_missing_or_truncated_data_file_is_refused(saved, tmp_path):
    src = _copy(saved, "deepseek_v3", tmp_path)
    config = os.path.join(saved, "deepseek_v3")
    path = os.path.join(src, "__1_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)
    assert _refused(src, tmp_path, config, "a data file of the checkpoint is truncated").key == path
    os.remove(path)
    assert _refused(src, tmp_path, config, "a data file of the checkpoint is missing").key == path


def test_a_key_no_table_maps_is_refused_naming_it(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    src = os.path.join(saved, "qwen3_moe", "dcp")
    index = read_index(src)
    state = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in index.tensors.items() if not k.startswith(SKIPPED)}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    state["layers.0.attention.mystery.weight"] = torch.zeros(2, 2)
    dcp.save(state, checkpoint_id=str(tmp_path / "odd"), no_dist=True)
    cause = _refused(str(tmp_path / "odd"), tmp_path, os.path.join(saved, "qwen3_moe"), "1 stored tensor(s) no")
    assert cause.key == "layers.0.attention.mystery.weight"


def test_a_config_whose_shapes_disagree_is_refused(saved, tmp_path):
    with open(os.path.join(saved, "qwen3_moe", "config.json")) as f:
        values = json.load(f)
    values["moe_intermediate_size"] = 24
    os.makedirs(tmp_path / "config")
    with open(tmp_path / "config" / "config.json", "w") as f:
        json.dump(values, f)
    src = os.path.join(saved, "qwen3_moe", "dcp")
    cause = _refused(src, tmp_path, str(tmp_path / "config"), "the checkpoint's shape disagrees with the HF config")
    assert set(cause.expected) ^ set(cause.actual) == {24, 16}  # the expert width the config claims vs stored


def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path):
    src = os.path.join(saved, "qwen3_moe", "dcp")
    cause = _refused(src, tmp_path, os.path.join(saved, "deepseek_v3"), "")
    assert "no torchtitan key table maps" in str(cause) or "not of the model the HF config describes" in str(cause)


def test_an_existing_output_is_refused_unless_replace(saved, tmp_path):
    src = os.path.join(saved, "qwen3_moe", "dcp")
    os.makedirs(tmp_path / "out")
    _refused(src, tmp_path, os.path.join(saved, "qwen3_moe"), "export target already exists")
    result = convert_checkpoint(src, str(tmp_path / "out"), config=os.path.join(saved, "qwen3_moe"),
                                overwrite="replace", progress_s=None)
    assert result.files == 1 and os.path.exists(tmp_path / "out" / "config.json")


def _convert_fp8_on_subgroups(rank: int, world: int, saved: str, out: str) -> dict:
    results = {}
    for n in FP8_WORLDS:
        group = dist.new_group(list(range(n)))
        for family in FAMILIES:
            if rank < n:
                results[(family, n)] = convert_checkpoint(
                    os.path.join(saved, family, "dcp"), os.path.join(out, f"{family}-{n}"),
                    config=os.path.join(saved, family), dtype="bfloat16", quantize="fp8_block", group=group,
                    progress_s=None)
    return results


FP8_WORLDS = (1, 2, 3)


@pytest.fixture(scope="module")
def converted_fp8(saved, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("converted_fp8"))
    return out, spawn(_convert_fp8_on_subgroups, 3, saved, out, timeout_s=120)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_conversion_on_1_to_3_ranks_is_the_in_job_fp8_export_byte_for_byte(family, saved, converted_fp8,
                                                                                 tmp_path):
    """torchtitan saved each weight in two FSDP boxes, and this model's weights are narrower than a
    128 x 128 block: every block spans both boxes (docs/convert.md#fp8)."""
    out, results = converted_fp8
    model, _ = reference_model(os.path.join(saved, family), str(tmp_path))
    reference = in_job_export(model, str(tmp_path / "export"), dtype="bfloat16", quantize="fp8_block")
    expected = tensors_of(reference)
    assert any(t.dtype == torch.float8_e4m3fn for t in expected.values())
    stored, _ = stored_model_bytes(os.path.join(saved, family, "dcp"), lambda key: in_hf_checkpoint(family, key))
    for n in FP8_WORLDS:
        got = tensors_of(os.path.join(out, f"{family}-{n}"))
        assert sorted(got) == sorted(expected), n
        for key, want in expected.items():
            assert got[key].dtype == want.dtype, (n, key)
            assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), (n, key)
        assert sum(results[r][(family, n)].rank_bytes_read for r in range(n)) == stored, n
        with open(os.path.join(out, f"{family}-{n}", "config.json")) as f, \
                open(os.path.join(reference, "config.json")) as g:
            assert json.load(f) == json.load(g), n
    if family == "deepseek_v3":  # the command line: the same files
        from nemo_moe_export.cli import main

        cli = str(tmp_path / "cli")
        assert main(["convert", os.path.join(saved, family, "dcp"), cli, "--config", os.path.join(saved, family),
                     "--dtype", "bfloat16", "--quantize", "fp8_block"]) == 0
        got = tensors_of(cli)
        assert sorted(got) == sorted(expected)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in expected.items())


def test_the_command_line_converts_and_refuses_an_existing_output(saved, tmp_path, capsys):
    from nemo_moe_export.cli import main

    src, config = os.path.join(saved, "deepseek_v3", "dcp"), os.path.join(saved, "deepseek_v3")
    out = str(tmp_path / "hf")
    assert main(["convert", src, out, "--config", config, "--dtype", "bfloat16", "--tokenizer", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["format"] == "torchtitan" and printed["path"] == out
    assert main(["convert", src, out, "--config", config]) == 1
    assert "export target already exists" in capsys.readouterr().err


def test_deepseek_v3_mtp_block_maps_as_torchtitans_own_to_hf(saved, tmp_path):
    """The MTP block (``mtp_layers.0.*``: its attention, MoE, enorm / hnorm / eh_proj / mtp_norm) is
    HF layer ``num_hidden_layers``, as torchtitan's own adapter writes it (transformers builds no MTP
    module, so the reference here is torchtitan's ``to_hf`` alone)."""
    family = os.path.join(saved, "deepseek_v3_mtp")
    convert_checkpoint(os.path.join(family, "dcp"), str(tmp_path / "hf"), config=family, progress_s=None)
    from safetensors.torch import load_file

    got, want = tensors_of(str(tmp_path / "hf")), load_file(os.path.join(family, "reference.safetensors"))
    assert any(k.startswith("model.layers.2.") for k in want)
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_a_corrupt_item_is_refused_naming_its_key_and_nothing_is_published(saved, tmp_path):
    src = _copy(saved, "qwen3_moe", tmp_path)
    index = read_index(src)
    chunk = next(c for t in index.tensors.values() if t.key == "norm.weight" for c in t.chunks)
    with open(os.path.join(src, chunk.file), "r+b") as f:  # the item's bytes overwritten, the file's size kept
        f.seek(chunk.byte_offset)
        f.write(b"\0" * chunk.length)
    before = set(os.listdir(tmp_path))
    with pytest.raises(PeerError, match="not a torch.save archive") as raised:
        convert_checkpoint(src, str(tmp_path / "out"), config=os.path.join(saved, "qwen3_moe"), progress_s=None)
    assert raised.value.__cause__.key == "norm.weight"
    assert set(os.listdir(tmp_path)) == before  # the partial directory removed, no target


def _decoded(chunk, archive: bytes, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``archive`` decoded from a writable buffer at an odd address (as a run's items lie), and
    where the tensor's bytes lie in that buffer (-1: not in it, a copy)."""
    import numpy as np

    from nemo_moe_export.convert.reader import _decode

    buffer = np.frombuffer(bytearray(b"x" + archive), dtype=np.uint8)
    tensor = _decode(chunk, memoryview(buffer)[1:], dtype)
    at = tensor.data_ptr() - buffer.ctypes.data
    return tensor, at if 0 <= at < len(buffer) else -1


def test_stored_items_decode_in_place_as_torch_load_reads_them(saved, tmp_path):
    import dataclasses
    import io
    import zipfile

    index = read_index(os.path.join(saved, "qwen3_moe", "dcp"))
    for chunk in (c for t in index.tensors.values() for c in t.chunks):
        with open(os.path.join(index.directory, chunk.file), "rb") as f:
            f.seek(chunk.byte_offset)
            archive = f.read(chunk.length)
        want = torch.load(io.BytesIO(archive), weights_only=True)
        got, at = _decoded(chunk, archive, want.dtype)
        assert at > 0 or want.numel() == 0  # over the read bytes, no copy
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)
    view = torch.arange(12, dtype=torch.float32).view(3, 4).t()[1:]  # a transposed view keeps its strides
    saved_view = io.BytesIO()
    torch.save(view, saved_view)
    box = dataclasses.replace(chunk, key="view", sizes=(3, 3), length=len(saved_view.getvalue()))
    got, at = _decoded(box, saved_view.getvalue(), torch.float32)
    assert at > 0 and got.stride() == view.stride() and torch.equal(got, view)
    deflated = io.BytesIO()  # a compressed entry: not what torch.save writes, torch.load reads it
    with zipfile.ZipFile(io.BytesIO(saved_view.getvalue())) as src, zipfile.ZipFile(deflated, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name), compress_type=zipfile.ZIP_DEFLATED)
    got, at = _decoded(box, deflated.getvalue(), torch.float32)
    assert at == -1 and got.stride() == view.stride() and torch.equal(got, view)


def _read_so_far() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _reader_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "nme-convert-reader" and t.is_alive()]


def test_reading_ahead_is_bounded_stops_on_close_and_hands_on_a_failed_read(saved, tmp_path):
    """The conversion's reader reads ahead of its consumer (docs/design.md#checkpoint-conversion):
    no more than its bound before anything is consumed, every box as torch.load reads it, its
    thread gone once closed, and a read that fails reaches the consumer, naming the file."""
    import io
    import time

    from nemo_moe_export.convert.reader import ChunkReader, ReadStats

    src = _copy(saved, "qwen3_moe", tmp_path)
    index = read_index(src)
    chunks = [c for t in index.tensors.values() for c in t.chunks]
    largest, ahead = max(c.length for c in chunks), 3 * max(c.length for c in chunks)
    polls = 64 << 10  # what reading /proc/self/io itself adds to rchar while this test polls it
    assert sum(c.length for c in chunks) > 4 * (ahead + polls)  # a reader that ignored the bound would pass it
    before, stats = _read_so_far(), ReadStats()
    reader = ChunkReader(index, chunks, stats, read_bytes=1, ahead_bytes=ahead)  # one box per pread
    deadline = time.monotonic() + 10
    while _read_so_far() - before < largest and time.monotonic() < deadline:  # the thread has started reading
        time.sleep(0.05)
    time.sleep(0.5)  # nothing consumed: the thread stops at the bound
    assert largest <= _read_so_far() - before <= ahead + polls
    for chunk, tensor in reader:
        with open(os.path.join(src, chunk.file), "rb") as f:
            f.seek(chunk.byte_offset)
            want = torch.load(io.BytesIO(f.read(chunk.length)), weights_only=True)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)
    assert stats.bytes_read == sum(c.length for c in chunks) and stats.items == len(chunks)

    reader = ChunkReader(index, chunks, ReadStats(), read_bytes=1, ahead_bytes=ahead)
    next(iter(reader))
    reader.close()
    deadline = time.monotonic() + 10
    while _reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _reader_threads()

    last = max(chunks, key=lambda c: (c.file, c.byte_offset))
    os.truncate(os.path.join(src, last.file), last.byte_offset + last.length // 2)  # after the files were checked
    with pytest.raises(InputError, match="ended early") as raised:
        for _ in ChunkReader(index, chunks, ReadStats(), ahead_bytes=ahead):
            pass
    assert raised.value.key == last.file


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7, 64])
def test_work_is_every_box_once_in_file_order_balanced_by_bytes(saved, world):
    from nemo_moe_export.convert.assign import assign_work, model_chunks
    from nemo_moe_export.convert.formats import table_for
    from nemo_moe_export.convert.checks import hf_config_of

    index = read_index(os.path.join(saved, "deepseek_v3", "dcp"))
    chunks = model_chunks(index, table_for(index, hf_config_of(os.path.join(saved, "deepseek_v3"))).skipped)
    work = assign_work(chunks, world)
    assert assign_work(list(chunks), world) == work  # pure and deterministic
    assert [c for share in work for c in share] == chunks  # every box once, contiguous runs in read order
    total, largest = sum(c.length for c in chunks), max(c.length for c in chunks)
    assert all(sum(c.length for c in share) <= total / world + largest for share in work)
