"""One object per served route (single, ranked, diffusion, autoregressive), each answering a
batch of RouteQuery with RouteAnswer (answer.py)."""

ROUTE_ORDER = ("diffusion", "ranked", "ar", "single")  # every route's name, best first
