"""Tests for the document sources: text lines/files, JSONL, token ArrayRecords, KJV, and their errors."""
import json
import pickle
import re

import ml_collections
import numpy as np
import pytest

from scone_jax.data import sources


def _data_cfg(**overrides):
    cfg = dict(source="text", train_files="", eval_files="", text_field="text", document_unit="line",
               eval_fraction=0.02)
    cfg.update(overrides)
    return ml_collections.ConfigDict(cfg)


def _docs(source):
    return [source[i] for i in range(len(source))]


@pytest.fixture
def text_dir(tmp_path):
    (tmp_path / "b.txt").write_bytes("first of b\n\nsecond  of b, naïve\r\n\r\nthird of b".encode())
    (tmp_path / "a.txt").write_text("\n\nfirst of a\n  indented line of a\n")
    (tmp_path / "empty.txt").write_text("")
    return tmp_path


def test_text_lines_in_sorted_file_order_skipping_blank_lines(text_dir):
    source = sources.open_source(_data_cfg(train_files=str(text_dir / "*.txt")), "train")
    expected = ["first of a", "  indented line of a", "first of b", "second  of b, naïve", "third of b"]
    assert _docs(source) == expected
    assert _docs(pickle.loads(pickle.dumps(source))) == expected
    with pytest.raises(IndexError):
        source[5]


def test_line_index_is_the_same_for_any_read_chunk(text_dir, monkeypatch):
    expected = _docs(sources.TextLineSource([str(text_dir / "b.txt"), str(text_dir / "a.txt")]))
    for chunk in (1, 2, 3, 7):
        monkeypatch.setattr(sources, "_SCAN_BYTES", chunk)
        assert _docs(sources.TextLineSource([str(text_dir / "b.txt"), str(text_dir / "a.txt")])) == expected


def test_text_files_one_document_each_and_comma_separated_patterns(text_dir):
    cfg = _data_cfg(document_unit="file", train_files=f"{text_dir}/b.txt, {text_dir}/*.txt")
    source = sources.open_source(cfg, "train")
    assert _docs(source) == [(text_dir / name).read_bytes().decode() for name in ("a.txt", "b.txt")]


def test_jsonl_reads_the_text_field(tmp_path):
    rows = [{"text": "alpha\nbeta", "id": 1}, {"text": "gamma"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    source = sources.open_source(_data_cfg(source="jsonl", eval_files=str(tmp_path / "d.jsonl")), "eval")
    assert _docs(source) == ["alpha\nbeta", "gamma"]


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "x"}\n')
    cfg = _data_cfg(source="jsonl", train_files=str(path))
    with pytest.raises(ValueError, match=r"d\.jsonl:1: no string field 'text' \(found \['body'\]\).*data\.text_field"):
        sources.open_source(cfg, "train")
    path.write_text('{"text": "ok"}\n\n{"text": 3}\n{"text": "fine"\n')
    source = sources.open_source(cfg, "train")
    with pytest.raises(ValueError, match=r"d\.jsonl:3: no string field 'text'"):
        source[1]
    with pytest.raises(ValueError, match=r"d\.jsonl:4: bad JSON"):
        source[2]


def test_token_arrayrecord_round_trip(tmp_path):
    docs = [[5, 6, 7], [], list(range(1000)), [2**31 - 1]]
    sources.write_token_arrayrecord(str(tmp_path / "t.arrayrecord"), docs)
    source = sources.open_source(_data_cfg(source="arrayrecord", train_files=str(tmp_path / "*")), "train")
    got = _docs(pickle.loads(pickle.dumps(source)))
    assert [g.dtype for g in got] == [np.int32] * 4
    assert [g.tolist() for g in got] == docs


def test_kjv_source_splits():
    cfg = _data_cfg(source="kjv")
    held_out = sources.open_source(cfg, "eval")
    assert len(held_out) == 92
    assert sources.open_source(cfg, "train")[0].startswith("In the beginning God created")
    assert _docs(pickle.loads(pickle.dumps(held_out))) == _docs(held_out)


def test_no_matching_files_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "missing-*.txt")
    with pytest.raises(FileNotFoundError, match=re.escape(f"No files match the pattern '{pattern}'")):
        sources.open_source(_data_cfg(train_files=pattern), "train")


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "blank.txt").write_text("\n\r\n\n")
    with pytest.raises(ValueError, match="zero documents"):
        sources.open_source(_data_cfg(train_files=str(tmp_path / "blank.txt")), "train")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(source="parquet"), "data.source='parquet' is unknown; valid sources: kjv, text, jsonl, arrayrecord"),
        (dict(source="text"), "data.source='text' needs data.train_files"),
        (dict(source="kjv", train_files="x.txt"), "data.train_files='x.txt' is set but data.source='kjv'"),
        (dict(train_files="x.txt", document_unit="page"), "data.document_unit='page' is unknown"),
    ],
)
def test_bad_config_is_named(overrides, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("a document\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        sources.open_source(_data_cfg(**overrides), "train")
