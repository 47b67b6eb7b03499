"""One object per served route (single, hybrid, ranked, diffusion, autoregressive), each answering a
batch of RouteQuery with RouteAnswer (answer.py)."""

ROUTE_ORDER = ("diffusion", "ranked", "ar", "hybrid", "single")  # every route's name, best first
# where a route's query goes when it fails, first that the bundle serves; single is the last
FALLBACKS: dict[str, tuple[str, ...]] = {"diffusion": ("ar", "single"), "ranked": ("single",),
                                         "ar": ("single",), "hybrid": ("single",), "single": ()}
LAST_ROUTE = "single"  # the route every chain ends in: one dense query
