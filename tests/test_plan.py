"""The export plan alone (pure, no I/O, no ranks): layout, digest, file owners and element coverage."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_moe_export.adapters import HFShard, TensorMeta, get_adapter
from nemo_moe_export.errors import InputError
from nemo_moe_export.export.plan import assign_file_owners, check_coverage, element_counts, plan_export
from nemo_moe_export.safetensors_format import decode_header
from nemo_moe_export.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3", n_experts=5)


@pytest.fixture(scope="module")
def metadata(model):
    return get_adapter(model.config).hf_metadata(model.state_dict())


@pytest.fixture(scope="module")
def pieces(model):
    return list(get_adapter(model.config).to_hf(model.state_dict()).values())


def test_headers_decode_to_the_planned_offsets(metadata):
    import io

    plan = plan_export(metadata, dtype=torch.bfloat16, keep_dtype=[r"mlp\.gate\.weight$"], max_shard_size="16KB")
    assert len(plan.files) > 1 and set(plan.tensors) == set(metadata)
    for f in plan.files:
        header = decode_header(io.BytesIO(f.header), len(f.header), name=f.name)
        assert header.metadata == {"format": "pt"} and header.keys() == list(f.keys)
        for key in f.keys:
            entry, planned = header.entry(key), plan.tensors[key]
            assert (header.data_start + entry.start, entry.nbytes) == (planned.data_start, planned.nbytes)
            assert entry.shape == metadata[key].shape == planned.shape
            kept = key.endswith("mlp.gate.weight")
            assert planned.dtype == (torch.float32 if kept else torch.bfloat16), key
            assert entry.dtype == ("F32" if kept else "BF16")


def test_a_stamped_plan_is_the_plan_laid_out_with_its_export_id(metadata):
    """``stamped`` splices the id into each header (it does not encode the entries again): the
    result must equal the plan laid out with the id from the start, and its headers must decode
    to the stamped metadata at the shifted offsets."""
    import io

    job = "20261201T183605-0123456789ab"
    plan = plan_export(metadata, dtype=torch.bfloat16, max_shard_size="16KB")
    stamped = plan.stamped(job)
    assert len(plan.files) > 1 and stamped == plan_export(metadata, dtype=torch.bfloat16, max_shard_size="16KB",
                                                           export_id=job)
    assert stamped.stamped("other-job") == plan.stamped("other-job")  # restamping replaces the id
    for before, after in zip(plan.files, stamped.files):
        header = decode_header(io.BytesIO(after.header), len(after.header), name=after.name)
        assert header.metadata == {"format": "pt", "nemo_moe_export.export_id": job}
        shift = len(after.header) - len(before.header)
        assert after.size == before.size + shift and shift > 0
        for key in after.keys:
            assert stamped.tensors[key].data_start == plan.tensors[key].data_start + shift
            assert header.data_start + header.entry(key).start == stamped.tensors[key].data_start


def test_digest_is_the_layout(metadata):
    a = plan_export(metadata, max_shard_size="16KB")
    assert a.digest() == plan_export(dict(reversed(metadata.items())), max_shard_size="16KB").digest()
    assert a.digest() != plan_export(metadata, max_shard_size="32KB").digest()
    assert a.digest() != plan_export(metadata, dtype=torch.bfloat16, max_shard_size="16KB").digest()


def test_file_owners_go_round_robin_over_the_writers(metadata):
    plan = plan_export(metadata, max_shard_size="8KB")
    names = [f.name for f in plan.files]
    assert len(names) >= 5
    owners = assign_file_owners(plan, [3, 1])
    assert [owners[n] for n in names] == [[3, 1][i % 2] for i in range(len(names))]
    assert set(assign_file_owners(plan, [0]).values()) == {0}
    with pytest.raises(InputError, match="no rank to own the checkpoint files"):
        assign_file_owners(plan, [])


def test_whole_pieces_cover_the_plan_exactly_once(metadata, pieces):
    plan = plan_export(metadata, max_shard_size="16KB")
    counts = element_counts(plan, pieces)
    assert counts.tolist() == [math.prod(plan.tensors[k].shape) for k in plan.tensors]
    check_coverage(plan, counts)


def test_a_doubled_writer_is_named_with_expected_and_actual(metadata, pieces):
    """Two ranks both primary for the same tensor: the counts summed over ranks exceed its size."""
    plan = plan_export(metadata, max_shard_size="16KB")
    counts = element_counts(plan, pieces)
    first = list(plan.tensors)[0]
    doubled = counts.clone()
    doubled[0] *= 2
    with pytest.raises(InputError) as info:
        check_coverage(plan, doubled)
    numel = math.prod(plan.tensors[first].shape)
    assert info.value.key == first and info.value.problem == "1 tensors would not be written exactly once"
    assert info.value.expected == f"{numel} elements with one writer each"
    assert info.value.actual == f"{2 * numel} written by primaries across ranks"


def test_missing_pieces_and_secondaries_are_not_coverage(metadata, pieces):
    plan = plan_export(metadata, max_shard_size="16KB")
    keys = list(plan.tensors)
    dropped = [p for p in pieces if p.key != keys[3]]
    secondary = [HFShard(p.key, p.global_shape, p.offsets, p.tensor, False, p.source_key, p.expert)
                 for p in pieces if p.key == keys[3]]
    with pytest.raises(InputError) as info:
        check_coverage(plan, element_counts(plan, dropped + secondary))
    assert info.value.key == keys[3] and info.value.actual == "0 written by primaries across ranks"


def test_a_piece_outside_the_plan_is_refused(metadata, pieces):
    plan = plan_export({k: v for k, v in metadata.items() if k != "model.norm.weight"})
    with pytest.raises(InputError, match="a piece has no place in the export plan") as info:
        element_counts(plan, pieces)
    assert info.value.key == "model.norm.weight"


def test_dtypes_without_an_encoding_are_refused_by_key():
    with pytest.raises(InputError, match="dtype has no safetensors encoding") as info:
        plan_export({"a": TensorMeta((2,), torch.float32), "b": TensorMeta((2,), torch.complex128)})
    assert info.value.key == "b"


def test_every_format_dtype_with_a_torch_dtype_can_be_planned():
    from nemo_moe_export.safetensors_format import DTYPES

    metas = {d.name: TensorMeta((3, 2), d.torch) for d in DTYPES if d.torch is not None}
    plan = plan_export(metas, dtype=torch.bfloat16)
    for d in DTYPES:
        if d.torch is not None:
            cast = d.torch.is_floating_point
            assert plan.tensors[d.name].dtype == (torch.bfloat16 if cast else d.torch), d.name
