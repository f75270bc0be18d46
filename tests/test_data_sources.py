"""Tests for the document sources: text lines/files, JSONL, token ArrayRecords, KJV, and their errors."""
import json
import pickle
import re

import ml_collections
import numpy as np
import pytest

from scone_jax.data import documents, shards, sources


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
    path.write_text('{"text": "ok"}\n\n{"text": 3}\n{"text": "fine"\n{"text": null}\n')
    source = sources.open_source(cfg, "train")
    # A record whose field is there but holds no text is that record's fault, not data.text_field's.
    with pytest.raises(ValueError, match=r"d\.jsonl:3: field 'text' holds 3, not text\. Fix: remove or repair"):
        source[1]
    with pytest.raises(ValueError, match=r"d\.jsonl:4: bad JSON"):
        source[2]
    with pytest.raises(ValueError, match=r"d\.jsonl:5: field 'text' holds null, not text") as error:
        source[3]
    assert "text_field" not in str(error.value)


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


def _write_shards(directory, docs_per_shard, fingerprint="f00d", sidecars=True):
    """Shards shard-<i>.arrayrecord of the given token lists; with sidecars, as tools/pretokenize.py writes them."""
    paths = []
    for i, docs in enumerate(docs_per_shard):
        path = str(directory / f"shard-{i}.arrayrecord")
        if sidecars:
            shards.write_shard(path, [np.array(d, np.int32) for d in docs],
                               {"tokenizer_fingerprint": fingerprint, "tokenizer_vocab_size": 512, "source": "test"})
        else:
            sources.write_token_arrayrecord(path, docs)
        paths.append(path)
    return paths


SHARD_DOCS = [[[5, 6, 7], [], [9] * 40], [[1], [2, 3]]]


def test_globs_skip_sidecars_of_matched_files_only(tmp_path):
    paths = _write_shards(tmp_path, SHARD_DOCS)
    (tmp_path / "other.json").write_text("{}")  # describes no matched file: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other.json", "shard-0.arrayrecord", "shard-0.arrayrecord.json", "shard-0.arrayrecord.lengths.npy",
        "shard-1.arrayrecord", "shard-1.arrayrecord.json", "shard-1.arrayrecord.lengths.npy"]
    assert sources.expand_files(f"{tmp_path}/*") == [str(tmp_path / "other.json")] + paths
    assert sources.expand_files(f"{tmp_path}/*.json") == sorted(str(p) for p in tmp_path.glob("*.json"))
    source = sources.open_source(_data_cfg(source="arrayrecord", train_files=f"{tmp_path}/shard-*"), "train")
    assert [d.tolist() for d in _docs(source)] == [d for shard in SHARD_DOCS for d in shard]
    assert source.read_concatenated([4, 0, 2, 4]).tolist() == [2, 3, 5, 6, 7] + [9] * 40 + [2, 3]
    assert source.read_concatenated([]).dtype == np.int32 and source.read_concatenated([1]).size == 0
    with pytest.raises(IndexError, match="Document 5 is outside the 5 documents of 2 shard"):
        source.read_concatenated([0, 5])


def test_document_lengths_come_from_the_sidecars(tmp_path, monkeypatch):
    paths = _write_shards(tmp_path, SHARD_DOCS)
    np.testing.assert_array_equal(np.load(paths[0] + ".lengths.npy"), np.array([3, 0, 40], np.int32))
    meta = json.loads((tmp_path / "shard-1.arrayrecord.json").read_text())
    assert meta == {"format": "scone_jax.tokens.v1", "tokenizer_fingerprint": "f00d", "tokenizer_vocab_size": 512,
                    "num_documents": 2, "num_tokens": 3, "source": "test"}
    source = pickle.loads(pickle.dumps(sources.TokenArrayRecordSource(paths)))
    monkeypatch.setattr(sources, "_record_lengths", lambda *a: pytest.fail("read records despite the sidecars"))
    lengths = source.document_lengths()
    assert lengths.dtype == np.int64 and lengths.tolist() == [3, 0, 40, 1, 2]
    assert len(pickle.dumps(source)) < 1500  # file names and counts only; nothing cached


def test_document_lengths_read_the_records_of_shards_without_sidecars(tmp_path, caplog):
    with_sidecars = _write_shards(tmp_path, SHARD_DOCS[:1])
    (tmp_path / "bare").mkdir()
    bare = _write_shards(tmp_path / "bare", SHARD_DOCS[1:], sidecars=False)
    source = sources.TokenArrayRecordSource(with_sidecars + bare)
    assert source.document_lengths().tolist() == [3, 0, 40, 1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert f"1 of 2 ArrayRecord shard(s) have no .lengths.npy sidecar ({bare[0]})" in warnings[0]
    assert "tools/pretokenize.py" in warnings[0]


def test_sidecar_that_disagrees_with_its_shard_is_an_error(tmp_path):
    paths = _write_shards(tmp_path, SHARD_DOCS)
    np.save(paths[1] + ".lengths.npy", np.array([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match=re.escape(f"{paths[1]}.lengths.npy lists (3,) int32 lengths but "
                                                   f"{paths[1]} holds 2 records. Fix: re-run tools/pretokenize.py")):
        sources.TokenArrayRecordSource(paths).document_lengths()
    meta = json.loads(open(paths[0] + ".json").read())
    open(paths[0] + ".json", "w").write(json.dumps({**meta, "num_documents": 4}))
    with pytest.raises(ValueError, match=re.escape(f"{paths[0]}.json says 4 documents but {paths[0]} holds 3")):
        sources.TokenArrayRecordSource(paths).check_tokenizer("f00d")


def test_check_tokenizer_refuses_another_tokenizer(tmp_path):
    _write_shards(tmp_path, SHARD_DOCS, fingerprint="f00d")
    cfg = _data_cfg(source="arrayrecord", train_files=f"{tmp_path}/*")
    assert len(sources.open_source(cfg, "train", tokenizer_fingerprint="f00d")) == 5
    message = (f"{tmp_path}/shard-0.arrayrecord was tokenized with tokenizer f00d but this run uses beef. Fix: set "
               "data.tokenizer_path to the tokenizer that made the data, or re-run tools/pretokenize.py")
    with pytest.raises(ValueError, match=re.escape(message)):
        sources.open_source(cfg, "train", tokenizer_fingerprint="beef")
    assert len(sources.open_source(cfg, "train")) == 5  # no fingerprint given: nothing checked


def test_shards_without_sidecars_are_accepted_with_one_warning(tmp_path, caplog):
    paths = _write_shards(tmp_path, SHARD_DOCS, sidecars=False)
    source = sources.open_source(_data_cfg(source="arrayrecord", train_files=f"{tmp_path}/*"), "train",
                                 tokenizer_fingerprint="f00d")
    source.check_tokenizer("f00d")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"2 of 2 ArrayRecord shard(s) have no .json sidecar ({paths[0]}, {paths[1]}), so their "
                        "tokenizer cannot be checked. Fix: write the data with tools/pretokenize.py."]


def test_an_interrupted_shard_write_leaves_the_old_shard_and_no_temporaries(tmp_path):
    (path,) = _write_shards(tmp_path, SHARD_DOCS[:1])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def failing_docs():
        yield np.array([1, 2], np.int32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shards.write_shard(path, failing_docs(), {"tokenizer_fingerprint": "beef"})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert shards.write_shard(path, [np.array([4], np.int32)], {"tokenizer_fingerprint": "beef"}) == (1, 1)
    assert [d.tolist() for d in _docs(sources.TokenArrayRecordSource([path]))] == [[4]]
    assert json.loads(open(path + ".json").read())["tokenizer_fingerprint"] == "beef"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)


def test_lengths_sidecar_edited_after_writing_is_caught_when_read(tmp_path):
    # Same record count, one wrong length: packing would misplace every document boundary after it.
    paths = _write_shards(tmp_path, SHARD_DOCS)
    np.save(paths[0] + ".lengths.npy", np.array([3, 0, 39], np.int32))
    source = sources.TokenArrayRecordSource(paths)
    docs = documents.RecordDocuments(source, np.arange(5), source.document_lengths(), 512, "f00d")
    assert docs.gather(np.array([4, 0]))[0].tolist() == [2, 3, 5, 6, 7]
    with pytest.raises(ValueError, match=r"hold 43 tokens but their lengths sidecar \(.lengths.npy\) says 42"):
        docs.gather(np.array([0, 2]))
