"""The shared dry-run plan parser (tests/wf.py): a plan, "Nothing to be done", or an error."""

from __future__ import annotations

import pytest
from wf import PlanError, parse_plan

PLAN = """Building DAG of jobs...
Job stats:
job        count
-------  -------
all            1
capture        2
train          1
total          4

Reasons:
"""


def test_a_plan_is_counted_per_rule():
    assert parse_plan(PLAN) == {"all": 1, "capture": 2, "train": 1}


def test_nothing_to_be_done_is_an_empty_plan():
    text = "Building DAG of jobs...\nNothing to be done (all requested files are present and up to date).\n"
    assert parse_plan(text) == {}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "WorkflowError: something broke\n",
        "Job stats:\njob count\n------- -------\n",  # a table without rows
        PLAN.replace("total          4", "total          5"),  # rows that do not add up
    ],
)
def test_anything_else_raises(text):
    with pytest.raises(PlanError):
        parse_plan(text)
