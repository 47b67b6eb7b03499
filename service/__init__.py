"""r4t online retrieval runtime: encoder, index, bundle and the retrieval paths.

Nothing here imports torch or the offline job (`training/`).
"""
