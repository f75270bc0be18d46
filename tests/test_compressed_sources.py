"""Compressed corpora (data/compressed.py): .gz and .zst text and JSONL files give exactly the documents
of the uncompressed file, through the same random access, and a damaged archive is one line naming it.
The local block copy is the archive's current content, in a directory only this user can write, and is
built again when stale, planted or damaged; a full disk is one line and leaves nothing behind."""
import errno
import gzip
import json
import os
import pickle
import shutil
import socket
import subprocess
import time
import zlib

import ml_collections
import numpy as np
import pytest
import zstandard

from scone_jax.data import compressed, corpus, identity, local_cache, sources
from scone_jax.runtime import tool_main


def _cfg(**overrides):
    cfg = dict(source="text", train_files="", eval_files="", text_field="text", document_unit="line",
               eval_fraction=0.02)
    return ml_collections.ConfigDict({**cfg, **overrides})


def _docs(source):
    return [source[i] for i in range(len(source))]


def _compress(path, data: bytes, kind: str):
    if kind == "gzip":
        target = f"{path}.gz"
        with gzip.open(target, "wb") as f:
            f.write(data)
    else:
        target = f"{path}.zst"
        with open(target, "wb") as f:
            # two frames back to back, as `cat a.zst b.zst` makes: both are read. With content checksums, as
            # the zstd command writes them by default.
            for part in (data[:len(data) // 3], data[len(data) // 3:]):
                f.write(zstandard.ZstdCompressor(write_checksum=True).compress(part))
    return target


@pytest.fixture(autouse=True)
def _block_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCONE_JAX_BLOCK_CACHE", str(tmp_path / "block_cache"))


@pytest.fixture
def kjv_text(tmp_path):
    """KJV paragraphs as lines, with blank and whitespace-only lines and CRLFs among them."""
    docs = corpus.kjv_documents("train", 0.02)[:600]
    lines = []
    for i, doc in enumerate(docs):
        lines.append(doc.replace("\n", " "))
        if i % 7 == 0:
            lines.append("   ")
        if i % 11 == 0:
            lines.append("")
    data = "\n".join(lines).replace("\n", "\r\n", 50).encode()
    path = tmp_path / "kjv.txt"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_compressed_text_lines_equal_the_uncompressed_file_at_any_block_size(kjv_text, kind, monkeypatch):
    """Blocks far smaller than a line (documents cross several blocks) and larger than the file. Bug it
    caught: the text after the last whole block never reached the copy (the last documents were cut)."""
    path, data = kjv_text
    want = _docs(sources.TextLineSource([str(path)]))
    packed = _compress(path, data, kind)
    for block in (97, 4096, 1 << 24):
        monkeypatch.setattr(compressed, "BLOCK_BYTES", block)
        monkeypatch.setenv("SCONE_JAX_BLOCK_CACHE", str(path.parent / f"cache{block}"))
        got = sources.open_source(_cfg(train_files=packed), "train")
        assert len(got) == len(want) == 600
        assert _docs(got) == want
        # grain workers get the source pickled: the same documents from the same block copy
        again = pickle.loads(pickle.dumps(got))
        rng = np.random.default_rng(block)
        for i in rng.integers(0, len(want), 50):
            assert again[int(i)] == want[int(i)]


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_compressed_jsonl_and_whole_file_documents(tmp_path, kind):
    rows = [{"text": f"record {i}: " + "word " * (i % 50)} for i in range(500)]
    plain = tmp_path / "d.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    packed = _compress(plain, plain.read_bytes(), kind)
    got = sources.open_source(_cfg(source="jsonl", train_files=packed), "train")
    assert _docs(got) == [r["text"] for r in rows]

    (tmp_path / "files").mkdir()
    empty = _compress(tmp_path / "files" / "empty.txt", b"", kind)
    whole = _compress(tmp_path / "files" / "book.txt", "Genesis\n\nExodus, naïve\n".encode(), kind)
    source = sources.open_source(_cfg(document_unit="file", train_files=f"{whole},{empty}"), "train")
    assert _docs(source) == ["Genesis\n\nExodus, naïve\n"]  # the empty archive is no document


def test_the_block_copy_is_reused_and_a_changed_file_gets_a_new_one(kjv_text, tmp_path):
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    first = compressed.BlockCopy(packed)
    built = (tmp_path / "block_cache").stat().st_mtime_ns, sorted(p.name for p in (tmp_path / "block_cache").iterdir())
    second = compressed.BlockCopy(packed)
    assert second.copy_path == first.copy_path
    assert sorted(p.name for p in (tmp_path / "block_cache").iterdir()) == built[1]  # no rebuild, no temporaries
    _compress(path, data[: len(data) // 2], "gzip")  # the file changes: size and mtime
    third = compressed.BlockCopy(packed)
    assert third.copy_path != first.copy_path and third.size == len(data) // 2


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_damaged_archive_is_one_line_naming_the_file(kjv_text, kind):
    path, data = kjv_text
    packed = _compress(path, data, kind)
    raw = bytearray(open(packed, "rb").read())
    truncated = packed.replace("kjv", "truncated")
    open(truncated, "wb").write(bytes(raw[: len(raw) // 2]))
    flipped = packed.replace("kjv", "flipped")
    raw[len(raw) // 2] ^= 0xFF
    raw[len(raw) // 2 + 1] ^= 0xFF
    open(flipped, "wb").write(bytes(raw))
    for bad in (truncated, flipped):
        with pytest.raises(ValueError) as e:
            sources.open_source(_cfg(train_files=bad), "train")
        message = str(e.value)
        assert message.startswith(f"{bad}: damaged {kind} archive") and "\n" not in message
        assert "Fix:" in message


def test_not_utf8_inside_an_archive_names_the_decompressed_offset(tmp_path):
    packed = _compress(tmp_path / "latin1.txt", "fine line\ncaf\xe9 au lait\n".encode("latin-1"), "gzip")
    source = sources.open_source(_cfg(train_files=packed), "train")
    assert source[0] == "fine line"
    with pytest.raises(ValueError, match=r"latin1.txt.gz at byte 13 of its decompressed text: not UTF-8"):
        source[1]


def _replace_keeping_mtime(archive: str, other: bytes, how: str) -> None:
    """Put other bytes of the same size at `archive` with its modification time restored: in place, as
    `cp -p` does, or by a rename, as `rsync -a` does."""
    before = os.stat(archive)
    assert len(other) == before.st_size
    time.sleep(0.02)  # past the file system's timestamp tick: a real copy comes later than the first write
    if how == "cp -p":
        with open(archive, "r+b") as f:
            f.write(other)
    else:
        with open(archive + ".rsync-tmp", "wb") as f:
            f.write(other)
        os.replace(archive + ".rsync-tmp", archive)
    os.utime(archive, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(archive).st_size, os.stat(archive).st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("how", ["cp -p", "rsync -a"])
def test_an_archive_replaced_by_same_size_content_with_its_mtime_restored_is_read_anew(tmp_path, how):
    """Before: the copy was named by the archive's path, size and mtime, so a fresh run trained on the old
    text while its checkpoint recorded the new archive's CRC. Now the copy is named by the archive's CRC and
    its index records the CRC it was made from: either defence alone passes this test. Caught: both undone
    (the copy's key of path, size and st_mtime_ns again, and _load not comparing the index's archive)."""
    def archive_of(text: list[str]) -> bytes:
        return gzip.compress("".join(line + "\n" for line in text).encode(), mtime=0)

    lines = [f"line {i} of the corpus" for i in range(300)]
    old, rng = archive_of(lines), np.random.default_rng(0)
    # other lines (the same, in another order) whose archive has the same size
    new = next(a for a in (archive_of(list(rng.permutation(lines))) for _ in range(500)) if len(a) == len(old))
    assert old != new
    packed = str(tmp_path / "corpus.txt.gz")
    with open(packed, "wb") as f:
        f.write(old)
    assert _docs(sources.open_source(_cfg(train_files=packed), "train")) == lines
    _replace_keeping_mtime(packed, new, how)
    fresh = sources.open_source(_cfg(train_files=packed), "train")
    assert _docs(fresh) == gzip.decompress(new).decode().splitlines() != lines
    # what the checkpoint records is what the copy was made from
    [(size, crc)] = identity.train_data_identity(_cfg(train_files=packed)).values()
    assert compressed.BlockCopy(packed).archive.tolist() == [size, int(crc, 16)] == [len(new), zlib.crc32(new)]


def test_copies_live_in_a_per_user_directory_not_the_shared_temporary_one(kjv_text, tmp_path, monkeypatch):
    """Caught: the directory defaulting to tempfile.gettempdir()/scone_jax_block_cache again (any local user
    could create it first)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    monkeypatch.delenv(local_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    copy = compressed.BlockCopy(packed)
    assert os.path.dirname(copy.copy_path) == str(tmp_path / "xdg" / "scone_jax")
    assert os.stat(tmp_path / "xdg" / "scone_jax").st_mode & 0o777 == 0o700
    assert copy.pread(len(data), 0) == data


@pytest.mark.parametrize("fault", ["another user's", "others may write"])
def test_a_cache_directory_others_could_write_to_is_refused_in_one_line(kjv_text, tmp_path, monkeypatch, fault):
    """Before: another user could create the directory first and plant the text a run trains on. Caught:
    the owner check removed (another user's directory is used); the mode check removed (a mode 777 one is)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    planted = tmp_path / "block_cache"
    planted.mkdir(mode=0o700)
    if fault == "another user's":  # as if another uid made it: this test runs as any user, root included
        owner = os.stat(planted).st_uid
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
        expected = f"belongs to user id {owner}, not to you ({owner + 1})"
    else:
        os.chmod(planted, 0o777)
        expected = "may be written by others (mode 777)"
    with pytest.raises(ValueError) as e:
        sources.open_source(_cfg(train_files=packed), "train")
    message = str(e.value)
    assert expected in message and str(planted) in message and "Fix:" in message and "\n" not in message
    assert os.listdir(planted) == []  # nothing read from it, nothing written to it


def test_a_planted_copy_is_detected_and_built_again(kjv_text, tmp_path):
    """Two plants in the copy's own name: another archive's copy with its index (caught: the index's archive
    size and CRC not compared with the archive's); another text's blocks under this archive's index, same
    lengths, valid zlib (caught: a block's text not checked against its CRC)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    other_text = data.replace(b"LORD", b"Lord")
    assert len(other_text) == len(data) and other_text != data
    other = _compress(tmp_path / "other.txt", other_text, "gzip")
    want = _docs(sources.TextLineSource([str(path)]))
    mine, theirs = compressed.BlockCopy(packed), compressed.BlockCopy(other)

    shutil.copy(theirs.copy_path, mine.copy_path)  # their copy and index under my names
    shutil.copy(theirs.index_path, mine.index_path)
    assert _docs(sources.open_source(_cfg(train_files=packed), "train")) == want

    mine = compressed.BlockCopy(packed)  # their blocks, my index with their block offsets: only the CRCs differ
    tables = dict(np.load(mine.index_path))
    tables["offsets"] = theirs.offsets
    with open(mine.index_path, "wb") as f:
        np.savez(f, **tables)
    shutil.copy(theirs.copy_path, mine.copy_path)
    assert _docs(sources.open_source(_cfg(train_files=packed), "train")) == want


def test_a_copy_recorded_from_an_archive_of_the_same_size_but_another_crc_is_built_again(kjv_text, tmp_path):
    """Another archive's whole, self-consistent copy planted under this archive's names, its index forged to record
    this archive's size: only the recorded CRC tells it was made from other bytes. It is built again and the
    documents are this archive's. Caught: the index's archive record compared by size only (the planted copy
    served: 'Lord' where the file says 'LORD')."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    other = _compress(tmp_path / "other.txt", data.replace(b"LORD", b"Lord"), "gzip")
    want = _docs(sources.TextLineSource([str(path)]))
    mine, theirs = compressed.BlockCopy(packed), compressed.BlockCopy(other)
    assert mine.archive[1] != theirs.archive[1]
    tables = dict(np.load(theirs.index_path))
    tables["archive"] = np.array([mine.archive[0], theirs.archive[1]], np.int64)  # this size, their CRC
    with open(mine.index_path, "wb") as f:
        np.savez(f, **tables)
    shutil.copy(theirs.copy_path, mine.copy_path)
    assert _docs(sources.open_source(_cfg(train_files=packed), "train")) == want
    assert np.array_equal(np.load(mine.index_path)["archive"], mine.archive)  # the copy was made again


def test_a_damaged_copy_is_built_again_at_start_and_named_in_one_line_after(kjv_text):
    """Before: a 53-line zlib traceback at every start, forever. Now the line scan at start checks every
    block and builds a damaged copy again; damage found by a later read is one line with the fix. Caught:
    chunks() not building again on damage (the scan stops with DamagedCopy); zlib.error not turned into
    DamagedCopy in _block (the old traceback)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    want = _docs(sources.TextLineSource([str(path)]))
    copy = compressed.BlockCopy(packed)

    def damage():
        with open(copy.copy_path, "r+b") as f:
            f.seek(int(copy.offsets[3]) + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    damage()
    source = sources.open_source(_cfg(train_files=packed), "train")
    assert _docs(source) == want
    damage()  # under a running source: its reads name the copy and the fix
    broken = [i for i in range(len(want)) if _raises(source, i)]
    assert broken, "no document of block 3 was read"
    with pytest.raises(compressed.DamagedCopy) as e:
        source[broken[0]]
    assert str(e.value).startswith(f"{copy.copy_path}: the block copy of {packed} is damaged (block 3")
    assert "Fix: rerun" in str(e.value) and "\n" not in str(e.value)
    assert _docs(sources.open_source(_cfg(train_files=packed), "train")) == want  # the rerun


def _raises(source, i) -> bool:
    try:
        source[i]
    except compressed.DamagedCopy:
        return True
    return False


def test_a_full_disk_while_building_is_one_line_exit_2_and_leaves_no_file(kjv_text, tmp_path, monkeypatch, capsys):
    """The copy's writes fail with ENOSPC after some bytes reach the disk. Caught: the scratch files not
    removed on failure (a partial .tmp- file stays); the OSError passed on as it is (the training job,
    which reports ValueError in one line, would print a traceback)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")

    class Full:
        def __init__(self, f):
            self._f, self._left = f, 1000

        def write(self, data):
            if len(data) > self._left:
                self._f.write(data[:self._left])
                self._f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._left -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def full_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f

    monkeypatch.setattr(compressed, "open", full_open, raising=False)
    with pytest.raises(ValueError, match="no space left for its block copy"):
        compressed.BlockCopy(packed)
    main = tool_main.main_of(lambda: sources.open_source(_cfg(train_files=packed), "train"), "tool")
    with pytest.raises(SystemExit) as e:
        main(["tool"])
    assert e.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"tool: error: {packed}: no space left for its block copy in {tmp_path / 'block_cache'}")
    assert "Fix: free space there" in line
    assert os.listdir(tmp_path / "block_cache") == []
    monkeypatch.undo()
    monkeypatch.setenv(local_cache.ENV, str(tmp_path / "block_cache"))
    assert compressed.BlockCopy(packed).pread(len(data), 0) == data  # space again: built


def test_temporaries_of_dead_processes_are_removed_and_live_ones_kept(kjv_text, tmp_path, monkeypatch):
    """Caught: every temporary of this host removed, whether its writer runs or not (a live build loses
    its file); the host not compared (a build on another host sharing the directory loses its file)."""
    path, data = kjv_text
    packed = _compress(path, data, "gzip")
    cache = tmp_path / "block_cache"
    cache.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        host = socket.gethostname()
        names = {"dead": f"a.txt.gz.0123.blocks.tmp-{host}-{dead.pid}",
                 "dead index": f"a.txt.gz.0123.blocks.index.npz.tmp-{host}-{dead.pid}",
                 "live": f"b.txt.gz.4567.blocks.tmp-{host}-{live.pid}",
                 "other host": f"c.txt.gz.89ab.blocks.tmp-{host}x-{dead.pid}"}
        for name in names.values():
            (cache / name).write_bytes(b"partial")
        monkeypatch.setattr(local_cache, "_checked", set())  # a new process
        compressed.BlockCopy(packed)
        left = set(os.listdir(cache))
        assert names["live"] in left and names["other host"] in left
        assert names["dead"] not in left and names["dead index"] not in left
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_an_archive_that_grows_while_its_copy_is_made_is_refused_in_one_line(kjv_text, tmp_path, monkeypatch, kind):
    """Another writer appends a stream (`cat more.gz >> corpus.gz`) after the copy's first chunk: the copy would
    hold the appended text under the identity (size, CRC) of the archive before it, so a run would record one
    corpus and train on another. Refused in one line naming the file, no copy or temporary left; once nothing
    writes, the next build reads both parts. (Chunks of 1 KiB, so the build reads the archive in several pieces.)
    Caught: the check `raw.crc != self.archive[1]` dropped (the copy was used; issue 64)."""
    path, data = kjv_text
    packed = _compress(path, data, kind)
    more = b"\nAnd the appended line came in while the copy was made.\n"
    with open(_compress(tmp_path / "more", more, kind), "rb") as f:
        appended = f.read()
    monkeypatch.setattr(compressed, "_READ_BYTES", 1024)
    original = compressed.stream_chunks

    def growing(name, raw=None):
        for n, chunk in enumerate(original(name, raw)):
            if n == 0:
                with open(packed, "ab") as f:
                    f.write(appended)
            yield chunk

    monkeypatch.setattr(compressed, "stream_chunks", growing)
    with pytest.raises(ValueError) as e:
        compressed.BlockCopy(packed)
    assert str(e.value).startswith(f"{packed} changed while it was read (CRC ") and "Fix: rerun once nothing writes" \
        in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path / "block_cache") == []
    monkeypatch.setattr(compressed, "stream_chunks", original)
    copy = compressed.BlockCopy(packed)
    assert copy.pread(copy.size, 0) == data + more
