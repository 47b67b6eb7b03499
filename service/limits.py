"""The hard input limits of the HTTP API: the request schema enforces them, and `Settings` may
lower them per deployment (a leaf module, so both read one definition)."""

MAX_QUERY_CHARS = 1000
MAX_K = 100
MAX_BATCH_QUERIES = 64
MAX_USER_ID_CHARS = 200
MAX_FILTER_FIELDS = 8
