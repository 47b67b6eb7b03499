"""The ranker: the default teacher and the `ranked` route's chooser. What the catalog's text says
about a query's candidates (mentions, words), the compiled model that scores them (booster,
ranker) and what a standalone student reads of them (mention_context)."""
