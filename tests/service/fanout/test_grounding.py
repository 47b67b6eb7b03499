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


def test_shared_names_ground_to_their_nearest_member_for_a_whole_batch_at_once() -> None:
    """named_rows for many (name, query) pairs equals a per-pair scan of the name's members,
    the first of them on an exact tie."""
    rng = np.random.default_rng(0)
    names = [f"name{i % 7}" for i in range(40)]  # 7 names, each shared by 5-6 items
    texts = [f"{name}: gloss {i}" for i, name in enumerate(names)]
    emb = rng.standard_normal((40, 8)).astype(np.float32)
    emb[21] = emb[14]  # name0's members 14 and 21 tie exactly
    grounding = NameGrounding([*texts, "solo: one item"], np.vstack([emb, emb[:1]]))
    queries = rng.standard_normal((5, 8)).astype(np.float32)
    queries[4] = emb[14]
    ids = np.array([grounding.name_id(f"name{i % 7}") for i in range(30)] +
                   [grounding.name_id("solo"), -1, grounding.name_id("name0")])  # (33,)
    owners = np.array([i % 5 for i in range(32)] + [4])
    members = {n: [r for r, m in enumerate(names) if m == n] for n in set(names)}
    expected = []
    for i, owner in zip(range(33), owners, strict=True):
        if i == 30:
            expected.append(40)  # the only item named "solo"
        elif i == 31:
            expected.append(-1)  # no name
        else:
            rows = members[f"name{i % 7}" if i < 30 else "name0"]
            scores = [emb[r].astype(np.float64) @ queries[owner] for r in rows]
            expected.append(rows[int(np.argmax(scores))])
    assert grounding.named_rows(ids, queries, owners).tolist() == expected
    assert expected[-1] == 14  # the tie went to the first member

