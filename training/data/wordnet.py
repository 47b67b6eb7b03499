"""WordNet 3.0 noun synsets parsed from Debian's `wordnet-base` (`data.noun`).

The hyponym graph is kept for the benchmark's reference sets (evaluation only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = Path("/usr/share/wordnet")
HYPONYM_POINTERS = ("~", "~i")  # hyponym and instance hyponym
N_NOUN_SYNSETS = 82_115


@dataclass
class Synset:
    offset: str  # 8-digit byte offset in data.noun, the synset's id
    lemmas: list[str]
    gloss: str
    hyponyms: list[str] = field(default_factory=list)

    @property
    def first_clause(self) -> str:
        """The gloss up to its first ';' (examples and second senses follow it)."""
        return self.gloss.split(";", 1)[0].strip()

    def text(self, max_lemmas: int = 3) -> str:
        """Catalog text: "lemma1, lemma2, lemma3: first clause of the gloss"."""
        return f"{', '.join(self.lemmas[:max_lemmas])}: {self.first_clause}"


def wordnet_dir() -> Path:
    return Path(os.environ.get("R4T_WORDNET_DIR", DEFAULT_DIR))


def parse_line(line: str) -> Synset:
    """One data.noun record: offset lex_filenum ss_type w_cnt (word lex_id)* p_cnt ptrs | gloss."""
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    offset = fields[0]
    n_words = int(fields[3], 16)
    words = fields[4 : 4 + 2 * n_words : 2]
    lemmas = [w.replace("_", " ") for w in words]
    pos = 4 + 2 * n_words
    n_ptrs = int(fields[pos])
    hyponyms = []
    for i in range(n_ptrs):
        symbol, target, target_pos = fields[pos + 1 + 4 * i : pos + 4 + 4 * i]
        if symbol in HYPONYM_POINTERS and target_pos == "n":
            hyponyms.append(target)
    return Synset(offset=offset, lemmas=lemmas, gloss=gloss.strip(), hyponyms=hyponyms)


def load_nouns(directory: Path | None = None) -> dict[str, Synset]:
    """All noun synsets by offset, in file order."""
    path = (directory or wordnet_dir()) / "data.noun"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: install Debian's wordnet-base (apt-get install wordnet-base) "
            "or set R4T_WORDNET_DIR"
        )
    synsets: dict[str, Synset] = {}
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.startswith("  "):  # licence header
                continue
            synset = parse_line(line.rstrip("\n"))
            synsets[synset.offset] = synset
    return synsets


def descendants(synsets: dict[str, Synset], root: str) -> set[str]:
    """Every synset below `root` through hyponym links (root excluded)."""
    seen: set[str] = set()
    stack = list(synsets[root].hyponyms)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(synsets[node].hyponyms)
    return seen


def descendant_counts(synsets: dict[str, Synset]) -> dict[str, int]:
    """Number of distinct descendants of every synset (memoised sets, bottom-up)."""
    memo: dict[str, frozenset[str]] = {}

    def below(node: str) -> frozenset[str]:
        if node in memo:
            return memo[node]
        stack = [(node, iter(synsets[node].hyponyms))]
        while stack:  # iterative post-order, the graph is ~20 levels deep but wide
            current, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                acc: set[str] = set()
                for c in synsets[current].hyponyms:
                    acc.add(c)
                    acc |= memo[c]
                memo[current] = frozenset(acc)
            elif child not in memo:
                stack.append((child, iter(synsets[child].hyponyms)))
        return memo[node]

    return {offset: len(below(offset)) for offset in synsets}
