"""Training-file identity (data/identity.py), what checkpoints compare on resume: every byte of every
training file counts, and the CRC kept for a large file (data/local_cache.py) is never that of other
content."""
import os
import time

import ml_collections
import numpy as np
import pytest

from scone_jax.data import identity, local_cache, shards


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(local_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(local_cache, "_crcs", {})


def _cfg(source: str, files: str):
    return ml_collections.ConfigDict(dict(source=source, train_files=files))


def _edit_middle(path: str) -> None:
    """One byte in the middle changed, size kept, modification time restored."""
    before = os.stat(path)
    time.sleep(0.02)  # past the file system's timestamp tick
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _tokens(n_docs: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 8000, 600, dtype=np.int32) for _ in range(n_docs)]


@pytest.mark.parametrize("kind", ["text", "shard with sidecars", "shard without sidecars"])
def test_a_change_in_the_middle_of_a_large_file_is_seen_like_one_at_its_ends(tmp_path, kind):
    """Files of 3-7 MiB, past the 1 MiB at each end the old identity read of a shard without sidecars.
    Before: a shard with sidecars was known by its sidecar alone, one without by its first and last MiB,
    so a shard rewritten in the middle resumed on other data. Caught: the sidecar's CRC as a shard's
    content again; the first and last MiB only (the `limit` of the old _file_crc)."""
    if kind == "text":
        path, source = str(tmp_path / "big.txt"), "text"
        with open(path, "w") as f:
            f.writelines(f"line {i} of a large corpus\n" for i in range(150_000))
    else:
        path, source = str(tmp_path / "big.arrayrecord"), "arrayrecord"
        shards.write_shard(path, _tokens(3000, 0), {"tokenizer_fingerprint": "t"})
        if kind == "shard without sidecars":
            os.remove(shards.meta_path(path))
            os.remove(shards.lengths_path(path))
    assert os.path.getsize(path) > 3 << 20
    before = identity.train_data_identity(_cfg(source, path))
    _edit_middle(path)
    changes = identity.identity_changes(before, identity.train_data_identity(_cfg(source, path)))
    assert changes == [f"{path} changed (same size, content {before[path][1]} -> {local_cache.read_crc(path)})"]


def test_a_large_files_crc_is_read_once_and_never_reused_for_other_content(tmp_path, monkeypatch):
    """The kept CRC serves a new process without reading the file; a copy over the file (cp -p: same size,
    mtime restored) or a rename onto it (rsync -a) is read again. Caught: the kept CRC never looked up
    (the file read at every start); its key of path, size and st_mtime_ns only (the old CRC comes back)."""
    monkeypatch.setattr(local_cache, "MEMO_MIN_BYTES", 1)
    monkeypatch.setattr(local_cache, "RACY_NS", 0)
    path = str(tmp_path / "corpus.txt")
    with open(path, "w") as f:
        f.write("first version\n" * 1000)
    first = local_cache.file_id(path)
    assert len(os.listdir(tmp_path / "cache")) == 1

    monkeypatch.setattr(local_cache, "_crcs", {})  # a new process: the kept CRC, no read
    reads = []
    real_read = local_cache.read_crc
    monkeypatch.setattr(local_cache, "read_crc", lambda p: reads.append(p) or real_read(p))
    assert local_cache.file_id(path) == first and reads == []

    _edit_middle(path)  # cp -p
    monkeypatch.setattr(local_cache, "_crcs", {})
    assert local_cache.file_id(path) == (first[0], real_read(path)) != first
    other = str(tmp_path / "incoming.txt")  # rsync -a: another file renamed onto it
    stat = os.stat(path)
    with open(other, "w") as f:
        f.write("other version\n" * 1000)
    assert os.path.getsize(other) == stat.st_size
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, path)
    monkeypatch.setattr(local_cache, "_crcs", {})
    assert local_cache.file_id(path) == (stat.st_size, real_read(path))
    assert reads == [path, path]


def test_the_crc_of_a_file_changed_just_now_is_not_kept(tmp_path, monkeypatch):
    """A second write within the same timestamp tick would keep every time the same, so a file changed
    within RACY_NS of the read is read again next time. Caught: the age check removed (a CRC is kept)."""
    monkeypatch.setattr(local_cache, "MEMO_MIN_BYTES", 1)
    path = str(tmp_path / "fresh.txt")
    with open(path, "w") as f:
        f.write("written just now\n")
    local_cache.file_id(path)
    assert local_cache._crcs == {} and os.listdir(tmp_path / "cache") == []
