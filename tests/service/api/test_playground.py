"""The playground page: served by the service itself, and driven in a real headless browser
(Debian's chromium + chromium-driver through selenium) against a live `r4t serve`."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prerequisites import needs
from tests.service.live import ADMIN_TOKEN, live_server, serve_process

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"
ROUTES = ("single", "ranked", "diffusion", "ar")
WAIT_S = 60.0
needs_chromium = needs("chromium", "chromedriver", package="Debian's chromium and "
                       "chromium-driver packages (make system-deps, .ci/run)")


def test_the_page_and_its_assets_are_served_without_the_admin_token(settings_for):
    with live_server(settings_for(), ready=False) as live, live.client() as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/static/playground.js">' in page.text
        for asset in ("/static/playground.js", "/static/playground.css"):
            served = client.get(asset)
            assert served.status_code == 200 and len(served.text) > 100, asset
            assert ADMIN_TOKEN not in served.text
        assert ADMIN_TOKEN not in page.text and ADMIN_TOKEN not in client.get("/v1/info").text
        assert "/" not in client.get("/openapi.json").json()["paths"]  # not an API route


@pytest.fixture(scope="module")
def served(serving_bundle, completion_server, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("playground") / "r4t.log"
    with serve_process(serving_bundle, completion_server, log, R4T_ADMIN_TOKEN=ADMIN_TOKEN,
                       R4T_GROUNDEDNESS_THRESHOLD="0.0") as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def ask(driver, url: str, query: str, k: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/")
    for name, value in (("query", query), ("k", k)):
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)
    driver.find_element(By.ID, "go").click()
    settled = "return [...document.querySelectorAll('.route')].every(c => " \
              "c.dataset.state === 'done' || c.dataset.state === 'error')"
    WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script(settled))


def column(driver, route: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'.route[data-route="{route}"]')


@needs_chromium
def test_the_four_routes_fill_side_by_side(served, browser, benchmark_queries):
    from selenium.webdriver.common.by import By

    query = benchmark_queries[0].query
    ask(browser, served, query, "5")
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))
    texts = {}
    for route in ROUTES:
        box = column(browser, route)
        assert box.get_attribute("data-state") == "done", box.text
        items = box.find_elements(By.CSS_SELECTOR, ".item")
        assert len(items) == 5, (route, box.text)
        texts[route] = [item.find_element(By.CSS_SELECTOR, ".text").text for item in items]
        assert all(texts[route]), route
        assert "groundedness" in box.find_element(By.CSS_SELECTOR, ".meta").text
    assert "sub-query" in column(browser, "ar").text  # the AR items name their sub-query
    marked = {route: [m.text for m in column(browser, route).find_elements(
        By.CSS_SELECTOR, ".item.fanout-only .text")] for route in ROUTES}
    assert marked["single"] == []
    for route in ("diffusion", "ar"):  # marked exactly when single did not return it
        assert marked[route] == [t for t in texts[route] if t not in texts["single"]]


@needs_chromium
def test_a_bad_request_shows_the_services_message(served, browser):
    ask(browser, served, "tree", "1000")
    for route in ROUTES:
        box = column(browser, route)
        assert box.get_attribute("data-state") == "error"
        assert "422" in box.text and "less than or equal to 100" in box.text, box.text


@needs_chromium
def test_the_bundle_tab_shows_the_sampler_and_provenance(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(served + "/")
    browser.find_element(By.CSS_SELECTOR, '.tab[data-tab="bundle"]').click()
    info = browser.find_element(By.ID, "info")
    WebDriverWait(browser, WAIT_S).until(lambda d: info.get_attribute("data-state") == "done")
    text = info.text
    for shown in ("svc", "solver", "FLOPs / query", "commit", "wordllama"):
        assert shown in text, shown
    assert ADMIN_TOKEN not in browser.page_source
