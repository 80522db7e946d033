"""A small corpus and question set the tests build themselves: twelve passages on distinct
topics, questions whose answer sits in exactly one of them, and the index built once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

PASSAGES = [
    (
        "p-eiffel",
        "Eiffel Tower",
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
        "completed in 1889 for the World's Fair and designed by the company of Gustave Eiffel.",
    ),
    (
        "p-kilimanjaro",
        "Mount Kilimanjaro",
        "Mount Kilimanjaro is a dormant volcano in Tanzania and the highest "
        "mountain in Africa, rising about 5,895 metres above sea level.",
    ),
    (
        "p-penicillin",
        "Penicillin",
        "Penicillin was discovered in 1928 by the Scottish physician Alexander Fleming, "
        "who noticed that a mould killed bacteria in a culture dish.",
    ),
    (
        "p-amazon",
        "Amazon River",
        "The Amazon River in South America carries more water than any other river and "
        "flows into the Atlantic Ocean through Brazil.",
    ),
    (
        "p-chess",
        "Chess",
        "Chess is a board game for two players played on a checkered board of 64 squares; each "
        "player begins with sixteen pieces, including one king.",
    ),
    (
        "p-mercury",
        "Mercury (planet)",
        "Mercury is the smallest planet of the Solar System and the closest to the "
        "Sun, completing an orbit every 88 days.",
    ),
    (
        "p-beethoven",
        "Ludwig van Beethoven",
        "Ludwig van Beethoven was a German composer born in Bonn in 1770; he "
        "wrote nine symphonies and kept composing after he became deaf.",
    ),
    (
        "p-python",
        "Python (programming language)",
        "Python is a programming language created by Guido van Rossum "
        "and first released in 1991; its design stresses code readability.",
    ),
    (
        "p-honey",
        "Honey bee",
        "Honey bees live in colonies led by a single queen; worker bees gather nectar and "
        "turn it into honey stored in wax combs.",
    ),
    ("p-sahara", "Sahara", "The Sahara is the largest hot desert in the world, covering much of North Africa."),
    (
        "p-tokyo",
        "Tokyo",
        "Tokyo is the capital of Japan; it was called Edo until 1868, when the emperor moved "
        "there and the city was renamed.",
    ),
    (
        "p-insulin",
        "Insulin",
        "Insulin is a hormone made by the pancreas that lets cells take up glucose from "
        "the blood; Frederick Banting and Charles Best isolated it in 1921.",
    ),
]

# question → (id of the passage that answers it, gold answers)
QUESTIONS = [
    ("Who discovered penicillin?", "p-penicillin", ["Alexander Fleming"]),
    ("What is the highest mountain in Africa?", "p-kilimanjaro", ["Mount Kilimanjaro", "Kilimanjaro"]),
    ("In which city was Beethoven born?", "p-beethoven", ["Bonn"]),
    ("How many squares does a chess board have?", "p-chess", ["64", "sixty-four"]),
    ("Which planet is closest to the Sun?", "p-mercury", ["Mercury"]),
    ("Who created the Python programming language?", "p-python", ["Guido van Rossum"]),
    ("What was the old name of Tokyo?", "p-tokyo", ["Edo"]),
    ("Which organ produces insulin?", "p-insulin", ["pancreas", "the pancreas"]),
]


def write_corpus(path: Path, form: str = "title_text") -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for pid, title, text in PASSAGES:
            record = (
                {"id": pid, "contents": f'"{title}"\n{text}'}
                if form == "contents"
                else {"id": pid, "title": title, "text": text}
            )
            fh.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("qa-corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def encoder():
    from services.qa.retriever import Encoder, encoder_preset

    return Encoder(encoder_preset("minilm"))


@pytest.fixture(scope="session")
def index_dir(corpus_file, encoder, tmp_path_factory) -> Path:
    from services.qa.retriever import build_index

    return build_index(
        corpus_file, tmp_path_factory.mktemp("qa-index"), encoder.config, encoder=encoder, progress=False
    )


@pytest.fixture(scope="session")
def index(index_dir, encoder):
    from services.qa.retriever import PassageIndex

    return PassageIndex.load(index_dir, encoder=encoder)
