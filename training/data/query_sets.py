"""The evaluation's query sets: `broad` (the benchmark splits), `narrow` and `mixed`.

A real service mostly gets narrow queries, which name one item ("golden retriever"); ten
complementary items are worse for them than the item and its close kin. WordNet default: a
narrow query is a noun synset with at most NARROW_MAX_DESCENDANTS descendants whose first lemma
names no other noun synset and is not a proper noun (so "the exact item" is well defined); its
text is that lemma, its `target` the synset, and each of the synset and its descendants is a
reference group of its own (coverage@10 = recall@10 of the item and its kin). Narrow queries
are drawn with a fixed seed, NARROW_PER_SPLIT for val and as many for test. `mixed-<split>`
mixes the broad split with narrow queries, MIXED_NARROW_SHARE of the whole, shuffled.

Split names: "train", "val", "test" (broad), "narrow-val", "narrow-test", "mixed-val",
"mixed-test". The hierarchy is for evaluation only, as with the broad splits.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from service.errors import InputError
from training.data.splits import SPLITS, BenchmarkQuery, load_split
from training.data.wordnet import Synset, descendant_counts, descendants, load_nouns

NARROW_MAX_DESCENDANTS = 5
NARROW_PER_SPLIT = 300
MIXED_NARROW_SHARE = 0.7
HELD_OUT = ("val", "test")
EVAL_SPLITS = (*SPLITS, *(f"{kind}-{split}" for kind in ("narrow", "mixed")
                          for split in HELD_OUT))
SEED = 0


def narrow_queries(synsets: dict[str, Synset], catalog_ids: set[str]) -> list[BenchmarkQuery]:
    """Every narrow query whose item and descendants are all in the catalog, in offset order."""
    counts = descendant_counts(synsets)
    senses = Counter(lemma.lower() for synset in synsets.values() for lemma in synset.lemmas)
    queries = []
    for offset, synset in synsets.items():
        lemma = synset.lemmas[0]
        if counts[offset] > NARROW_MAX_DESCENDANTS or senses[lemma.lower()] != 1 \
                or not lemma[:1].islower() or offset not in catalog_ids:
            continue
        kin = sorted(descendants(synsets, offset))
        if catalog_ids.issuperset(kin):
            queries.append(BenchmarkQuery(query=lemma, groups=[[offset]] + [[d] for d in kin],
                                          id=offset, target=offset))
    return queries


def narrow_split(queries: list[BenchmarkQuery], split: str,
                 seed: int = SEED) -> list[BenchmarkQuery]:
    """The split's NARROW_PER_SPLIT queries (fewer in a small catalog), disjoint across splits."""
    order = np.random.default_rng(seed).permutation(len(queries))
    per_split = min(NARROW_PER_SPLIT, len(queries) // len(HELD_OUT))
    start = HELD_OUT.index(split) * per_split
    return [queries[i] for i in order[start : start + per_split]]


def mix(broad: list[BenchmarkQuery], narrow: list[BenchmarkQuery],
        seed: int = SEED) -> list[BenchmarkQuery]:
    """All of `broad` and enough of `narrow` to make MIXED_NARROW_SHARE of the whole, shuffled."""
    n_narrow = min(len(narrow), round(len(broad) * MIXED_NARROW_SHARE / (1 - MIXED_NARROW_SHARE)))
    queries = [*broad, *narrow[:n_narrow]]
    return [queries[i] for i in np.random.default_rng(seed).permutation(len(queries))]


def catalog_ids(bundle_dir: Path) -> set[str]:
    with (bundle_dir / "items.jsonl").open(encoding="utf-8") as lines:
        return {json.loads(line)["id"] for line in lines if line.strip()}


def load_queries(bundle_dir: Path, split: str) -> list[BenchmarkQuery]:
    """The queries of an evaluation split (EVAL_SPLITS), with their references."""
    if split not in EVAL_SPLITS:
        raise InputError(f"split must be one of {EVAL_SPLITS}, got {split!r}")
    kind, _, held_out = split.rpartition("-")
    if not kind:
        return load_split(bundle_dir, split)
    narrow = narrow_split(narrow_queries(load_nouns(), catalog_ids(bundle_dir)), held_out)
    if not narrow:
        raise InputError(f"no narrow queries in {bundle_dir}: narrow and mixed splits are "
                         "derived from WordNet, and the catalog holds no WordNet synsets")
    return narrow if kind == "narrow" else mix(load_split(bundle_dir, held_out), narrow)
