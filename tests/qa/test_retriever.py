"""The dense retriever on a corpus the tests build: the right passage comes first."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.qa.retriever import (
    EncoderConfig,
    PassageIndex,
    RetrieverError,
    build_index,
    read_corpus,
    render_hits,
)
from services.qa.tools import SearchToolSet
from tests.qa.conftest import PASSAGES, QUESTIONS, write_corpus


def test_index_folder_layout(index_dir):
    meta = json.loads((index_dir / "meta.json").read_text())
    vectors = np.load(index_dir / "embeddings.npy")
    assert meta["count"] == len(PASSAGES) == vectors.shape[0]
    assert vectors.shape[1] == meta["dim"] == 384
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)  # unit vectors: dot = cosine
    assert len(meta["corpus_sha256"]) == 64


@pytest.mark.parametrize("question,passage_id,_answers", QUESTIONS)
def test_right_passage_ranks_first(index, question, passage_id, _answers):
    hits = index.search(question, k=3)
    assert hits[0].passage.id == passage_id, [h.passage.id for h in hits]
    assert hits[0].score > hits[1].score >= hits[2].score


def test_batch_search_equals_single(index):
    questions = [q for q, _, _ in QUESTIONS]
    batched = index.search_many(questions, k=2)
    for question, hits in zip(questions, batched):
        assert [h.passage.id for h in hits] == [h.passage.id for h in index.search(question, k=2)]


def test_k_larger_than_corpus_and_invalid_k(index):
    assert len(index.search("anything", k=100)) == len(PASSAGES)
    with pytest.raises(RetrieverError, match="at least 1"):
        index.search("x", k=0)


def test_rendered_like_search_r1(index):
    text = render_hits(index.search("Who discovered penicillin?", k=2))
    lines = text.splitlines()
    assert lines[0].startswith("Doc 1(Title: Penicillin) Penicillin was discovered in 1928")
    assert lines[1].startswith("Doc 2(Title: ")


def test_wiki18_contents_form(tmp_path):
    passages = read_corpus(write_corpus(tmp_path / "wiki.jsonl", form="contents"))
    assert passages[0].title == "Eiffel Tower" and passages[0].text.startswith("The Eiffel Tower is")


def test_e5_style_prefixes_reach_the_encoder(encoder):
    """The E5 config's prefixes change what is encoded (checked with the offline model)."""
    from services.qa.retriever import Encoder

    prefixed = Encoder.__new__(Encoder)
    prefixed.model, prefixed.dim = encoder.model, encoder.dim
    prefixed.config = EncoderConfig(model=encoder.config.model, query_prefix="query: ", passage_prefix="passage: ")
    assert np.allclose(prefixed.queries(["who is fleming"]), encoder.passages(["query: who is fleming"]), atol=1e-5)
    assert not np.allclose(prefixed.queries(["who is fleming"]), encoder.queries(["who is fleming"]), atol=1e-3)


def test_unfinished_index_refused(tmp_path, corpus_file, encoder):
    out = build_index(corpus_file, tmp_path / "idx", encoder.config, encoder=encoder, progress=False)
    (out / "meta.json").unlink()
    with pytest.raises(RetrieverError, match="meta.json missing"):
        PassageIndex.load(out)


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "empty"),
        ("{bad\n", "not JSON"),
        ('{"id": 1, "body": "x"}\n', "neither 'contents' nor 'text'"),
    ],
)
def test_bad_corpus_says_why(tmp_path, content, message):
    path = tmp_path / "c.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(RetrieverError, match=message):
        read_corpus(path)


def test_tool_set_results(index):
    tools = SearchToolSet(index, top_k=2)
    result = tools.call("Search", {"query": "Which organ produces insulin?"})
    assert result.ok and result.name == "Search"
    assert result.text.startswith("Doc 1(Title: Insulin)") and result.text.count("Doc ") == 2
    bad = tools.call("Search", {"q": "x"})
    assert not bad.ok and "non-empty 'query'" in bad.text


def test_default_is_top_five(index):
    from services.common.settings import Settings

    assert Settings().qa_top_k == 5
    text = SearchToolSet(index).call("Search", {"query": "a famous tower"}).text
    assert [line.split("(")[0] for line in text.splitlines()] == [f"Doc {i}" for i in range(1, 6)]
