"""Load tests (Locust) and the side-by-side speed benchmark of the two retrieval paths."""
