"""Conversion of megatron-core ``torch_dist`` checkpoints (docs/convert.md#megatron-torch_dist):
checkpoints written by megatron-core 0.16.1 itself (``megatron_checkpoints.py``: one spawn of 4
ranks writes both families under TP2 x EP2 + SP, PP2 x EP2 and ETP2, with optimizer state, RNG and
``args``), each compared with the in-job export of the same weights (megatron's own load into the
model, then ``export_hf_checkpoint``).

The table alone: every stored box read with torch DCP, mapped by the table, assembled; equal,
tensor for tensor (dtype and value), to the in-job export, every element covered once. The engine
(``convert_checkpoint``): one launch of 4 ranks converts every checkpoint on 1, 2, 3 and 4 ranks
(the first n ranks as a group; the checkpoints were saved by 4), in float32 on 1 and 2 ranks (2:
with no config given, derived from ``common.pt``) and cast to bfloat16 on 3 and 4; each equal to
the in-job export in that dtype, loadable by transformers, the ranks reading exactly the model's
stored bytes (torch's own reading of the metadata counts them; the optimizer's never) and writing
each byte once. With ``quantize="fp8_block"`` on 1, 2 and 3 ranks: byte for byte the in-job FP8
export of the megatron model (whose 128 x 128 blocks span the TP, expert-TP, GLU and expert boxes of
these tiny models, all narrower than a block).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoConfig

from megatron_checkpoints import CASES, FAMILIES, FP8, checkpoint_dir, export_dir, write_checkpoints
from nemo_moe_export.convert import StoredTensor, read_index, table_for
from nemo_moe_export.convert.engine import convert_checkpoint
from nemo_moe_export.convert.megatron import FORMAT
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.config_json import CONFIG_FILE
from nemo_moe_export.parallel import PeerError
from nemo_moe_export.spawn import spawn

CASE_IDS = [f"{layout}-{family}" for layout, family in CASES]


@pytest.fixture(scope="session")
def megatron_root(tmp_path_factory):
    """Every case's checkpoint and expected export, written once per test session."""
    root = str(tmp_path_factory.mktemp("megatron_torch_dist"))
    write_checkpoints(root)
    return root


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return {k: v for f in glob.glob(os.path.join(path, "*.safetensors")) for k, v in load_file(f).items()}


def _expected(root: str, layout: str, family: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    return _tensors(export_dir(root, layout, family, dtype))


def _table(root: str, layout: str, family: str):
    index = read_index(checkpoint_dir(root, layout, family))
    return index, table_for(index, AutoConfig.from_pretrained(export_dir(root, layout, family)))


def _box(chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))


def _assembled(index, table) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every HF tensor assembled from the table's pieces of every stored box (read with torch DCP),
    and how many times each element was written."""
    meta = table.hf_metadata(index)
    stored = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in index.tensors.items() if not table.skipped(k)}
    dcp.load(stored, checkpoint_id=index.directory, no_dist=True)
    out = {k: torch.zeros(m.shape, dtype=m.dtype) for k, m in meta.items()}
    count = {k: torch.zeros(m.shape, dtype=torch.int32) for k, m in meta.items()}
    for key in stored:
        for chunk in index.tensors[key].chunks:
            for piece in table.pieces(key, chunk.offsets, stored[key][_box(chunk)]):
                assert piece.source_key == key and piece.primary
                where = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.tensor.shape))
                out[piece.key][where] = piece.tensor
                count[piece.key][where] += 1
    return out, count


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_the_tables_pieces_of_every_stored_box_are_the_in_job_export(layout, family, megatron_root):
    index, table = _table(megatron_root, layout, family)
    assert index.format == FORMAT and table.format == FORMAT
    out, count = _assembled(index, table)
    expected = _expected(megatron_root, layout, family)
    assert set(out) == set(expected)
    for key, value in expected.items():
        assert torch.equal(count[key], torch.ones_like(count[key])), f"{key}: elements not written exactly once"
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_training_state_is_skipped_by_rule_and_every_weight_is_mapped(layout, family, megatron_root):
    index, table = _table(megatron_root, layout, family)
    skipped = {k for k in index.tensors if table.skipped(k)}
    assert skipped and all(k.startswith("optimizer.state.exp_avg") for k in skipped)
    # an optimizer key has its weight's shape and chunks: told apart by rule, not by shape
    weight = next(k for k in index.tensors if f"optimizer.state.exp_avg.{k}" in index.tensors)
    assert index.tensors[f"optimizer.state.exp_avg.{weight}"].shape == index.tensors[weight].shape
    assert all(table.skipped(k) for k in index.other)
    assert any(k.startswith("rng_state/") for k in index.other)
    assert any("._extra_state/" in k for k in index.other)
    mapped = {p.source_key for k in index.tensors if not table.skipped(k)
              for p in table.pieces(k, (0,) * len(index.tensors[k].shape),
                                    torch.zeros(index.tensors[k].shape, dtype=index.tensors[k].dtype))}
    assert mapped == {k for k in index.tensors if not table.skipped(k)}


def test_what_megatron_records_stacked_layers_global_experts_glu_chunks(megatron_root):
    """What the table relies on, as megatron-core 0.16.1 wrote it (docs/design.md#megatron-torch_dist-keys)."""
    qwen = read_index(checkpoint_dir(megatron_root, "tp2_ep2_sp", "qwen3_moe"))
    fc1 = qwen.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (2, 4, 2 * 16, 32)  # (layers, experts, [gate; up], hidden)
    assert len(fc1.chunks) == 2 * 4 * 4  # per layer and expert: gate and up rows of each of 2 expert-TP ranks
    assert qwen.tensors["embedding.word_embeddings.weight"].shape[0] == 256  # 62 tokens padded to 128 * TP
    deepseek = read_index(checkpoint_dir(megatron_root, "pp2_ep2", "deepseek_v3"))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in deepseek.tensors  # heterogeneous: per layer
    assert deepseek.tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].shape[0] == 4
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in deepseek.tensors
    stacked = read_index(checkpoint_dir(megatron_root, "pp2_ep2", "qwen3_moe"))
    owners = {c.file for c in stacked.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks}
    assert len(owners) == 2  # each pipeline stage wrote its own slice of the layer axis
    before_014 = read_index(checkpoint_dir(megatron_root, "etp2_pre014", "qwen3_moe"))
    gate = before_014.tensors["decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w"]
    assert gate.shape == (16, 32) and len(gate.chunks) == 2  # one expert's gate rows, split by expert-TP
    assert not any(k.startswith("decoder.layers.mlp.") for k in before_014.tensors)  # nothing stacked


def _with_tensor(index, key: str, like: str):
    stored = index.tensors[like]
    tensors = {**index.tensors, key: StoredTensor(key, stored.shape, stored.dtype, stored.chunks)}
    return dataclasses.replace(index, tensors=tensors)


def test_an_unknown_key_is_refused_by_name(megatron_root):
    index, _ = _table(megatron_root, "etp2", "qwen3_moe")
    config = AutoConfig.from_pretrained(export_dir(megatron_root, "etp2", "qwen3_moe"))
    bad = _with_tensor(index, "decoder.layers.mlp.experimental_gate.weight", "decoder.layers.mlp.router.weight")
    with pytest.raises(InputError, match="decoder.layers.mlp.experimental_gate.weight"):
        table_for(bad, config).hf_metadata(bad)
    odd = dataclasses.replace(index, other=index.other | {"dataloader_state/shard_0_1"})
    with pytest.raises(InputError, match="dataloader_state/shard_0_1"):
        table_for(odd, config)


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 3, "decoder layers are not the config's"),
    ("num_experts", 8, "experts disagree with the config"),
    ("vocab_size", 300, "vocab_size does not fit"),
])
def test_a_config_of_another_model_is_refused(field, value, message, megatron_root):
    index, _ = _table(megatron_root, "tp2_ep2_sp", "qwen3_moe")
    config = AutoConfig.from_pretrained(export_dir(megatron_root, "tp2_ep2_sp", "qwen3_moe"), **{field: value})
    with pytest.raises(InputError, match=message):
        table_for(index, config).hf_metadata(index)


# --------------------------------------------------------------------------------------------------
# The HF config from megatron's common.pt
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_the_config_derived_from_common_pt_is_the_in_job_exports(layout, family, megatron_root, tmp_path):
    from nemo_moe_export.convert.megatron_config import config_from_checkpoint
    from nemo_moe_export.export.config_json import write_config_json

    index = read_index(checkpoint_dir(megatron_root, layout, family))
    config = config_from_checkpoint(index)  # args holds an enum of megatron's (AttnBackend): read inert
    assert not hasattr(config, "in_memory_format")
    write_config_json(str(tmp_path), config, torch.float32)
    with open(tmp_path / CONFIG_FILE) as f:
        derived = json.load(f)
    with open(os.path.join(export_dir(megatron_root, layout, family), CONFIG_FILE)) as f:
        expected = json.load(f)
    assert derived == expected


class _Payload:
    """Would run a command if unpickled with its globals (a hostile common.pt)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_common_pt_without_args_or_with_foreign_globals_asks_for_a_config(tmp_path):
    import types

    from nemo_moe_export.convert.megatron_config import COMMON_FILE, config_from_checkpoint

    index = types.SimpleNamespace(directory=str(tmp_path), tensors={})
    with pytest.raises(InputError, match="no common.pt.*--config"):
        config_from_checkpoint(index)
    torch.save({"iteration": 1}, tmp_path / COMMON_FILE)  # the repo's own training checkpoints: no args
    with pytest.raises(InputError, match="holds no training arguments.*--config"):
        config_from_checkpoint(index)
    marker = tmp_path / "ran"
    torch.save({"args": _Payload(str(marker))}, tmp_path / COMMON_FILE)
    with pytest.raises(InputError, match="cannot be read.*GLOBAL posix.system.*--config") as refused:
        config_from_checkpoint(index)
    assert "weights_only" not in str(refused.value) and not marker.exists()  # never called


# --------------------------------------------------------------------------------------------------
# The HF config from Megatron-Bridge's run_config.yaml
# --------------------------------------------------------------------------------------------------

BRIDGE_LAYOUTS = {"deepseek_v3": "pp2_ep2", "qwen3_moe": "tp2_ep2_sp"}  # one checkpoint of each family


@pytest.fixture(scope="module")
def bridge_root(tmp_path_factory):
    from convert_fixtures import bridge_path, bridge_run_configs

    if bridge_path() is None:
        pytest.skip("no Megatron-Bridge: `make setup-bridge` installs it beside the environment")
    return bridge_run_configs(str(tmp_path_factory.mktemp("bridge_run_configs")))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_derived_from_bridges_run_config_is_the_in_job_exports(family, bridge_root, megatron_root,
                                                                         tmp_path):
    """Megatron-Bridge's own run_config.yaml of the model megatron saved: the YAML alone (its folder
    holds no common.pt) gives the in-job export's config.json."""
    from nemo_moe_export.convert.megatron_config import config_from_checkpoint
    from nemo_moe_export.export.config_json import write_config_json

    layout = BRIDGE_LAYOUTS[family]
    index = read_index(checkpoint_dir(megatron_root, layout, family))
    config = config_from_checkpoint(dataclasses.replace(index, directory=os.path.join(bridge_root, family)))
    write_config_json(str(tmp_path), config, torch.float32)
    assert _config_json(str(tmp_path)) == _config_json(export_dir(megatron_root, layout, family))


def test_a_bridge_checkpoint_converts_with_no_config_given(bridge_root, megatron_root, tmp_path, capsys):
    """A checkpoint folder as Megatron-Bridge leaves it (its run_config.yaml beside the shards, a
    common.pt with no args): ``convert`` with no ``--config`` takes the config from the YAML and
    equals the in-job export, tensors and config.json."""
    import shutil

    from nemo_moe_export.cli import main
    from nemo_moe_export.convert.megatron_config import COMMON_FILE

    layout, family = "pp2_ep2", "deepseek_v3"
    src = str(tmp_path / "checkpoint")
    shutil.copytree(checkpoint_dir(megatron_root, layout, family), src)
    torch.save({"iteration": 1}, os.path.join(src, COMMON_FILE))  # only the YAML can give the config
    shutil.copy(os.path.join(bridge_root, family, "run_config.yaml"), src)
    out = str(tmp_path / "hf")
    assert main(["convert", src, out, "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path"] == out
    expected, got = _expected(megatron_root, layout, family, "bfloat16"), _tensors(out)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    assert _config_json(out) == _config_json(export_dir(megatron_root, layout, family, "bfloat16"))


def _run_config_without(bridge_root: str, out, field: str) -> None:
    """Bridge's qwen3_moe run_config.yaml with the model's ``field`` line dropped, into ``out``."""
    with open(os.path.join(bridge_root, "qwen3_moe", "run_config.yaml")) as f:
        lines = f.read().splitlines(keepends=True)
    start = lines.index("model:\n")
    drop = next(i for i in range(start, len(lines)) if lines[i].startswith(f"  {field}:"))
    (out / "run_config.yaml").write_text("".join(lines[:drop] + lines[drop + 1:]))


@pytest.mark.parametrize("field", ["num_layers", "num_moe_experts", "vocab_size"])
def test_a_run_config_lacking_a_needed_field_is_refused_by_name(field, bridge_root, megatron_root, tmp_path):
    from nemo_moe_export.convert.megatron_config import config_from_checkpoint

    _run_config_without(bridge_root, tmp_path, field)
    index = dataclasses.replace(read_index(checkpoint_dir(megatron_root, "tp2_ep2_sp", "qwen3_moe")),
                                directory=str(tmp_path))
    with pytest.raises(InputError, match=f"lacks a field.*run_config.yaml:model.{field}.*--config"):
        config_from_checkpoint(index)


def test_a_run_config_is_read_as_plain_values_never_built(tmp_path):
    import types

    from nemo_moe_export.convert.megatron_config import config_from_checkpoint

    index = types.SimpleNamespace(directory=str(tmp_path), tensors={})
    marker = tmp_path / "ran"
    (tmp_path / "run_config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(InputError, match="cannot be read.*safe_load.*python/object/apply:os.system.*--config"):
        config_from_checkpoint(index)
    assert not marker.exists()
    (tmp_path / "run_config.yaml").write_text("_target_: megatron.bridge.training.config.ConfigContainer\n")
    with pytest.raises(InputError, match="holds no model section.*--config"):
        config_from_checkpoint(index)


# --------------------------------------------------------------------------------------------------
# The engine: convert_checkpoint on 1, 2, 3 and 4 ranks
# --------------------------------------------------------------------------------------------------

WORLDS = (1, 2, 3, 4)
DTYPES = {1: "float32", 2: "float32", 3: "bfloat16", 4: "bfloat16"}  # 2: the config derived from common.pt


def _convert_on_subgroups(rank: int, world: int, root: str, out: str) -> dict:
    """One launch of 4 ranks for every case: the first n ranks convert as a group of n."""
    import torch.distributed as dist

    results = {}
    for n in WORLDS:
        group = dist.new_group(list(range(n)))  # every rank of the world makes every group
        for layout, family in CASES:
            if rank < n:
                config = None if n == 2 else export_dir(root, layout, family)
                results[(layout, family, n)] = convert_checkpoint(
                    checkpoint_dir(root, layout, family), os.path.join(out, f"{layout}-{family}-{n}"), config=config,
                    dtype=None if DTYPES[n] == "float32" else DTYPES[n], group=group, progress_s=None)
    return results


@pytest.fixture(scope="module")
def converted(megatron_root, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("megatron_converted"))
    return out, spawn(_convert_on_subgroups, 4, megatron_root, out, timeout_s=300)


def _config_json(path: str) -> dict:
    with open(os.path.join(path, CONFIG_FILE)) as f:
        return json.load(f)


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_converted_on_1_to_4_ranks_equals_the_in_job_export(layout, family, megatron_root, converted):
    out, _ = converted
    for n in WORLDS:
        path = os.path.join(out, f"{layout}-{family}-{n}")
        expected, got = _expected(megatron_root, layout, family, DTYPES[n]), _tensors(path)
        assert sorted(got) == sorted(expected), n
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), (n, key)
        # config.json: the in-job export's, given (as its directory) or derived from common.pt (n = 2)
        assert _config_json(path) == _config_json(export_dir(megatron_root, layout, family, DTYPES[n])), n


def _stored_model_bytes(path: str) -> tuple[int, int]:
    """(bytes, items) of the model's stored tensors, from torch's own reading of the metadata:
    every tensor item that is not the optimizer's."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    items = [info for index, info in metadata.storage_data.items()
             if index.offset is not None and not index.fqn.startswith("optimizer.")]
    return sum(info.length for info in items), len(items)


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_bytes_read_are_the_model_bytes_never_the_optimizers_and_written_once(layout, family, megatron_root,
                                                                               converted):
    out, results = converted
    stored, items = _stored_model_bytes(checkpoint_dir(megatron_root, layout, family))
    for n in WORLDS:
        ranks = [results[r][(layout, family, n)] for r in range(n)]
        assert sum(r.rank_bytes_read for r in ranks) == stored == ranks[0].source_bytes, n
        assert sum(r.items for r in ranks) == items, n
        written = sum(t.numel() * t.element_size() for t in _tensors(os.path.join(out, f"{layout}-{family}-{n}")).values())
        assert sum(r.rank_bytes_written for r in ranks) == written == ranks[0].checkpoint_bytes, n
    # the optimizer's state (Adam's two moments of every weight) was there, and never read
    index = read_index(checkpoint_dir(megatron_root, layout, family))
    optimizer = sum(c.length for k, t in index.tensors.items() if k.startswith("optimizer.") for c in t.chunks)
    assert optimizer > 1.9 * stored


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_transformers_loads_the_conversion(family, converted):
    """No missing key; the only unexpected ones are DeepSeek-V3's MTP layer, which transformers
    does not build (as for the in-job export)."""
    from transformers import AutoModelForCausalLM

    out, _ = converted
    path = os.path.join(out, f"pp2_ep2-{family}-3")
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    layers = _config_json(path)["num_hidden_layers"]
    assert all(k.startswith(f"model.layers.{layers}.") for k in info["unexpected_keys"]), info
    assert bool(info["unexpected_keys"]) == (family == "deepseek_v3")


@pytest.mark.parametrize("config_of,change,message", [
    ("deepseek_v3", {}, "no rule maps this in-memory key.*another model family"),  # another family's config
    ("qwen3_moe", {"hidden_size": 48}, "shape disagrees with the HF config"),
])
def test_another_models_config_is_refused_before_any_file_exists(config_of, change, message, megatron_root,
                                                                   tmp_path):
    config = AutoConfig.from_pretrained(export_dir(megatron_root, "tp2_ep2_sp", config_of), **change)
    out = tmp_path / "out"
    with pytest.raises(PeerError, match=f"InputError: .*{message}"):  # every rank's agreed refusal
        convert_checkpoint(checkpoint_dir(megatron_root, "tp2_ep2_sp", "qwen3_moe"), out, config=config)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_the_command_line_needs_no_config_for_a_megatron_lm_checkpoint(megatron_root, tmp_path, capsys):
    from nemo_moe_export.cli import main

    layout, family = "pp2_ep2", "deepseek_v3"
    out = str(tmp_path / "hf")
    assert main(["convert", checkpoint_dir(megatron_root, layout, family), out, "--dtype", "bfloat16"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["format"] == FORMAT and printed["path"] == out
    expected, got = _expected(megatron_root, layout, family, "bfloat16"), _tensors(out)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    assert _config_json(out) == _config_json(export_dir(megatron_root, layout, family, "bfloat16"))


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_plan_convert_predicts_the_conversions_tensors_files_and_bytes(family, megatron_root, converted):
    """``plan --convert`` (planner/convert.py), from the HF config alone, against the conversion on 3
    ranks (bf16): the same tensors (DeepSeek-V3's MTP layer included), files and bytes written; the
    bytes read within what megatron stores differently (the padded vocabulary, the MTP head stored
    once as the output layer), and one share per rank within a box of the mean."""
    from nemo_moe_export.planner.convert import ConversionModel, plan_conversion

    out, results = converted
    layout, path = "pp2_ep2", os.path.join(out, f"pp2_ep2-{family}-3")
    index, table = _table(megatron_root, layout, family)
    stored = {k: t for k, t in index.tensors.items() if not table.skipped(k)}
    source_dtype = next(iter(stored.values())).dtype
    config = AutoConfig.from_pretrained(export_dir(megatron_root, layout, family))
    report = plan_conversion(config, 3, source_dtype=source_dtype, dtype="bfloat16")
    written = _tensors(path)
    assert report["tensors"] == len(written)
    assert report["files"] == len(glob.glob(os.path.join(path, "*.safetensors")))
    assert report["bytes_written"] == results[0][(layout, family, 3)].checkpoint_bytes
    stored_bytes = sum(math.prod(t.shape) * t.dtype.itemsize for t in stored.values())  # tensor bytes, not archives
    assert abs(report["bytes_read"] - stored_bytes) <= 0.2 * stored_bytes, (report["bytes_read"], stored_bytes)
    largest = max(math.prod(t.shape) for t in written.values()) * source_dtype.itemsize
    assert report["max_rank_bytes_read"] <= report["bytes_read"] / 3 + largest
    # the time: one node's I/O (reads, then writes), overlapped with its slowest rank's decoding
    for decode in (1e3, 1e12):
        model = ConversionModel(read_bandwidth=1e6, write_bandwidth=2e6, decode_bandwidth=decode, ranks_per_node=3)
        timed = plan_conversion(config, 3, model, source_dtype=source_dtype, dtype="bfloat16")
        io = timed["bytes_read"] / 1e6 + timed["bytes_written"] / 2e6
        assert timed["predicted_seconds"] == pytest.approx(max(io, timed["max_rank_bytes_read"] / decode), abs=1e-3)


# --------------------------------------------------------------------------------------------------
# FP8: convert_checkpoint(quantize="fp8_block") on 1, 2 and 3 ranks
# --------------------------------------------------------------------------------------------------

FP8_WORLDS = (1, 2, 3)


def _convert_fp8_on_subgroups(rank: int, world: int, root: str, out: str) -> dict:
    import torch.distributed as dist

    results = {}
    for n in FP8_WORLDS:
        group = dist.new_group(list(range(n)))
        for layout, family in CASES:
            if rank < n:
                results[(layout, family, n)] = convert_checkpoint(
                    checkpoint_dir(root, layout, family), os.path.join(out, f"{layout}-{family}-{n}"),
                    config=export_dir(root, layout, family), dtype="bfloat16", quantize="fp8_block", group=group,
                    progress_s=None)
    return results


@pytest.fixture(scope="module")
def converted_fp8(megatron_root, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("megatron_fp8"))
    return out, spawn(_convert_fp8_on_subgroups, 3, megatron_root, out, timeout_s=300)


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout,family", CASES, ids=CASE_IDS)
def test_fp8_conversion_on_1_to_3_ranks_is_the_in_job_fp8_export_byte_for_byte(layout, family, megatron_root,
                                                                                 converted_fp8):
    out, results = converted_fp8
    expected = _expected(megatron_root, layout, family, FP8)
    assert {t.dtype for t in expected.values()} >= {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
    stored, _ = _stored_model_bytes(checkpoint_dir(megatron_root, layout, family))
    for n in FP8_WORLDS:
        path = os.path.join(out, f"{layout}-{family}-{n}")
        got = _tensors(path)
        assert sorted(got) == sorted(expected), n
        for key, tensor in expected.items():
            assert _same_bytes(got[key], tensor), (n, key)
        assert _config_json(path) == _config_json(export_dir(megatron_root, layout, family, FP8)), n
        ranks = [results[r][(layout, family, n)] for r in range(n)]
        assert sum(r.rank_bytes_read for r in ranks) == stored, n  # each byte read once
        written = sum(t.numel() * t.element_size() for t in got.values())
        assert sum(r.rank_bytes_written for r in ranks) == written == ranks[0].checkpoint_bytes, n


def test_fp8_units_keep_the_boxes_of_a_block_on_one_rank(megatron_root):
    """Blocks span boxes here (a unit of several boxes); each unit goes whole to one rank; every
    box once; no rank reads more than its share and one unit."""
    from nemo_moe_export.convert.assign import assign_units, model_chunks
    from nemo_moe_export.convert.fp8 import fp8_layout, units_of
    from nemo_moe_export.export.options import ExportOptions
    from nemo_moe_export.export.plan import plan_export

    index, table = _table(megatron_root, "tp2_ep2_sp", "deepseek_v3")
    config = AutoConfig.from_pretrained(export_dir(megatron_root, "tp2_ep2_sp", "deepseek_v3"))
    chunks = model_chunks(index, table.skipped)
    _, layout = fp8_layout(plan_export(table.hf_metadata(index)), ExportOptions(quantize="fp8_block"), config)
    units = units_of(chunks, table, index, layout)
    in_order = [c for u in units for c in u]
    assert max(len(u) for u in units) > 1 and len(in_order) == len(chunks) and set(in_order) == set(chunks)
    largest = max(sum(c.length for c in u) for u in units)
    total = sum(c.length for c in chunks)
    for world in (2, 3, 5):
        work = assign_units(units, world)
        assert [u for share in work for u in share] == units
        assert all(sum(c.length for u in share for c in u) <= total / world + largest for share in work)
