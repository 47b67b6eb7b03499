"""r4t online retrieval runtime: encoder, index, bundle, reward and the retrieval paths.

Nothing here imports torch or the offline job (`training/`).
"""
