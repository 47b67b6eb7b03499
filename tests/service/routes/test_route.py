"""Every served route has the one `Route` shape, and nothing outside the routes asks which
concrete route it holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from service.routes.autoregressive import AutoregressiveRoute
from service.routes.diffusion import DiffusionRoute
from service.routes.hybrid import HybridRoute
from service.routes.ranked import RankedRoute
from service.routes.route import Route
from service.routes.single import SingleRoute

ROOT = Path(__file__).resolve().parents[3]
CONCRETE = (SingleRoute, HybridRoute, RankedRoute, DiffusionRoute, AutoregressiveRoute)


@pytest.mark.parametrize("route", CONCRETE)
def test_every_route_is_a_route(route):
    assert Route in route.__mro__ and route.name


def concrete_checks(source: str) -> list[str]:
    """The concrete route classes named by an isinstance call in `source`."""
    names = {route.__name__ for route in CONCRETE}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            found += [n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)
                      and n.id in names]
    return found


def test_no_code_outside_the_routes_asks_which_route_it_holds():
    assert concrete_checks("isinstance(path, (SingleRoute, DiffusionRoute))") == [
        "SingleRoute", "DiffusionRoute"]  # the check itself
    offending = {}
    for package in ("service", "training", "loadtest"):
        for path in (ROOT / package).rglob("*.py"):
            if path.parent.name != "routes" and (found := concrete_checks(path.read_text())):
                offending[str(path.relative_to(ROOT))] = found
    assert offending == {}
