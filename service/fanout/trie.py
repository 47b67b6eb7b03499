"""Catalog-name decoding: a token-level prefix tree that keeps every fan-out line an item name.

As in generative retrieval (GENRE, TIGER), a line grows only along the tree and ends only where
a name ends, and a name already written cannot end again; both runtimes use `name_grammar`.
Hand-written: the names change with every prompt, and guided-decoding libraries compile an
automaton per pattern, while a prompt's trie costs a few hundred tokens and stays numpy-only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.fanout.format import prompt_context

# How fan-out lines are decoded: "free" (no constraint), "lines" (exactly k non-empty lines,
# service.fanout.decoding.line_grammar), "context" (each line one of the names in the prompt's
# catalog
# line) or "catalog" (each line any catalog item's name).
DECODINGS = ("free", "lines", "context", "catalog")
NAME_SCOPES = ("context", "catalog")
ROOT = 0
DEAD = -1  # a row whose tokens left the tree (only rows decoded without the mask)


def newline_id(tokenizer: Any) -> int:
    """The one token id a `tokenizers.Tokenizer` writes a line break as."""
    ids = tokenizer.encode("\n", add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(f"the tokenizer writes a line break as {len(ids)} tokens")
    return int(ids[0])


@dataclass
class RowState:
    """Where one row stands: its tree node, the names it has written and how many lie below
    each node (a subtree whose names are all written is closed to the row)."""

    node: int = ROOT
    used: set[int] = field(default_factory=set)
    used_below: dict[int, int] = field(default_factory=dict)


class NameTrie:
    """Prefix tree over the token ids of each name (one name = one fan-out line)."""

    def __init__(self, sequences: Iterable[Sequence[int]], newline: int, eos: int) -> None:
        self.newline, self.eos = int(newline), int(eos)
        self.children: list[dict[int, int]] = [{}]
        self.parent: list[int] = [DEAD]
        self.terminal: list[bool] = [False]
        for seq in sequences:
            if not seq or self.newline in seq or self.eos in seq:
                continue
            node = ROOT
            for token in seq:
                node = self._child(node, int(token))
            self.terminal[node] = True
        self.names_below = np.zeros(len(self.children), dtype=np.int64)  # (N,) names per subtree
        for node in np.flatnonzero(self.terminal):
            for up in self._path(int(node)):
                self.names_below[up] += 1
        self._allowed: dict[int, np.ndarray] = {}

    def _child(self, node: int, token: int) -> int:
        child = self.children[node].get(token)
        if child is None:
            child = len(self.children)
            self.children[node][token] = child
            self.children.append({})
            self.parent.append(node)
            self.terminal.append(False)
        return child

    def _path(self, node: int) -> list[int]:
        """`node` and its ancestors up to the root."""
        path = []
        while node != DEAD:
            path.append(node)
            node = self.parent[node]
        return path

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, names: Iterable[str], eos: int) -> NameTrie:
        """A `tokenizers.Tokenizer`'s ids of each distinct name, without special tokens."""
        distinct = sorted({" ".join(n.split()) for n in names} - {""})
        encoded = tokenizer.encode_batch(distinct, add_special_tokens=False)
        return cls((e.ids for e in encoded), newline_id(tokenizer), eos)

    def __len__(self) -> int:
        return len(self.children)

    def allowed(self, state: RowState) -> np.ndarray:
        """(n,) int64: the tokens that continue a name the row has not written yet."""
        children = self.children[state.node]
        if state.used_below:
            open_ = [t for t, c in children.items()
                     if self.names_below[c] > state.used_below.get(c, 0)]
            if open_ or not self.can_end(state):  # all written: repeat rather than stall
                return np.asarray(open_ or list(children), dtype=np.int64)
            return np.zeros(0, dtype=np.int64)
        if state.node not in self._allowed:
            self._allowed[state.node] = np.fromiter(children, dtype=np.int64)
        return self._allowed[state.node]

    def advance(self, state: RowState, token: int) -> None:
        """Move a row by one generated token (a line break returns it to the root)."""
        if token == self.newline:
            if state.node != DEAD and self.terminal[state.node] and state.node not in state.used:
                state.used.add(state.node)
                for up in self._path(state.node):
                    state.used_below[up] = state.used_below.get(up, 0) + 1
            state.node = ROOT
        elif state.node != DEAD:
            state.node = self.children[state.node].get(int(token), DEAD)

    def replay(self, tokens: Iterable[int]) -> RowState:
        """The state after a completion's tokens (for processors that see whole rows)."""
        state = RowState()
        for token in tokens:
            self.advance(state, int(token))
        return state

    def can_end(self, state: RowState) -> bool:
        """A line may end here: a whole name, not yet written (or nowhere else to go)."""
        if state.node == DEAD or not self.terminal[state.node]:
            return False
        return state.node not in state.used or not self.children[state.node]


def name_grammar(logits: np.ndarray, tries: Sequence[NameTrie | None],
                 states: Sequence[RowState], lines: np.ndarray, stop: int) -> np.ndarray:
    """Logits (B, V) with every token that would leave the catalog's names at −inf (a copy).

    A row continues its name, or at a name's end breaks the line (<eos> on the last of `stop`
    lines). `tries`: each row's tree (None: none); `lines` (B,): each row's line breaks. Rows
    without a tree and dead rows are left as they are.
    """
    masked = np.full(logits.shape, -np.inf, dtype=np.float32)  # (B, V)
    vocab = logits.shape[1]
    for i, (trie, state) in enumerate(zip(tries, states, strict=True)):
        if trie is None or state.node == DEAD:
            masked[i] = logits[i]
            continue
        allowed = trie.allowed(state)
        if trie.can_end(state):
            ends = [trie.newline, trie.eos] if lines[i] >= stop - 1 else [trie.newline]
            allowed = np.append(allowed, ends)
        allowed = allowed[allowed < vocab]
        masked[i, allowed] = logits[i, allowed]
    return masked


class NameConstraint:
    """The tree each prompt decodes through: its own catalog line's names ("context"), or every
    catalog name ("catalog"). Context trees are small (16 names) and cached by their names."""

    def __init__(self, tokenizer: Any, eos: int, scope: str = "context",
                 catalog_names: Iterable[str] = (), cache_size: int = 4096) -> None:
        if scope not in NAME_SCOPES:
            raise ValueError(f"name scope must be one of {NAME_SCOPES}, got {scope!r}")
        self.tokenizer, self.eos, self.scope = tokenizer, int(eos), scope
        self.cache_size = cache_size
        self.newline = newline_id(tokenizer)
        self.catalog = NameTrie.from_tokenizer(tokenizer, catalog_names, eos) \
            if scope == "catalog" else None
        if self.catalog is not None and not self.catalog.children[ROOT]:
            raise ValueError("catalog decoding needs the catalog's item names")
        self._cache: OrderedDict[tuple[str, ...], NameTrie] = OrderedDict()

    def tries(self, prompts: Sequence[str]) -> list[NameTrie | None]:
        """One tree per prompt; None for a "context" prompt that carries no names (it decodes
        under the line grammar alone)."""
        if self.catalog is not None:
            return [self.catalog] * len(prompts)
        return [self._context(tuple(prompt_context(p))) for p in prompts]

    def _context(self, names: tuple[str, ...]) -> NameTrie | None:
        if not names:
            return None
        trie = self._cache.get(names)
        if trie is None:
            trie = NameTrie.from_tokenizer(self.tokenizer, names, self.eos)
            self._cache[names] = trie
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(names)
        return trie
