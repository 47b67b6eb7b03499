"""The broad queries every load generator sends (Locust's and the open-loop one)."""

QUERIES = (
    "camping gear", "kitchen utensil", "musical instrument", "vehicle", "tree", "bird",
    "furniture", "garment", "weapon", "tool", "game", "sport", "dog", "fish", "flower",
    "building", "container", "fabric", "beverage", "dance", "disease", "mineral", "boat",
)
