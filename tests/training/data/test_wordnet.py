from training.data.splits import split_queries, wordnet_queries
from training.data.wordnet import N_NOUN_SYNSETS, descendants, parse_line

LINE = (
    "02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 003 @ 02083346 n 0000 "
    "~ 01322604 n 0000 ~i 09999999 n 0000 | a member of the genus Canis; \"the dog barked\""
)


def test_parse_line():
    synset = parse_line(LINE)
    assert synset.offset == "02084071"
    assert synset.lemmas == ["dog", "domestic dog", "Canis familiaris"]
    assert synset.hyponyms == ["01322604", "09999999"]
    assert synset.text() == "dog, domestic dog, Canis familiaris: a member of the genus Canis"


def test_default_catalog_size(wordnet_synsets):
    assert len(wordnet_synsets) == N_NOUN_SYNSETS


def test_broad_queries_and_their_groups(wordnet_synsets):
    queries = wordnet_queries(wordnet_synsets)
    assert len(queries) == 923
    q = queries[0]
    assert 50 <= len(q.reference) <= 2000
    assert q.reference == descendants(wordnet_synsets, q.id)
    assert len(q.groups) == len(wordnet_synsets[q.id].hyponyms)


def test_split_is_deterministic_disjoint_and_80_10_10(wordnet_synsets):
    queries = wordnet_queries(wordnet_synsets)
    a, b = split_queries(queries, seed=0), split_queries(queries, seed=0)
    assert [q.id for q in a["test"]] == [q.id for q in b["test"]]
    ids = {name: {q.id for q in split} for name, split in a.items()}
    assert not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    assert sum(map(len, ids.values())) == len(queries)
    assert abs(len(ids["train"]) / len(queries) - 0.8) < 0.01
    other = split_queries(queries, seed=1)
    assert [q.id for q in other["test"]] != [q.id for q in a["test"]]


def test_split_puts_every_sense_of_a_text_in_one_split(wordnet_synsets):
    queries = wordnet_queries(wordnet_synsets)
    texts = [q.query.lower() for q in queries]
    assert len(set(texts)) < len(texts)  # WordNet has broad queries that share a text
    splits = split_queries(queries, seed=0)
    train = {q.query.lower() for q in splits["train"]}
    for held_out in ("val", "test"):
        assert not {q.query.lower() for q in splits[held_out]} & train
