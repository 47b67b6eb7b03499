"""Sub-query grounding: a catalog name is its item; other text is embedded."""

from __future__ import annotations

import numpy as np

from service.fanout.candidates import Candidates
from service.fanout.grounding import NameGrounding

TEXTS = ["Bass: the lowest part in polyphonic music", "bass, sea bass: a marine fish",
         "tent: a portable shelter", "stove: a kitchen appliance"]
EMB = np.eye(4, dtype=np.float32)  # item i's embedding is e_i


def encode(texts: list[str]) -> np.ndarray:
    return np.full((len(texts), 4), 0.5, dtype=np.float32)  # any text: the same vector


def test_a_name_is_its_item_and_shared_names_follow_the_query() -> None:
    grounding = NameGrounding(TEXTS, EMB)
    queries = np.array([[0.9, 0.1, 0, 0], [0.1, 0.9, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
                       dtype=np.float32)
    probes, rows = grounding.probes([" BASS ", "bass", "tent", "a warm stove"], queries, encode)
    assert rows.tolist() == [0, 1, 2, -1]  # case and spacing aside; the music query's bass
    np.testing.assert_array_equal(probes[:3], EMB[[0, 1, 2]])
    np.testing.assert_array_equal(probes[3], encode(["x"])[0])  # not a name: embedded
    assert "Tent" in grounding and "sea bass" not in grounding  # first lemmas only


def test_no_text_calls_no_encoder() -> None:
    def refuse(texts: list[str]) -> np.ndarray:
        raise AssertionError("encoded")

    probes, rows = NameGrounding(TEXTS, EMB).probes(["tent"], EMB[[2]], refuse)
    assert rows.tolist() == [2] and probes.shape == (1, 4)


def test_prompt_neighbourhood_is_the_items_the_prompt_names_in_its_order() -> None:
    from service.fanout.format import PromptBuilder, item_names, prompt_context
    from service.fanout.grounding import PromptNeighbourhood
    from service.runtime.index import build_index

    texts = ["tent: a shelter", "Tent, pavilion: a big one", "stove: a cooker",
             "camping: living outdoors", "lamp: a light", "bass: a fish"]
    emb = np.eye(6, dtype=np.float32)
    query = np.array([[0.3, 0.25, 0.2, 0.5, 0.1, 0.0]], dtype=np.float32)
    query /= np.linalg.norm(query)
    prompt = PromptNeighbourhood(Candidates(build_index(emb)), texts, emb, 3)
    rows = prompt.rows(["camping"], query)
    # nearest first: camping (the query's own name, skipped), tent, Tent (same name), stove
    assert rows.tolist() == [[0, 2, 4]]
    builder = PromptBuilder(Candidates(build_index(emb)), texts, 3)
    names = prompt_context(builder.prompts(["camping"], query)[0])
    assert [item_names(texts)[r] for r in rows[0]] == names == ["tent", "stove", "lamp"]
    wide = PromptNeighbourhood(Candidates(build_index(emb)), texts, emb, 7).rows(["camping"], query)
    assert wide.tolist() == [[0, 2, 4, 5, 0, 2, 4]]  # four distinct names, repeated in order
