"""Sub-query grounding: a catalog name is its item; other text is embedded."""

from __future__ import annotations

import numpy as np

from service.grounding import NameGrounding

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
