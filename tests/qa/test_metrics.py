"""EM / F1 with SQuAD normalisation, on hand-checked cases."""

from __future__ import annotations

import pytest

from services.qa.metrics import cover_em, exact_match, f1_score, normalize_answer, score_table


@pytest.mark.parametrize(
    "raw,normalised",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple, a day ", "apple day"),
        ("Guido van Rossum.", "guido van rossum"),
        ("U.S.A.", "usa"),
        ("theater", "theater"),  # 'the' only as a word
    ],
)
def test_normalize(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_exact_match_any_gold():
    assert exact_match("the Pancreas.", ["liver", "pancreas"]) == 1.0
    assert exact_match("pancreas gland", ["pancreas"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0


def test_f1_hand_checked():
    # prediction tokens [alexander, fleming, scotland], gold [alexander, fleming]: P=2/3, R=1 → 0.8
    assert f1_score("Alexander Fleming, Scotland", ["Alexander Fleming"]) == pytest.approx(0.8)
    # best over golds: 'edo' matches the second exactly
    assert f1_score("Edo", ["Tokyo", "Edo"]) == 1.0
    # no shared token
    assert f1_score("Paris", ["Bonn"]) == 0.0
    # repeated tokens count once per occurrence: pred [bonn, bonn], gold [bonn] → P=1/2, R=1 → 2/3
    assert f1_score("Bonn Bonn", ["Bonn"]) == pytest.approx(2 / 3)
    # yes/no must match exactly
    assert f1_score("yes it is", ["yes"]) == 0.0


def test_cover_em_is_substring():
    assert cover_em("It was Alexander Fleming in 1928", ["Alexander Fleming"]) == 1.0
    assert exact_match("It was Alexander Fleming in 1928", ["Alexander Fleming"]) == 0.0


def test_table_per_dataset_and_average():
    table = score_table(
        [
            ("nq", "Paris", ["Paris"]),
            ("nq", "Rome", ["Paris"]),  # nq: EM 50
            ("popqa", "Bonn", ["Bonn"]),  # popqa: EM 100
            ("popqa", None, ["x"]),
            ("popqa", "x", ["X"]),
            ("popqa", "y", ["z"]),  # popqa: 2/4 = 50
        ]
    )
    by_name = {r.dataset: r for r in table.rows}
    assert by_name["nq"].em == pytest.approx(50.0)
    assert by_name["popqa"].em == pytest.approx(50.0)
    assert by_name["popqa"].answered == pytest.approx(75.0)
    assert table.average.em == pytest.approx(50.0)  # unweighted mean of datasets
    assert table.average.n == 6
    assert "| **average** | 6 | 50.00" in table.markdown()
