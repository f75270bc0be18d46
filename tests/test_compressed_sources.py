"""Compressed corpora (data/compressed.py): .gz and .zst text and JSONL files give exactly the documents
of the uncompressed file, through the same random access, and a damaged archive is one line naming it."""
import gzip
import json
import pickle

import ml_collections
import numpy as np
import pytest
import zstandard

from scone_jax.data import compressed, corpus, sources


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
