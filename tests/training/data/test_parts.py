import numpy as np

from training.data.parts import PART_NAMES, embed_parts, part_texts


def test_a_described_item_s_parts():
    parts = dict(zip(PART_NAMES, part_texts(
        "tent, collapsible shelter: a portable shelter (usually of canvas) stretched over "
        "supporting poles"), strict=True))
    assert parts == {
        "names": "tent, collapsible shelter", "first": "tent", "head": "tent",
        "description": "a portable shelter (usually of canvas) stretched over supporting poles",
        "description3": "a portable shelter", "description6": "a portable shelter (usually of "
                                                              "canvas)"}


def test_a_bare_name_has_no_description_and_its_head_is_its_last_word():
    parts = dict(zip(PART_NAMES, part_texts("Camping Sleeping Bags"), strict=True))
    assert parts["first"] == "Camping Sleeping Bags" and parts["head"] == "bags"
    assert parts["description"] == parts["description3"] == ""


def test_an_absent_part_embeds_to_zeros():
    def embed(texts: list[str], desc: str) -> np.ndarray:
        return np.ones((len(texts), 4), dtype=np.float32)

    vectors = embed_parts(["shelter: a tent", "tent"], 4, embed)
    assert vectors.shape == (2, len(PART_NAMES), 4) and vectors.dtype == np.float16
    described = PART_NAMES.index("description")
    assert vectors[0, described].sum() == 4 and vectors[1, described].sum() == 0
