import random

import pytest

from gpt.data.corpus import CorpusError, ReadStats, Segment, decode_utf8, find_documents, plan_split, read_chunks


def _segment(path, split="train"):
    from gpt.data.corpus import Document

    size = path.stat().st_size
    return Segment(Document(path, size), 0, size, split, True)


def test_decode_utf8_replaces_and_counts_invalid_bytes():
    data = "ok é ".encode() + b"\xff\xfe" + " 東".encode() + b"\xe6\x9d"  # 2 bad bytes, then a cut character
    text, used, replaced = decode_utf8(data, final=False)
    assert text == "ok é \ufffd\ufffd 東" and replaced == 2 and used == len(data) - 2  # the cut char waits
    text, used, replaced = decode_utf8(data, final=True)
    assert text.endswith("東\ufffd") and used == len(data) and replaced == 4
    assert text == data.decode("utf-8", errors="replace")
    with pytest.raises(UnicodeDecodeError) as e:
        decode_utf8(data, final=True, strict=True)
    assert e.value.start == len("ok é ".encode())


def test_chunks_rebuild_the_text_and_cut_only_between_words(tmp_path):
    rng = random.Random(0)
    words = ["the", "Crème", "東京", "🙂🚀", "x\ty", "  ", "\n", "\n\n", "don't", "12,5"]
    text = "".join(rng.choice(words) + rng.choice([" ", "\n", ""]) for _ in range(20_000))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    stats = ReadStats()
    chunks = list(read_chunks(_segment(path), chunk_bytes=997, stats=stats))
    assert "".join(c for c, _ in chunks) == text
    assert sum(n for _, n in chunks) == path.stat().st_size
    assert len(chunks) > 50 and stats.replaced_bytes == 0
    for (a, _), (b, _) in zip(chunks, chunks[1:]):
        after_newline = a[-1] == "\n" and not a[-2].isspace() and not b[0].isspace()  # "x\n|y"
        before_space = b[0] == " " and not a[-1].isspace() and not b[1].isspace()  # "x| y"
        assert after_newline or before_space, (a[-5:], b[:5])


def test_chunks_of_a_line_without_spaces_cut_at_character_boundaries(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("東" * 5000, encoding="utf-8")
    chunks = [c for c, _ in read_chunks(_segment(path), chunk_bytes=1000, stats=ReadStats())]
    assert "".join(chunks) == "東" * 5000 and len(chunks) > 10


def test_invalid_bytes_are_counted_per_file(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"abc\xff def\n" * 1000)
    stats = ReadStats()
    text = "".join(c for c, _ in read_chunks(_segment(path), chunk_bytes=64, stats=stats))
    assert text == "abc\ufffd def\n" * 1000
    assert stats.replaced_bytes == 1000 and stats.files_with_replacements == [(path, 1000)]
    with pytest.raises(CorpusError, match=r"bad.txt: bytes at offset 3 are not UTF-8.*--strict-utf8"):
        list(read_chunks(_segment(path), chunk_bytes=64, stats=stats, strict=True))


def _docs(tmp_path, sizes):
    for i, n in enumerate(sizes):
        (tmp_path / f"doc{i:02d}.txt").write_text("line of text\n" * n)
    return find_documents([tmp_path])


def test_split_by_document_spreads_val_documents(tmp_path):
    segments, mode = plan_split(_docs(tmp_path, [3] * 20), val_fraction=0.1)
    assert mode == "document"
    assert [s.doc.path.name for s in segments if s.split == "val"] == ["doc09.txt", "doc19.txt"]
    assert all(s.start == 0 and s.end == s.doc.size and s.last for s in segments)


def test_split_tail_of_few_documents_at_a_line_start(tmp_path):
    docs = _docs(tmp_path, [10, 10, 10])
    segments, mode = plan_split(docs, val_fraction=0.25)
    assert mode == "tail"
    assert [(s.doc.path.name, s.split, s.last) for s in segments] == [
        ("doc00.txt", "train", True),
        ("doc01.txt", "train", True),
        ("doc02.txt", "train", False),
        ("doc02.txt", "val", True),
    ]
    cut = segments[2].end
    assert segments[3].start == cut and docs[2].path.read_bytes()[cut - 1 : cut] == b"\n"
    val_bytes = sum(s.size for s in segments if s.split == "val")
    assert abs(val_bytes - 0.25 * sum(d.size for d in docs)) <= len("line of text\n")


def test_val_fraction_must_be_a_fraction(tmp_path):
    with pytest.raises(CorpusError, match="--val-fraction must be between 0 and 1"):
        plan_split(_docs(tmp_path, [1]), val_fraction=1.0)


def test_find_documents_walks_sorted_and_skips_hidden_binary_empty(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "a.md").write_text("a")
    (tmp_path / ".hidden.txt").write_text("h")
    (tmp_path / ".git" / "config").write_text("g")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "meta.json").write_text("{}")
    docs = find_documents([tmp_path, tmp_path / "a.md", tmp_path / "image.png"], exclude=tmp_path / "out")
    # a.md is not repeated; the binary file is read because it was named explicitly
    assert [d.path.relative_to(tmp_path).as_posix() for d in docs] == ["a.md", "b/z.txt", "image.png"]
    with pytest.raises(CorpusError, match="no such file or directory: .*missing"):
        find_documents([tmp_path / "missing"])


def test_a_file_that_cannot_be_read_is_one_error_naming_it(tmp_path, monkeypatch):
    import errno

    import gpt.data.corpus

    (tmp_path / "dir").mkdir()
    path = tmp_path / "dir" / "locked.txt"
    path.write_text("text")

    def denied(file, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(file))

    monkeypatch.setattr(gpt.data.corpus, "open", denied, raising=False)
    with pytest.raises(CorpusError, match=rf"^cannot read {path}: Permission denied$"):
        list(read_chunks(_segment(path), chunk_bytes=1024, stats=ReadStats()))
    with pytest.raises(CorpusError, match=rf"^cannot read {path}: Permission denied$"):
        find_documents([tmp_path / "dir"])  # sniffing a directory's files for binary content
