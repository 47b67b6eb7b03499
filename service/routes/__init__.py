"""One object per served route (single, hybrid, ranked, diffusion, autoregressive), each answering a
batch of RouteQuery with RouteAnswer (answer.py)."""

ROUTE_ORDER = ("diffusion", "ranked", "ar", "hybrid", "single")  # every route's name, best first
