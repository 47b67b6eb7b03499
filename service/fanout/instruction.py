"""What a pretrained chat LLM reads and may write as the fan-out policy (the `llm/` route): an
instruction per mode, one hand-written example turn, and a GBNF grammar for its answer.

Modes: "names" (k of the prompt's catalog names), "free" (k kinds of the query from what the
model knows), "multiquery" (LangChain MultiQueryRetriever's prompt: the peers' baseline). The
examples are no benchmark query, their answers written by hand, not from any label.
"""

from __future__ import annotations

from collections.abc import Sequence

LLM_MODES = ("names", "free", "multiquery")
MULTIQUERY_LINES = 3  # LangChain's default number of alternative questions

# (query, its candidate names, a hand-written answer): neither query is a benchmark query
EXAMPLES = (
    ("camping gear",
     ("tent", "sleeping bag", "camp stove", "camping", "backpack", "lantern", "camp chair",
      "headlamp", "gear", "water filter", "hiking boot", "compass", "camp bed", "cooler"),
     ("tent", "sleeping bag", "camp stove", "backpack", "lantern", "headlamp", "water filter",
      "hiking boot", "compass", "cooler")),
    ("office supplies",
     ("office", "stapler", "office building", "paper clip", "supply", "pencil", "supplier",
      "notebook", "envelope", "office block", "tape", "scissors", "calculator", "folder",
      "supply chain", "marker"),
     ("stapler", "paper clip", "pencil", "notebook", "envelope", "tape", "scissors",
      "calculator", "folder", "marker")),
)
MAX_NAME_CHARS = 32  # a free line is a short item name, not a sentence
MAX_QUESTION_CHARS = 120  # a multiquery line is a question

NAMES_TASK = (
    "A search engine must return {k} items that together cover the query's different kinds, "
    "not {k} near-duplicates. From the candidates below, choose the {k} that cover the most "
    "different kinds of \"{query}\". Answer with exactly {k} candidate names, one per line, "
    "nothing else.\n\nQuery: {query}\nCandidates: {names}"
)
FREE_TASK = (
    "A search engine must return {k} items that together cover the query's different kinds, "
    "not {k} near-duplicates. Name {k} different kinds or parts of \"{query}\", each as a short "
    "catalog item name. Answer with exactly {k} names, one per line, nothing else.\n\n"
    "Query: {query}"
)
# langchain.retrievers.multi_query.DEFAULT_QUERY_PROMPT
MULTIQUERY_TASK = (
    "You are an AI language model assistant. Your task is to generate {k} different versions of "
    "the given user question to retrieve relevant documents from a vector database. By "
    "generating multiple perspectives on the user question, your goal is to help the user "
    "overcome some of the limitations of distance-based similarity search. Provide these "
    "alternative questions separated by newlines. Original question: {query}"
)


def mode_lines(mode: str, k: int) -> int:
    """How many lines a fan-out of `mode` holds."""
    return MULTIQUERY_LINES if mode == "multiquery" else k


def task(mode: str, query: str, names: Sequence[str], k: int) -> str:
    """One user turn of `mode` for `query` (names: the prompt's candidates, names mode only)."""
    if mode not in LLM_MODES:
        raise ValueError(f"unknown LLM fan-out mode {mode!r}; use one of {LLM_MODES}")
    template = {"names": NAMES_TASK, "free": FREE_TASK, "multiquery": MULTIQUERY_TASK}[mode]
    return template.format(k=mode_lines(mode, k), query=query, names="; ".join(names))


def messages(mode: str, query: str, names: Sequence[str], k: int) -> list[dict[str, str]]:
    """The chat: the hand-written example turns (none for multiquery, as LangChain sends none),
    then the query's turn. The shared prefix lets llama.cpp reuse its cache across queries."""
    turn = {"role": "user", "content": task(mode, query, names, k)}
    if mode == "multiquery":
        return [turn]
    shots = []
    for example, candidates, answer in EXAMPLES:
        shots += [{"role": "user", "content": task(mode, example, candidates, len(answer))},
                  {"role": "assistant", "content": "\n".join(answer)}]
    return [*shots, turn]


def transcript(mode: str, query: str, names: Sequence[str], k: int) -> str:
    """`messages` as one plain text for a model without a chat template (a base model
    continues the example's pattern)."""
    return "".join(f"{t['content']}\nAnswer:\n" if t["role"] == "user" else
                   f"{t['content']}\n\n" for t in messages(mode, query, names, k))


def distinct_names(names: Sequence[str]) -> list[str]:
    """The names a line may be, whitespace-normalised, each once, in order."""
    return list(dict.fromkeys(" ".join(name.split()) for name in names if name.strip()))


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'


def grammar(mode: str, names: Sequence[str], k: int) -> str:
    """GBNF for exactly `mode_lines(mode, k)` lines: each one of `names` (names mode) or free
    text. Without names, names mode falls back to free lines."""
    n = mode_lines(mode, k)
    if mode == "names" and names:
        line = " | ".join(gbnf_literal(name) for name in distinct_names(names))
    else:  # a name: no sentence punctuation; a question: any text; neither a special token
        chars = MAX_QUESTION_CHARS if mode == "multiquery" else MAX_NAME_CHARS
        rest = "[^\\n\\r<>]" if mode == "multiquery" else "[^\\n\\r<>.:;!?()]"
        line = f'[^\\n\\r\\t<> ] {rest}{{0,{chars - 1}}}'
    return "root ::= " + " ".join(['line "\\n"'] * (n - 1) + ["line"]) + f"\nline ::= {line}\n"
