"""The broad-query benchmark: queries with reference sets grouped into branches.

WordNet default: every noun synset with 50–2000 hyponym descendants is a broad query (its
first lemma is the text); its reference set is its descendants, grouped by its direct
hyponym branches. A user's benchmark is JSONL {"query": str, "groups": [[item ids], ...]}
(groups optional; "target": the one item the query names, for a narrow query's hit@1). Splits
are deterministic by query text (about 80/10/10, fixed seed): the senses of one text share
a split.

Label-free stages read the query texts only (`query_texts`). The one supervised stage, the
ranker, learns from the train queries' groups (a team's click or judgment logs), never from a
held-out item: WordNet's broad queries nest, and most held-out items sit in some train query's
groups, so a train query either shares no item with val or test (`disjoint_train`) or has its
held-out items masked out (`masked_train`, the ranker's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from service.errors import CatalogError, InputError
from training.data.wordnet import Synset, descendant_counts, descendants, load_nouns

SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
SPLIT_RULE = "by-text"  # the queries sharing a text share a split (the benchmark key holds it)
MIN_DESCENDANTS, MAX_DESCENDANTS = 50, 2000
BENCHMARK_DIR = "benchmark"


@dataclass
class BenchmarkQuery:
    query: str
    groups: list[list[str]] = field(default_factory=list)
    id: str | None = None
    target: str | None = None  # the item a narrow query names (training.data.query_sets)

    @property
    def reference(self) -> set[str]:
        return {item for group in self.groups for item in group}

    def to_json(self) -> str:
        record = {"query": self.query, "groups": self.groups}
        if self.id is not None:
            record["id"] = self.id
        if self.target is not None:
            record["target"] = self.target
        return json.dumps(record)


def wordnet_queries(synsets: dict[str, Synset] | None = None) -> list[BenchmarkQuery]:
    """The 923 broad WordNet noun queries, in synset-offset order."""
    synsets = synsets or load_nouns()
    counts = descendant_counts(synsets)
    queries = []
    for offset, synset in synsets.items():
        if MIN_DESCENDANTS <= counts[offset] <= MAX_DESCENDANTS:
            groups = [[child, *sorted(descendants(synsets, child))] for child in synset.hyponyms]
            queries.append(BenchmarkQuery(query=synset.lemmas[0], groups=groups, id=offset))
    return queries


def split_queries(queries: list[BenchmarkQuery], seed: int) -> dict[str, list[BenchmarkQuery]]:
    """Shuffle the distinct query texts with a fixed seed and cut about 80/10/10 by query count:
    the queries that share a text (case-insensitively; WordNet's senses of one lemma) land in
    one split, so no val or test text is a training text. The same input gives the same split."""
    by_text: dict[str, list[BenchmarkQuery]] = {}
    for query in queries:
        by_text.setdefault(query.query.strip().lower(), []).append(query)
    texts = list(by_text)
    order = np.random.default_rng(seed).permutation(len(texts))
    n_train = round(SPLIT_FRACTIONS[0] * len(queries))
    n_val = round(SPLIT_FRACTIONS[1] * len(queries))
    splits: dict[str, list[BenchmarkQuery]] = {name: [] for name in SPLITS}
    for i in order:
        taken = len(splits["train"]), len(splits["val"])
        name = "train" if taken[0] < n_train else "val" if taken[1] < n_val else "test"
        splits[name].extend(by_text[texts[i]])
    return splits


def read_benchmark_file(path: Path, known_ids: set[str] | None = None) -> list[BenchmarkQuery]:
    """A user's benchmark JSONL; unknown item ids are an error naming the line."""
    if not path.is_file():
        raise CatalogError(f"benchmark file not found: {path}")
    queries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CatalogError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
        text = record.get("query") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise CatalogError(f"{path}:{number}: 'query' is missing or empty")
        groups = [[str(i) for i in group] for group in record.get("groups", [])]
        unknown = {i for g in groups for i in g} - known_ids if known_ids is not None else set()
        if unknown:
            raise CatalogError(f"{path}:{number}: unknown item ids {sorted(unknown)[:5]}")
        target = record.get("target")
        if target is not None and known_ids is not None and str(target) not in known_ids:
            raise CatalogError(f"{path}:{number}: unknown target id {target!r}")
        queries.append(BenchmarkQuery(query=text.strip(), groups=groups, id=record.get("id"),
                                      target=None if target is None else str(target)))
    return queries


def write_splits(splits: dict[str, list[BenchmarkQuery]], directory: Path) -> list[str]:
    """Write benchmark/<split>.jsonl files; returns their paths relative to `directory`."""
    (directory / BENCHMARK_DIR).mkdir(parents=True, exist_ok=True)
    names = []
    for split, queries in splits.items():
        name = f"{BENCHMARK_DIR}/{split}.jsonl"
        (directory / name).write_text("".join(q.to_json() + "\n" for q in queries))
        names.append(name)
    return names


def load_split(bundle_dir: Path, split: str) -> list[BenchmarkQuery]:
    """Queries with their reference groups: evaluation's, and the ranker's via
    `disjoint_train`."""
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, got {split!r}")
    path = bundle_dir / BENCHMARK_DIR / f"{split}.jsonl"
    return [_from_record(json.loads(line)) for line in path.read_text().splitlines() if line]


def held_out_items(bundle_dir: Path) -> set[str]:
    """Every item of a val or test query's groups, and those queries' own ids."""
    return set().union(*(_items(q) for split in ("val", "test")
                         for q in load_split(bundle_dir, split)))


def disjoint_train(bundle_dir: Path) -> list[BenchmarkQuery]:
    """The train queries whose items (and own id) appear in no val or test query."""
    held = held_out_items(bundle_dir)
    return [q for q in load_split(bundle_dir, "train") if q.groups and not _items(q) & held]


def masked_train(bundle_dir: Path) -> list[BenchmarkQuery]:
    """Every labeled train query that is no held-out item itself, its groups without the
    held-out items (a group left empty dropped): each train subtree cut where a val or test
    subtree starts, so no held-out item is ever a label, and far more queries than
    `disjoint_train` keeps."""
    held = held_out_items(bundle_dir)
    masked = []
    for query in load_split(bundle_dir, "train"):
        groups = [kept for group in query.groups if (kept := [i for i in group if i not in held])]
        if groups and query.id not in held:
            masked.append(BenchmarkQuery(query.query, groups, query.id, query.target))
    return masked


def _items(query: BenchmarkQuery) -> set[str]:
    return query.reference | ({query.id} if query.id else set())


def query_texts(bundle_dir: Path, split: str = "train") -> list[str]:
    """The only view of the benchmark that training code may take: the query texts."""
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, got {split!r}")
    path = bundle_dir / BENCHMARK_DIR / f"{split}.jsonl"
    return [json.loads(line)["query"] for line in path.read_text().splitlines() if line]


def training_queries(bundle_dir: Path, names: list[str], n_extra: int, seed: int,
                     breadth: np.ndarray | None = None) -> list[str]:
    """Train-split query texts plus `n_extra` catalog names that are no val/test query, drawn
    uniformly, or with `breadth` (per name: the texts holding it) ∝ log(1 + breadth)."""
    train = query_texts(bundle_dir, "train")
    held_out = {t.lower() for split in ("val", "test") for t in query_texts(bundle_dir, split)}
    seen = held_out | {t.lower() for t in train}
    candidates = sorted({n for n in names if n and n.lower() not in seen})
    rng = np.random.default_rng(seed)
    if breadth is None:
        picked = rng.choice(len(candidates), size=min(n_extra, len(candidates)), replace=False)
    else:
        widest: dict[str, int] = {}
        for name, wide in zip(names, breadth.tolist(), strict=True):
            widest[name] = max(widest.get(name, 0), wide)
        weight = np.log1p([widest[c] for c in candidates])  # (N,)
        size = min(n_extra, int((weight > 0).sum()))
        picked = rng.choice(len(candidates), size=size, replace=False,
                            p=weight / weight.sum()) if size else []
    return [*train, *[candidates[i] for i in sorted(picked)]]


def _from_record(record: dict) -> BenchmarkQuery:
    return BenchmarkQuery(query=record["query"], groups=record.get("groups", []),
                          id=record.get("id"), target=record.get("target"))
