"""Loaders for the seven QA sets, one test per record form."""

from __future__ import annotations

import csv
import json

import pytest

from services.qa.datasets import QADataError, load_qa


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "filename,records,expected",
    [
        (
            "nq_test.jsonl",
            [
                {
                    "id": "test_0",
                    "question": "who wrote hamlet",
                    "golden_answers": ["Shakespeare", "William Shakespeare"],
                }
            ],
            ("nq", "test_0", "who wrote hamlet", ("Shakespeare", "William Shakespeare")),
        ),
        (
            "nq-open.jsonl",
            [{"question": "capital of france", "answer": ["Paris"]}],
            ("nq", "nq-0", "capital of france", ("Paris",)),
        ),
        (
            "triviaqa-dev.jsonl",
            [
                {
                    "QuestionId": "tc_1",
                    "Question": "Which element has symbol Fe?",
                    "Answer": {"Value": "Iron", "Aliases": ["Iron", "Fe"], "NormalizedAliases": ["iron", "fe"]},
                }
            ],
            ("triviaqa", "tc_1", "Which element has symbol Fe?", ("Iron", "Fe", "iron", "fe")),
        ),
        (
            "popqa.jsonl",
            [
                {
                    "id": 4222362,
                    "subj": "George Rankin",
                    "prop": "occupation",
                    "question": "What is George Rankin's occupation?",
                    "possible_answers": '["politician", "political leader"]',
                }
            ],
            ("popqa", "4222362", "What is George Rankin's occupation?", ("politician", "political leader")),
        ),
        (
            "hotpotqa_dev.jsonl",
            [
                {
                    "_id": "5a8b57f25542995d1e6f1371",
                    "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
                    "answer": "yes",
                    "type": "comparison",
                    "level": "hard",
                }
            ],
            (
                "hotpotqa",
                "5a8b57f25542995d1e6f1371",
                "Were Scott Derrickson and Ed Wood of the same nationality?",
                ("yes",),
            ),
        ),
        (
            "2wikimultihopqa_dev.jsonl",
            [
                {
                    "_id": "abc",
                    "question": "Who is the mother of the director of film X?",
                    "answer": "Jane Doe",
                    "type": "compositional",
                }
            ],
            ("2wiki", "abc", "Who is the mother of the director of film X?", ("Jane Doe",)),
        ),
        (
            "musique_ans_dev.jsonl",
            [
                {
                    "id": "2hop__1",
                    "question": "When was the founder of Y born?",
                    "answer": "1901",
                    "answer_aliases": ["1901 AD"],
                    "answerable": True,
                }
            ],
            ("musique", "2hop__1", "When was the founder of Y born?", ("1901", "1901 AD")),
        ),
        (
            "bamboogle.jsonl",
            [
                {
                    "id": "b1",
                    "question": "Who was president when the first Nobel was awarded?",
                    "golden_answers": ["William McKinley"],
                }
            ],
            ("bamboogle", "b1", "Who was president when the first Nobel was awarded?", ("William McKinley",)),
        ),
    ],
)
def test_each_form(tmp_path, filename, records, expected):
    [item] = load_qa(write_jsonl(tmp_path / filename, records))
    assert (item.dataset, item.id, item.question, item.answers) == expected


def test_hotpot_json_list_and_bamboogle_csv(tmp_path):
    json_list = tmp_path / "hotpot_dev_distractor_v1.json"
    json_list.write_text(
        json.dumps([{"_id": "a", "question": "q1?", "answer": "A1"}, {"_id": "b", "question": "q2?", "answer": "A2"}]),
        encoding="utf-8",
    )
    assert [i.answers for i in load_qa(json_list)] == [("A1",), ("A2",)]
    csv_path = tmp_path / "Bamboogle Prerelease - Sheet1.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["Question", "Answer"])
        writer.writerow(["Who won?", "Nobody"])
    [item] = load_qa(csv_path)
    assert (item.dataset, item.question, item.answers, item.id) == ("bamboogle", "Who won?", ("Nobody",), "bamboogle-0")


def test_dataset_named_by_caller_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "questions.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(5)])
    with pytest.raises(QADataError, match="cannot tell the dataset"):
        load_qa(path)
    assert len(load_qa(path, "nq", limit=2)) == 2


@pytest.mark.parametrize(
    "records,message",
    [
        ([{"question": "q"}], "no gold answer"),
        ([{"answer": "a"}], "no question"),
        (["just text"], "not a JSON object"),
    ],
)
def test_bad_records_say_why(tmp_path, records, message):
    with pytest.raises(QADataError, match=message):
        load_qa(write_jsonl(tmp_path / "nq.jsonl", records))


def test_bad_json_line_names_the_line(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n{oops\n', encoding="utf-8")
    with pytest.raises(QADataError, match=r"nq.jsonl:2"):
        load_qa(path)
