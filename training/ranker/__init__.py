"""The `ranker` stage, built by `r4t catalog` before stage 1: LightGBM's lambdarank learned
from the labeled train queries (lambdarank)."""
