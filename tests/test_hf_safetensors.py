"""scone_jax/hf/safetensors.py against the safetensors library (the format's reference implementation): files it
writes read back equal here, files written here load equal there (bf16 included), blocks read only their bytes,
and every kind of damage is one line naming the file.

Deliberate bugs these tests were run against once (each made the named test fail):
  - the file-size check dropped (test_damaged_files_are_one_line_naming_the_file[truncated]);
  - the pread of a row block starting at the tensor's first row, not the block's
    (test_blocks_read_exactly_their_bytes);
  - write_sharded putting every tensor in the first shard's index entry
    (test_sharded_files_load_with_the_library).
"""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from scone_jax.hf import safetensors as st


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.normal(size=(6, 5)).astype(np.float32),
            "b.bias": rng.normal(size=(7,)).astype(np.float32),
            "c.ids": rng.integers(-9, 9, size=(2, 3, 4)).astype(np.int64),
            "d.empty": np.zeros((0, 3), np.float32),
            "e.scalar": np.array(3.5, np.float32)}


def write_ours(path, arrays, metadata=None):
    specs = [(name, a.dtype, a.shape) for name, a in arrays.items()]
    return st.write_file(str(path), specs, lambda name: arrays[name], metadata)


def test_library_files_read_back_equal(tmp_path):
    arrays = tensors()
    path = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})
    f = st.SafetensorsFile(str(path))
    assert f.metadata == {"format": "pt"} and set(f.tensors) == set(arrays)
    for name, want in arrays.items():
        got = f.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_our_files_load_with_the_library_bf16_included(tmp_path):
    arrays = tensors()
    bf16 = np.random.default_rng(1).normal(size=(4, 3)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "ours.safetensors"
    written = write_ours(path, {**arrays, "f.bf16": bf16}, {"format": "pt"})
    assert written == sum(a.nbytes for a in arrays.values()) + bf16.nbytes
    loaded = safetensors.torch.load_file(str(path))
    assert loaded["f.bf16"].dtype == torch.bfloat16
    np.testing.assert_array_equal(loaded["f.bf16"].view(torch.int16).numpy(), bf16.view(np.int16))
    for name, want in arrays.items():
        np.testing.assert_array_equal(loaded[name].numpy(), want)
    with open(path, "rb") as f:  # the header is padded to 8 bytes, as the library pads it
        assert int.from_bytes(f.read(8), "little") % 8 == 0
    np.testing.assert_array_equal(st.SafetensorsFile(str(path)).read("f.bf16").view(np.int16), bf16.view(np.int16))


def test_blocks_read_exactly_their_bytes(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    arrays = {"pad": np.ones(13, np.float32), "m": rng.normal(size=(40, 24)).astype(ml_dtypes.bfloat16),
              "v": rng.normal(size=(50,)).astype(np.float32)}
    path = tmp_path / "blocks.safetensors"
    write_ours(path, arrays)
    f = st.SafetensorsFile(str(path))
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: reads.append(sum(len(b) for b in buffers))
                        or real_preadv(fd, buffers, offset))
    np.testing.assert_array_equal(f.read("m", (slice(10, 17),)), arrays["m"][10:17])
    assert reads == [7 * 24 * 2]  # the rows asked for, nothing else
    np.testing.assert_array_equal(f.read("v", (slice(5, 45),)), arrays["v"][5:45])
    np.testing.assert_array_equal(f.read("m", (slice(3, 9), slice(8, 16))), arrays["m"][3:9, 8:16])  # memory map
    np.testing.assert_array_equal(f.read("m", (slice(None), slice(0, 24))), arrays["m"])
    with pytest.raises(st.SafetensorsError, match="not a range inside tensor m"):
        f.read("m", (slice(0, 41),))
    with pytest.raises(st.SafetensorsError, match="has no tensor"):
        f.read("nope")


def _damage(raw: bytes, kind: str) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]

    def rebuild(h, tail=data):
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + tail

    if kind == "truncated":
        return raw[:-5]
    if kind == "trailing bytes":
        return raw + b"\0" * 4
    if kind == "short":
        return raw[:5]
    if kind == "header length past the end":
        return (len(raw) + 10).to_bytes(8, "little") + raw[8:]
    if kind == "not json":
        return raw[:8] + b"{" * n + data
    if kind == "unknown dtype":
        header["a.weight"]["dtype"] = "Q7"
    if kind == "span disagrees with shape":
        header["a.weight"]["shape"] = [6, 4]
    if kind == "overlap":
        header["b.bias"]["data_offsets"] = [0, 28]
    if kind == "negative size":
        header["a.weight"]["shape"] = [-6, 5]
    return rebuild(header)


@pytest.mark.parametrize("kind", ["truncated", "trailing bytes", "short", "header length past the end", "not json",
                                  "unknown dtype", "span disagrees with shape", "overlap", "negative size"])
def test_damaged_files_are_one_line_naming_the_file(tmp_path, kind):
    good = tmp_path / "good.safetensors"
    write_ours(good, {"a.weight": np.zeros((6, 5), np.float32), "b.bias": np.zeros(7, np.float32)})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_damage(good.read_bytes(), kind))
    with pytest.raises(st.SafetensorsError) as e:
        st.SafetensorsFile(str(bad))
    text = str(e.value)
    assert "\n" not in text and str(bad) in text and "Fix:" in text, text
    if kind in ("unknown dtype", "span disagrees with shape", "negative size"):
        assert "a.weight" in text


def test_sharded_files_load_with_the_library(tmp_path):
    arrays = {f"t{i}": np.full((10, 10), i, np.float32) for i in range(5)}  # 400 bytes each
    specs = [(name, a.dtype, a.shape) for name, a in arrays.items()]
    produced = []
    names = st.write_sharded(str(tmp_path), specs, lambda n: produced.append(n) or arrays[n], max_shard_bytes=900)
    assert produced == list(arrays)  # one at a time, in order
    assert names == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] + [st.INDEX]
    index = json.loads((tmp_path / st.INDEX).read_text())
    assert index["metadata"]["total_size"] == 2000
    assert index["weight_map"] == {"t0": names[0], "t1": names[0], "t2": names[1], "t3": names[1], "t4": names[2]}
    for name, file in index["weight_map"].items():
        np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / file))[name], arrays[name])
    single = tmp_path / "single"
    single.mkdir()
    assert st.write_sharded(str(single), specs, arrays.__getitem__, max_shard_bytes=2000) == [st.SINGLE]


def test_a_write_that_fails_leaves_no_file(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="was produced as"):
        st.write_file(str(path), [("a", np.dtype(np.float32), (2,))], lambda n: np.zeros(3, np.float32))
    assert os.listdir(tmp_path) == []
