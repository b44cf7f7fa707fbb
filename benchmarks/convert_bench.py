"""Convert a torchtitan DCP checkpoint to HF: ours on N ranks against the routes a user would pick.

    python benchmarks/convert_bench.py --size-gb 1 --ranks 1,2,4 --work /tmp/convert_bench [--out R.json]

One run, one checkpoint, side by side (docs/convert.md#benchmark):

* ``ours``           ``convert_checkpoint`` on N ranks (no model; positioned reads, each byte once);
* ``whole``          torchtitan's ``convert_to_hf.py`` route rebuilt from the wheel: the model built
                     in one process (float32), ``dcp.load`` of the whole state dict, the adapter's
                     ``to_hf``, cast, DCP's ``HuggingFaceStorageWriter`` with consolidation (sharded
                     files, then consolidated ones: every byte written twice);
* ``per_key``        torchtitan's ``convert_to_hf_incremental.py`` route: one ``dcp.load`` per key
                     (a planning pass and a read each), tensors held until an output file is whole,
                     the file layout taken from an existing HF index (ours, for the same files);
* ``dcp_consolidate`` torch's own consolidation of HF-keyed safetensors shards
                     (``consolidate_safetensors_files`` of ``torch.distributed.checkpoint``, our
                     file layout, the threads ``whole`` gives it): the same weights saved as
                     AutoModel's ``model_save_format: safetensors`` saves them (DCP's
                     ``HuggingFaceStorageWriter``, ``save_distributed``, ``Shard(0)`` on 4 ranks),
                     then consolidated. It copies the stored bytes and cannot cast, so it writes
                     float32 (its row says so). It applies only to the HF-keyed source: a torchtitan
                     checkpoint holds no HF-keyed safetensors shards, and the same consolidation
                     already runs inside ``whole``, so its row there is marked skipped;
* ``model_export``   the checkpoint loaded into the model, then our in-job export: the transformers
                     model built from the HF config on CPU (float32), ``dcp.load`` of the HF-keyed
                     state dict (for torchtitan's checkpoint its model's, then the adapter's
                     ``to_hf``, as ``whole`` does), the project's adapter's ``from_hf`` into the
                     model, then ``export_hf_checkpoint`` on 1 rank in bf16;
* ``disk``           the disk's own cost for the same bytes: the model's stored bytes read
                     sequentially, the HF checkpoint's bytes written and fsynced.

The checkpoint is written by torchtitan's own model (Qwen3 MoE, float32 as torchtitan trains) under
``fully_shard`` on 4 gloo ranks, ``dcp.save`` of its state dict (no optimizer: the routes above read
only the model's keys). Where torchtitan does not import (its 0.3.0 needs torch 2.13's
``DataParallelMeshDims``; ``--source hf``), the same model's HF-keyed state dict is saved instead,
``Shard(0)`` DTensors on 4 ranks as AutoModel saves it, and the two routes run without the adapter
(its ``to_hf`` renames and splits views: no I/O). Before each run the source's pages are dropped
from the page cache (``posix_fadvise(DONTNEED)`` after ``sync``), so every route reads from the
disk. Per route: seconds (wall time of the route's processes), bytes read and written
(``/proc/<pid>/io`` ``rchar`` / ``wchar``, every rank summed), peak RSS per rank (``VmHWM``), and
``output_check``: each route's ``.safetensors`` files hold the keys, shapes and dtypes of ours
(headers only). torchtitan 0.3.0 is imported from ``$NEMO_MOE_EXPORT_TORCHTITAN_PATH`` (the
folder ``make setup-torchtitan`` fills, as the tests find it) or from ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(os.environ.get("NEMO_MOE_EXPORT_TORCHTITAN_PATH", ""), "torchtitan")):
    sys.path.append(os.environ["NEMO_MOE_EXPORT_TORCHTITAN_PATH"])  # the route processes import this module too
from export_methods import status_mib  # noqa: E402
from output import emit  # noqa: E402

SAVE_WORLD = 4
CONSOLIDATION_THREADS = 5  # torchtitan's convert_to_hf.py gives DCP's consolidation 5 threads
ROUTES = ("whole", "per_key", "dcp_consolidate", "model_export", "disk")
BASELINES = ("ours", "disk")  # every other route is an alternative a user would pick
VOCAB, DIM, EXPERTS, MOE_HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32000, 1024, 32, 512, 16, 4, 64


def _layers_for(size_gb: float) -> int:
    """Decoder layers so the float32 model has about ``size_gb`` GB."""
    per_layer = EXPERTS * 3 * DIM * MOE_HIDDEN + DIM * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + EXPERTS * DIM
    return max(1, round((size_gb * 1e9 / 4 - 2 * VOCAB * DIM) / per_layer))


def _model_config(layers: int):
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            moe_hidden_dim=MOE_HIDDEN, num_experts=EXPERTS, top_k=2, attn_backend="flex",
            moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=1e6)))


def _hf_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                          moe_intermediate_size=MOE_HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS,
                          num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                          max_position_embeddings=64, rope_theta=1e6)


# ---- per-process measurement -------------------------------------------------------------------

def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _measured(body) -> dict:
    """Run ``body()`` in this process; its seconds, bytes read / written, RSS before it and peak RSS."""
    baseline = status_mib("VmRSS")
    before, started = _io(), time.perf_counter()
    body()
    after = _io()
    return dict(seconds=time.perf_counter() - started, read=after["rchar"] - before["rchar"],
                written=after["wchar"] - before["wchar"], baseline_rss_mib=round(baseline, 1),
                peak_rss_mib=round(status_mib("VmHWM"), 1))


def _ranks(world: int, target, *args) -> list[dict]:
    """``target(rank, world, *args) -> dict`` on ``world`` forked gloo ranks; their results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results")
        os.makedirs(results)
        mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), results, target, args),
                           nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(world)]


def _rank_main(rank: int, world: int, store: str, results: str, target, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = target(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(result, f)


# ---- the checkpoint ----------------------------------------------------------------------------

def _save_rank(rank: int, world: int, directory: str, layers: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _model_config(layers).build()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    dcp.save(model.state_dict(), checkpoint_id=directory)
    return {}


def _hf_state_dict(rank: int, world: int, layers: int) -> dict:
    """Every HF tensor of the model as a DTensor, ``Shard(0)`` over the ranks (``torch.chunk``'s
    rows), as AutoModel holds them; the same values for the same rank whichever format saves them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from nemo_moe_export.convert.checks import expected_metadata

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank)
    state = {}
    for key, meta in expected_metadata(_hf_config(layers)).items():
        rows = torch.empty(meta.shape[0], device="meta").chunk(world)
        local = (rows[rank].shape[0] if rank < len(rows) else 0, *meta.shape[1:])
        state[key] = DTensor.from_local(torch.empty(local).normal_(0, 0.02), mesh, [Shard(0)],
                                        shape=torch.Size(meta.shape), stride=torch.empty(meta.shape, device="meta").stride())
    return state


def _save_hf_rank(rank: int, world: int, directory: str, layers: int) -> dict:
    """The HF-keyed checkpoint AutoModel saves with ``model_save_format: torch_save`` (DCP's files)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_hf_state_dict(rank, world, layers), checkpoint_id=directory)
    return {}


def _save_hf_shards_rank(rank: int, world: int, directory: str, layers: int) -> dict:
    """The same weights as AutoModel saves them with ``model_save_format: safetensors`` unconsolidated:
    DCP's HF writer, every rank its own safetensors shard (the input of DCP's consolidation)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(_hf_state_dict(rank, world, layers),
             storage_writer=HuggingFaceStorageWriter(path=directory, save_distributed=True))
    return {}


def torchtitan_importable() -> bool:
    try:
        import torchtitan.models.qwen3  # noqa: F401
    except Exception:  # noqa: BLE001 - any reason: the routes say which source they ran on
        return False
    return True


def make_checkpoint(work: str, size_gb: float, source: str) -> tuple[str, str, int]:
    """The checkpoint of about ``size_gb`` GB (cached in ``work``) and its HF config: torchtitan's
    own model saved (``source="torchtitan"``) or the HF-keyed one (``"hf"``)."""
    layers = _layers_for(size_gb)
    root = os.path.join(work, f"{source}_{size_gb:g}gb")
    src, config = os.path.join(root, "dcp"), os.path.join(root, "hf_config")
    if not os.path.exists(os.path.join(src, ".metadata")):
        shutil.rmtree(root, ignore_errors=True)
        _ranks(SAVE_WORLD, _save_rank if source == "torchtitan" else _save_hf_rank, src, layers)
        _hf_config(layers).save_pretrained(config)
    return src, config, layers


def make_hf_shards(src: str, layers: int) -> str:
    """The HF-keyed checkpoint's weights as safetensors shards beside it (cached): ``dcp_consolidate``'s input."""
    shards = os.path.join(os.path.dirname(src), "hf_shards")
    done = os.path.join(shards, ".complete")
    if not os.path.exists(done):
        shutil.rmtree(shards, ignore_errors=True)
        _ranks(SAVE_WORLD, _save_hf_shards_rank, shards, layers)
        open(done, "w").close()
    return shards


# ---- the routes --------------------------------------------------------------------------------

def _ours_rank(rank: int, world: int, src: str, out: str, config: str, max_shard_size: str) -> dict:
    import torch.distributed as dist

    from nemo_moe_export.convert.engine import convert_checkpoint

    result = {}
    dist.barrier()  # every rank imported: the time is the conversion's, not the slowest import's

    def run() -> None:
        result["convert"] = convert_checkpoint(src, out, config=config, dtype="bfloat16", progress_s=None,
                                               max_shard_size=max_shard_size).__dict__

    measured = _measured(run)
    done = result["convert"]
    return {**measured, **{k: done[k] for k in ("rank_bytes_read", "rank_bytes_written", "source_bytes",
                                                "checkpoint_bytes", "step_seconds", "io")}}


def _adapter(layers: int, assets: str, source: str):
    """(the state dict to load into, to_hf, the HF file of each key): torchtitan's model and adapter,
    or, for the HF-keyed checkpoint, empty tensors from the metadata and no renaming."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    mapping = json.load(open(os.path.join(assets, "model.safetensors.index.json")))["weight_map"]
    fqn_to_index = {k: int(v.split("-")[1]) for k, v in mapping.items()}
    if source == "torchtitan":
        from torchtitan.components.checkpointer.base import ModelWrapper
        from torchtitan.models.qwen3 import Qwen3StateDictAdapter

        config = _model_config(layers)
        adapter = Qwen3StateDictAdapter(config, assets)
        return (lambda src: ModelWrapper(config.build())._get_state_dict()), adapter.to_hf, fqn_to_index

    def empty(src: str) -> dict:
        metadata = FileSystemReader(src).read_metadata()
        return {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}

    return empty, (lambda state: state), fqn_to_index


def _loaded_hf(src: str, layers: int, assets: str, source: str) -> tuple[dict, dict]:
    """(the whole checkpoint loaded in this process and keyed by HF names, the HF file of each key):
    the state dict to load into, ``dcp.load`` of all of it, ``to_hf``."""
    import torch.distributed.checkpoint as dcp

    template, to_hf, fqn_to_index = _adapter(layers, assets, source)
    state_dict = template(src)
    dcp.load(state_dict, checkpoint_id=src, no_dist=True)
    return to_hf(state_dict), fqn_to_index


def _whole(src: str, out: str, layers: int, assets: str, source: str) -> dict:
    """torchtitan's convert_to_hf.py, as the wheel's parts allow (the script is not in the wheel):
    the whole state dict loaded in one process, ``to_hf``, cast, DCP's HF writer with consolidation."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    def run() -> None:
        with torch.inference_mode():
            loaded, fqn_to_index = _loaded_hf(src, layers, assets, source)
            hf = {k: v.to(torch.bfloat16) for k, v in loaded.items()}
            dcp.save(hf, storage_writer=HuggingFaceStorageWriter(
                path=out, save_distributed=True, fqn_to_index_mapping=fqn_to_index,
                enable_consolidation=True, thread_count_consolidation=CONSOLIDATION_THREADS), no_dist=True)

    return _measured(run)


def _dcp_consolidate(shards: str, out: str, assets: str) -> dict:
    """torch's own consolidation of HF-keyed safetensors shards into our file layout (it copies the
    stored bytes: no cast, so float32 out)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    def run() -> None:
        mapping = json.load(open(os.path.join(assets, "model.safetensors.index.json")))["weight_map"]
        os.makedirs(out, exist_ok=True)  # it writes into the folder, not creating it
        consolidate_safetensors_files(shards, out, {k: int(v.split("-")[1]) for k, v in mapping.items()},
                                      num_threads=CONSOLIDATION_THREADS)

    return _measured(run)


def _model_export_rank(rank: int, world: int, src: str, out: str, layers: int, assets: str, source: str,
                       config: str, max_shard_size: str) -> dict:
    """The checkpoint loaded into the transformers model (``dcp.load``, ``to_hf`` where torchtitan's,
    the adapter's ``from_hf``), then ``export_hf_checkpoint`` in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_moe_export.adapters import get_adapter
    from nemo_moe_export.export.step import export_hf_checkpoint

    def run() -> None:
        hf_config = AutoConfig.from_pretrained(config)
        with torch.device("meta"):  # the weights come from the checkpoint: no initialisation
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.to_empty(device="cpu")
        with torch.no_grad():
            loaded, _ = _loaded_hf(src, layers, assets, source)
            get_adapter(hf_config).from_hf(model.state_dict(), loaded)
            del loaded
        export_hf_checkpoint(out, model, dtype="bfloat16", max_shard_size=max_shard_size)

    return _measured(run)


def _per_key(src: str, out: str, layers: int, assets: str, source: str) -> dict:
    """torchtitan's convert_to_hf_incremental.py: one dcp.load per key, files written when whole."""
    from collections import defaultdict

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    def run() -> None:
        with torch.inference_mode():
            _, to_hf, _ = _adapter(layers, assets, source)
            metadata = FileSystemReader(src).read_metadata()
            weight_map = json.load(open(os.path.join(assets, "model.safetensors.index.json")))["weight_map"]
            files = defaultdict(list)
            for key, name in weight_map.items():
                files[name].append(key)
            os.makedirs(out, exist_ok=True)
            held: dict = {}
            for key, meta in sorted(metadata.state_dict_metadata.items()):
                one = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
                dcp.load(one, checkpoint_id=src, no_dist=True)
                held.update({k: v.to(torch.bfloat16) for k, v in to_hf(one).items()})
                for name in [n for n, keys in files.items() if all(k in held for k in keys)]:
                    save_file({k: held.pop(k).contiguous() for k in files.pop(name)}, os.path.join(out, name))

    return _measured(run)


def _disk(src: str, out: str, write_bytes: int) -> dict:
    """The disk's own cost: the source's files read sequentially, ``write_bytes`` written and fsynced."""
    block = 64 << 20

    def run() -> None:
        for name in sorted(os.listdir(src)):
            with open(os.path.join(src, name), "rb", buffering=0) as f:
                while f.read(block):
                    pass
        os.makedirs(out, exist_ok=True)
        data, left = bytearray(os.urandom(1 << 20)) * 64, write_bytes
        fd = os.open(os.path.join(out, "bytes"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while left > 0:
                left -= os.write(fd, memoryview(data)[:min(left, block)])
            os.fsync(fd)
        finally:
            os.close(fd)

    return _measured(run)


# ---- running a route in a fresh process ---------------------------------------------------------

def _drop_cache(path: str) -> None:
    """Evict ``path``'s files from the page cache (clean pages: no root needed) so reads hit the disk."""
    subprocess.run(["sync"], check=False)
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _in_child(route: str, args: dict) -> dict:
    """Run one route in a fresh interpreter (its own peak RSS, imports not counted twice)."""
    out = args["out"]
    shutil.rmtree(out, ignore_errors=True)
    _drop_cache(os.path.dirname(args["src"]))  # the source and the HF-keyed shards beside it
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", route, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return dict(route=route, error=proc.stderr[-2000:])
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    row = _summary(route, ranks, wall, out)
    print(json.dumps(row), file=sys.stderr, flush=True)  # as each route ends: a long run shows what it has
    return row


def _summary(route: str, ranks: list[dict], wall: float, out: str) -> dict:
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs)
    return dict(route=route, ranks=len(ranks), seconds=round(max(r["seconds"] for r in ranks), 2),
                process_wall_s=round(wall, 2), bytes_read=sum(r["read"] for r in ranks),
                bytes_written=sum(r["written"] for r in ranks), output_bytes=on_disk,
                peak_rss_mib_per_rank=[r["peak_rss_mib"] for r in ranks],
                baseline_rss_mib_per_rank=[r["baseline_rss_mib"] for r in ranks],
                **{k: ranks[0][k] for k in ("source_bytes", "checkpoint_bytes") if k in ranks[0]},
                **({"slowest_rank_steps": max(ranks, key=lambda r: r["seconds"])["step_seconds"],
                    "read_seconds_per_rank": [r["io"].get("read_seconds") for r in ranks]} if "io" in ranks[0] else {}))


def _child(route: str, args: dict) -> None:
    if route == "ours":
        ranks = _ranks(args["world"], _ours_rank, args["src"], args["out"], args["config"], args["max_shard_size"])
    elif route == "whole":
        ranks = [_whole(args["src"], args["out"], args["layers"], args["assets"], args["source"])]
    elif route == "per_key":
        ranks = [_per_key(args["src"], args["out"], args["layers"], args["assets"], args["source"])]
    elif route == "dcp_consolidate":
        ranks = [_dcp_consolidate(args["src"], args["out"], args["assets"])]
    elif route == "model_export":
        ranks = _ranks(1, _model_export_rank, args["src"], args["out"], args["layers"], args["assets"],
                       args["source"], args["config"], args["max_shard_size"])
    elif route == "disk":
        ranks = [_disk(args["src"], args["out"], args["write_bytes"])]
    else:
        raise SystemExit(f"unknown route {route!r}: one of ours, {', '.join(ROUTES)}")
    print(json.dumps(ranks))


def run_size(work: str, size_gb: float, worlds: list[int], routes: list[str], source: str,
             max_shard_size: str) -> dict:
    src, config, layers = make_checkpoint(work, size_gb, source)
    source_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    rows = []
    for world in worlds:  # ours first: its index.json is the file layout the per-key route needs
        out = os.path.join(work, f"ours_{world}")
        rows.append(_in_child("ours", dict(world=world, src=src, out=out, config=config,
                                           max_shard_size=max_shard_size)))
        if world != worlds[0]:
            shutil.rmtree(out, ignore_errors=True)
    assets = os.path.join(work, f"ours_{worlds[0]}")
    written = rows[0].get("checkpoint_bytes", 0)
    for route in routes:
        rows.append(_route_row(route, dict(
            src=src, out=os.path.join(work, route), layers=layers, assets=assets, write_bytes=written,
            source=source, config=config, max_shard_size=max_shard_size)))
    shutil.rmtree(assets, ignore_errors=True)
    return dict(size_gb=size_gb, source=source, layers=layers, max_shard_size=max_shard_size, checkpoint_dir_bytes=source_bytes, routes=_ratios(rows))


def _route_row(route: str, args: dict) -> dict:
    """One alternative route run in its own process, its output checked against ours, then removed."""
    if route == "dcp_consolidate":
        if args["source"] != "hf":
            return dict(route=route, skipped="DCP's consolidation takes HF-keyed safetensors shards; a torchtitan "
                                             "checkpoint has none (the same consolidation runs inside 'whole')")
        args["src"] = make_hf_shards(args["src"], args["layers"])
    row = _in_child(route, args)
    if route != "disk" and "seconds" in row:
        row["output_check"] = output_check(args["out"], args["assets"])
        if route == "dcp_consolidate":
            row["note"] = "DCP's consolidation copies the stored bytes and cannot cast: it writes float32"
    shutil.rmtree(args["out"], ignore_errors=True)
    return row


def _headers(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the ``.safetensors`` files directly in ``directory``: its dtype and shape (headers only)."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    found[key] = (part.get_dtype(), tuple(part.get_shape()))
    return found


def output_check(out: str, ours: str) -> str:
    """``"same keys, shapes, dtypes as ours"``, or what differs (the files load with safetensors, or this raises)."""
    got, want = _headers(out), _headers(ours)
    if set(got) != set(want):
        return f"keys differ: {len(set(want) - set(got))} missing, {len(set(got) - set(want))} extra"
    shapes = [k for k in want if got[k][1] != want[k][1]]
    if shapes:
        return f"shapes differ: {len(shapes)} keys, e.g. {shapes[0]} {got[shapes[0]][1]} vs {want[shapes[0]][1]}"
    dtypes = sorted({f"{got[k][0]} where ours {want[k][0]}" for k in want if got[k][0] != want[k][0]})
    return f"same keys and shapes; dtypes differ: {', '.join(dtypes)}" if dtypes else "same keys, shapes, dtypes as ours"


def _ratios(rows: list[dict]) -> list[dict]:
    """Each route's speed-up against the fastest alternative, and ours against the disk's time."""
    others = [r["seconds"] for r in rows if r["route"] not in BASELINES and "seconds" in r]
    disk = next((r["seconds"] for r in rows if r["route"] == "disk" and "seconds" in r), None)
    for row in rows:
        if row["route"] == "ours" and "seconds" in row:
            if others:
                row["speedup_vs_fastest_alternative"] = round(min(others) / row["seconds"], 2)
            if disk:
                row["disk_efficiency"] = round(disk / row["seconds"], 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", default="1", help="checkpoint sizes, e.g. 1,5")
    parser.add_argument("--ranks", default="1,2,4", help="our rank counts")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"alternatives to ours, of {','.join(ROUTES)}")
    parser.add_argument("--source", choices=("auto", "torchtitan", "hf"), default="auto",
                        help="torchtitan's own model (auto: where torchtitan imports) or the HF-keyed checkpoint")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "convert_bench"))
    parser.add_argument("--max-shard-size", default="5GB", help="HF file size (every route writes our layout)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], json.loads(args.child[1]))
    os.makedirs(args.work, exist_ok=True)
    worlds = [int(w) for w in args.ranks.split(",")]
    routes = [r for r in args.routes.split(",") if r]
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        parser.error(f"unknown route(s) {unknown}: one of {','.join(ROUTES)}")
    source = args.source if args.source != "auto" else "torchtitan" if torchtitan_importable() else "hf"
    report = dict(cpus=os.cpu_count(), sizes=[run_size(args.work, float(s), worlds, routes, source, args.max_shard_size)
                                              for s in args.size_gb.split(",")])
    emit(report, args.out)


if __name__ == "__main__":
    main()
