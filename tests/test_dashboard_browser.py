"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium, against real daemons.

Selenium rather than Playwright: it drives the system's own chromium through the system's own
chromedriver (both from apt, `scripts/setup.sh`), where Playwright wants its own browser build
downloaded. Every wait is bounded; a PNG of each state goes to $MESHD_DASHBOARD_SHOTS or
bench/results/dashboard/ (printed).
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from meshd.cli.localmesh import Mesh, ctl

pytestmark = pytest.mark.slow
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them as root)",
                allow_module_level=True)

TOKEN = "dashboard-s3cret"
PROMPT = "What is the capital of France?"
SHOTS = Path(os.environ.get("MESHD_DASHBOARD_SHOTS", Path(__file__).resolve().parent.parent
                            / "bench" / "results" / "dashboard"))
GAP_WAIT_S = 15.0


@pytest.fixture(scope="module")
def mesh():
    """Three daemons serving 0:10, 10:20, 20:30, each with an open HTTP API; `filler` may join later."""
    m = Mesh()
    try:
        daemons = m.start_chain([(0, 10), (10, 20), (20, 30)], extra=["--http", "127.0.0.1:0"])
        yield m, daemons
    finally:
        m.close()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1100"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {SHOTS}")
    try:
        yield driver
    finally:
        driver.quit()


def url(daemon) -> str:
    return daemon.status()["http"][0]


def shot(driver, name: str) -> Path:
    path = SHOTS / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def read(driver, selector: str, fields: str) -> list:
    """`fields` (a JS expression of `e`) of every element matching `selector`, read in one script:
    the page redraws every poll, so an element found in one call may be gone by the next."""
    return driver.execute_script(f"return [...document.querySelectorAll(arguments[0])].map(e => {fields})", selector)


def bars(driver) -> list[tuple[str, str]]:
    """(range, peer) of every bar of the coverage map, in layer order."""
    found = read(driver, "#coverage g.bar", "[e.dataset.range, e.dataset.peer]")
    return sorted((tuple(b) for b in found), key=lambda rp: [int(v) for v in rp[0].split(":")])


def gaps(driver) -> list[str]:
    return read(driver, "#coverage g.gap", "e.dataset.range")


def title(driver, selector: str) -> str:
    """What hovering the bar at `selector` shows."""
    return read(driver, selector + " > title", "e.textContent")[0]


def node(driver, key: str) -> str:
    return read(driver, f'#node dd[data-key="{key}"]', "e.textContent")[0]


def verdict(driver) -> str:
    return driver.find_element(By.ID, "verdict").text


def wait(driver, timeout: float, what: str, until) -> float:
    """Wait (bounded) until `until(driver)` holds; returns the seconds it took."""
    t0 = time.monotonic()
    try:
        WebDriverWait(driver, timeout, poll_frequency=0.25).until(lambda d: until(d))
    except TimeoutException:
        raise AssertionError(f"the page did not show {what} within {timeout:.0f} s: verdict {verdict(driver)!r}, "
                             f"bars {bars(driver)}, gaps {gaps(driver)}") from None
    return time.monotonic() - t0


def test_the_entry_shows_three_bars_covering_the_model_and_complete(mesh, browser):
    m, daemons = mesh
    browser.get(url(daemons[0]) + "/")
    want = [(f"{a}:{b}", d.status()["peer_id"]) for d, (a, b) in zip(daemons, [(0, 10), (10, 20), (20, 30)])]
    wait(browser, 20, "three bars and complete", lambda d: bars(d) == want and verdict(d) == "complete")
    assert gaps(browser) == []
    assert read(browser, "#coverage g.bar.self", "e.dataset.range") == ["0:10"]
    own = title(browser, "#coverage g.bar.self")
    assert daemons[0].status()["peer_id"] in own and "layer/s" in own and "this daemon" in own
    peer = title(browser, '#coverage g.bar[data-range="20:30"]')
    assert "rtt" in peer and "reached directly" in peer
    assert node(browser, "state") == "serving"
    assert node(browser, "prefix").endswith("; TTL 600 s")  # what this daemon keeps of ended generations
    shot(browser, "1-complete")


MADE_UP = {  # a status no three-daemon loopback mesh shows: replicas, a relayed and an excluded peer, a gap
    "peer_id": "12D3KooWself", "state": "draining", "drain_reason": "stop", "range": [0, 10], "n_layers": 30,
    "model": "m", "recipe": "native", "complete": False, "gaps": [[25, 30]], "coverage": [2] * 10 + [2] * 10 + [1] * 5 + [0] * 5,
    "throughput": 100.0, "sessions": 1, "kv_bytes": 1_600_000, "generations": 0, "weight_bytes": 1, "file_bytes": 1,
    "relay": {"service": None, "client": None, "relayed_peers": ["12D3KooWrelayed"]}, "recent_generations": [],
    "prefix_cache": {"entries": 3, "held_bytes": 12_400_000, "held_tokens": 2900, "hits": 5, "misses": 2,
                     "tokens_reused": 11200, "evictions": 0, "ttl_s": 600},
    "peers": [{"peer_id": "12D3KooWreplica", "range": [0, 10], "serving": True, "throughput": 90.0, "rtt_ms": 1.5},
              {"peer_id": "12D3KooWrelayed", "range": [10, 25], "serving": True, "throughput": 80.0, "rtt_ms": 9.0},
              {"peer_id": "12D3KooWexcluded", "range": [10, 20], "serving": True, "throughput": 70.0, "rtt_ms": 2.0,
               "excluded": True},
              {"peer_id": "12D3KooWbootstrap", "range": [0, 0], "serving": True, "throughput": 0.0, "rtt_ms": 1.0}]}


def test_replicas_stack_and_each_bar_says_how_its_peer_is_reached(mesh, browser):
    """The drawing of a made-up status (the page's own poll, its fetch answered in the page); the
    real statuses are the other tests'."""
    m, (d0, d1, d2) = mesh
    browser.get(url(d0) + "/")
    wait(browser, 20, "the mesh", lambda d: verdict(d) == "complete")
    browser.execute_script("""const status = arguments[0];
        window.fetch = async () => new Response(JSON.stringify(status), {status: 200});""", MADE_UP)
    wait(browser, 10, "the made-up status, without a reload", lambda d: verdict(d) == "INCOMPLETE")
    got = {peer: tuple(rest) for peer, *rest in read(
        browser, "#coverage g.bar",
        "[e.dataset.peer, e.dataset.range, e.dataset.link, e.dataset.state, e.querySelector('rect').getAttribute('y')]")}
    top, below = got["12D3KooWself"][3], got["12D3KooWreplica"][3]
    assert float(top) < float(below)  # the replica of 0:10 is stacked under this daemon's bar
    assert got == {"12D3KooWself": ("0:10", "self", "draining", top),
                   "12D3KooWreplica": ("0:10", "direct", "serving", below),
                   "12D3KooWexcluded": ("10:20", "excluded", "serving", top),  # the shorter first
                   "12D3KooWrelayed": ("10:25", "relayed", "serving", below)}  # no bar for the bootstrap node
    assert gaps(browser) == ["25:30"]
    relayed = title(browser, '#coverage g.bar[data-link="relayed"]')
    assert "12D3KooWrelayed" in relayed and "reached through a relay" in relayed and "rtt 9.0 ms" in relayed
    assert "excluded from routes" in title(browser, '#coverage g.bar[data-link="excluded"]')
    assert node(browser, "state") == "draining (stop)"
    assert node(browser, "sessions") == "1 open, 1.6 MB KV, 0 generating"  # kept KV: the prefix row
    assert node(browser, "prefix") == ("3 kept (12.4 MB, 2,900 tokens); 5 hits of 7 asked, 11,200 tokens reused;"
                                       " 0 evicted; TTL 600 s")
    assert "…tstrap" in browser.find_element(By.ID, "coverage-notes").text  # listed, without layers
    shot(browser, "0-made-up-replicas")


def test_the_chat_box_streams_what_meshctl_generates(mesh, browser):
    m, (d0, d1, d2) = mesh
    expected = ctl(d0.socket, ["generate", "--chat", "--max-tokens", "24", PROMPT]).stdout[:-1]
    assert expected
    browser.get(url(d0) + "/")
    wait(browser, 20, "the mesh", lambda d: verdict(d) == "complete")
    browser.execute_script("""
        window.assistantUpdates = 0;  // each piece of text the page writes into the answer
        new MutationObserver((records) => { for (const r of records)
            if (r.target.classList && r.target.classList.contains('assistant')) window.assistantUpdates++; })
          .observe(document.getElementById('chat-log'), {childList: true, subtree: true});""")
    for field, value in (("chat-max", "24"), ("chat-temp", "0")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "chat-input").send_keys(PROMPT)
    browser.find_element(By.ID, "chat-send").click()
    wait(browser, 120, "a finished answer",
         lambda d: d.find_elements(By.CSS_SELECTOR, "#chat-log .msg.assistant[data-done]"))
    answer = browser.find_element(By.CSS_SELECTOR, "#chat-log .msg.assistant")
    assert "error" not in answer.get_attribute("class")
    assert answer.get_attribute("textContent") == expected
    assert browser.execute_script("return window.assistantUpdates") > 1  # it arrived in pieces
    # meshctl asked the same just before: the hops kept its KV, and the page says so (from the usage)
    assert re.search(r" · [1-9]\d* of \d+ prompt tokens reused$", browser.find_element(By.ID, "chat-status").text)
    wait(browser, 10, "the generation in the recent table",
         lambda d: len(read(d, "#recent tbody tr", "1")) >= 2)  # meshctl's, then the page's
    status = httpx.get(url(d0) + "/v1/meshd/status", timeout=10).text
    assert PROMPT not in status and expected not in status  # timings and routes only
    recent = json.loads(status)["recent_generations"][0]
    assert [h[1:] for h in recent["route"]] == [[0, 10], [10, 20], [20, 30]] and recent["ttft_s"] > 0
    shot(browser, "2-chat")


def test_a_killed_daemon_shows_as_a_gap_and_a_new_one_fills_it(mesh, browser):
    m, (d0, d1, d2) = mesh
    browser.get(url(d0) + "/")
    wait(browser, 20, "three bars", lambda d: len(bars(d)) == 3 and verdict(d) == "complete")
    d2.kill()  # SIGKILL by its PID: no record withdrawn, it just goes silent
    took = wait(browser, GAP_WAIT_S, "the gap at 20:30", lambda d: gaps(d) == ["20:30"] and verdict(d) == "INCOMPLETE")
    print(f"gap shown {took:.1f} s after the kill")
    assert [r for r, _ in bars(browser)] == ["0:10", "10:20"]
    shot(browser, "3-gap")
    d3 = m.start("d3", ["--layers", "20:30", "--bootstrap", d0.status()["addrs"][0],
                        "--http", "127.0.0.1:0", "--http-token", TOKEN])
    pid = d3.wait_serving()["peer_id"]
    want = [("0:10", d0.status()["peer_id"]), ("10:20", d1.status()["peer_id"]), ("20:30", pid)]
    wait(browser, 60, "the new daemon filling 20:30", lambda d: bars(d) == want and verdict(d) == "complete")
    assert gaps(browser) == []
    shot(browser, "4-filled")


def test_with_a_token_the_page_asks_for_it_and_shows_no_peer(mesh, browser):
    m, daemons = mesh
    guarded = next((d for d in m.daemons if d.name == "d3" and d.proc.poll() is None), None)
    if guarded is None:  # the test before did not get as far as starting it
        guarded = m.start("d3", ["--layers", "20:30", "--bootstrap", daemons[0].status()["addrs"][0],
                                 "--http", "127.0.0.1:0", "--http-token", TOKEN])
    guarded.wait_serving()
    assert httpx.get(url(guarded) + "/v1/meshd/status", timeout=10).status_code == 401
    browser.get(url(guarded) + "/")
    wait(browser, 20, "the login prompt", lambda d: d.find_element(By.ID, "login").is_displayed())
    assert not browser.find_element(By.ID, "mesh").is_displayed()
    assert "12D3KooW" not in browser.page_source and not bars(browser)
    shot(browser, "5-login")
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
    wait(browser, 10, "the refusal", lambda d: "refused" in d.find_element(By.ID, "login-error").text)
    assert "12D3KooW" not in browser.page_source
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
    wait(browser, 20, "the mesh behind the token", lambda d: verdict(d) == "complete" and len(bars(d)) == 3)
    assert guarded.status()["peer_id"] in browser.page_source
    shot(browser, "6-token-accepted")
