"""Malformed checkpoint files: ``verify`` reports each as a line naming the file, ``from_hf`` refuses
each with an InputError naming the file and what is wrong, and neither raises anything else.

Each broken file is first shown to be refused by the safetensors library itself (the independent
reference), so the cases are malformed by the format's rules, not by ours. The base checkpoint is
written by transformers' ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors import safe_open

from nemo_moe_export.adapters import get_adapter
from nemo_moe_export.errors import InputError
from nemo_moe_export.export import verify_checkpoint
from nemo_moe_export.safetensors_format import INDEX_FILE, MAX_HEADER_BYTES
from nemo_moe_export.tiny_models import tiny_model

KEY = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3", n_experts=4)


@pytest.fixture(scope="module")
def base(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "ckpt"
    model.save_pretrained(path, max_shard_size="40KB")
    return path


def _copy(base, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(base, dst)
    weight_map = json.loads((dst / INDEX_FILE).read_text())["weight_map"]
    return dst, dst / weight_map[KEY]


def _header(file):
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(file, header_bytes, data):
    file.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)


def _edit(edit):
    """A mutation that rewrites the header JSON after ``edit(header)``, padded as the format says."""
    def mutate(file):
        header, data = _header(file)
        edit(header)
        raw = json.dumps(header).encode()
        _write(file, raw + b" " * (-len(raw) % 8), data)
    return mutate


def _raw_header(payload):
    return lambda file: _write(file, payload, _header(file)[1])


def _set(field, value):
    return _edit(lambda h: h[KEY].__setitem__(field, value(h[KEY]) if callable(value) else value))


def _overlap(header):
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    start, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [start - 4, end - 4]


def _replace_by(make):
    def mutate(file):
        file.unlink()
        make(file)
    return mutate


def _huge_header(file):
    header, data = _header(file)
    raw = json.dumps(header).encode()
    size = MAX_HEADER_BYTES + 8  # valid JSON, padded past the library's limit
    with open(file, "wb") as f:
        f.write(size.to_bytes(8, "little"))
        f.write(raw)
        f.write(b" " * (size - len(raw)))
        f.write(data)


# name -> (mutation of the file holding KEY, what the report line and the error say)
FILE_CASES = {
    "truncated-data": (lambda f: os.truncate(f, f.stat().st_size - 10), "truncated"),
    "truncated-header": (lambda f: os.truncate(f, 30), "header length exceeds the file"),
    "four-byte-file": (lambda f: f.write_bytes(b"\x01\x02\x03\x04"), "too short for a safetensors header"),
    "length-beyond-file": (lambda f: f.write_bytes((10**6).to_bytes(8, "little") + f.read_bytes()[8:]),
                           "header length exceeds the file"),
    "garbage-header-json": (_raw_header(b"{not json!!     "), "header is not valid JSON"),
    "header-is-an-array": (_raw_header(b"[1, 2, 3]       "), "header is not a JSON object"),
    "header-not-utf8": (_raw_header(b'{"\xff": 1}     '), "header is not valid JSON"),
    "header-with-bom": (lambda f: _write(f, b"\xef\xbb\xbf" + json.dumps(_header(f)[0]).encode() + b"     ",
                                         _header(f)[1]), "header is not valid JSON"),
    "header-over-100MB": (_huge_header, "header is larger than safetensors allows"),
    "entry-not-an-object": (_edit(lambda h: h.__setitem__(KEY, [1, 2])), f"key '{KEY}' has a malformed entry"),
    "shape-of-strings": (_set("shape", ["a", "b"]), f"key '{KEY}' has a malformed entry"),
    "shape-of-booleans": (_set("shape", lambda e: [True] * len(e["shape"])), f"key '{KEY}' has a malformed entry"),
    "bogus-dtype": (_set("dtype", "F17"), f"key '{KEY}' has a malformed entry"),
    "offsets-out-of-bounds": (_set("data_offsets", lambda e: [e["data_offsets"][0], 10**9]), f"key '{KEY}' spans"),
    "offsets-reversed": (_set("data_offsets", lambda e: e["data_offsets"][::-1]), f"key '{KEY}' spans"),
    "offsets-overlap": (_edit(_overlap), "overlaps the previous tensor"),
    "metadata-not-strings": (_edit(lambda h: h.__setitem__("__metadata__", {"format": 1})),
                             "__metadata__ is not an object of strings"),
    "directory-named-safetensors": (_replace_by(lambda f: f.mkdir()), "is a directory"),
    "dangling-symlink": (_replace_by(lambda f: f.symlink_to(f.parent / "gone.safetensors")),
                         "symbolic link to a missing file"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_malformed_file_is_a_report_line_and_a_named_error(case, base, model, tmp_path):
    path, file = _copy(base, tmp_path)
    mutate, says = FILE_CASES[case]
    mutate(file)
    try:
        with pytest.raises(Exception):  # the independent reference: the library refuses the file too
            with safe_open(str(file), framework="pt") as f:
                [f.get_slice(k) for k in f.keys()]
        report = verify_checkpoint(path)
        lines = [p for p in report.problems if p.startswith(f"{file.name}: ")]
        assert not report.ok and any(says in p for p in lines), report.summary()
        with pytest.raises(InputError) as info:
            get_adapter(model.config).from_hf(model.state_dict(), path)
        assert info.value.key == str(file) and says in str(info.value), str(info.value)
    finally:
        if file.is_file() and not file.is_symlink():
            file.unlink()  # the 100 MB header file does not linger in the temp dir


# A garbage index, an array and a "weight_map" array were refused by name already (test_safetensors_format).
DIR_CASES = {
    "weight-map-value-not-a-file-name": (INDEX_FILE, json.dumps({"weight_map": {KEY: 5}}), "unreadable"),
    "garbage-config": ("config.json", "{garbage", "config.json"),
    "config-is-an-array": ("config.json", "[1]", "config.json"),
}


@pytest.mark.parametrize("case", sorted(DIR_CASES))
def test_malformed_index_or_config_is_a_report_line_and_a_named_error(case, base, model, tmp_path):
    path, _ = _copy(base, tmp_path)
    name, text, says = DIR_CASES[case]
    (path / name).write_text(text)
    report = verify_checkpoint(path)
    assert not report.ok and any(p.startswith(name) and says in p for p in report.problems), report.summary()
    with pytest.raises(InputError) as info:
        get_adapter(model.config).from_hf(model.state_dict(), path)
    assert info.value.key == str(path / name) and says in str(info.value)


def test_verify_cli_reports_a_broken_file_without_a_traceback(base, tmp_path):
    path, file = _copy(base, tmp_path)
    file.unlink()
    file.mkdir()
    proc = subprocess.run([sys.executable, "-m", "nemo_moe_export", "verify", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and f"{file.name}: is a directory" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
