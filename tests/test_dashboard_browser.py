"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium, against real daemons.

Selenium rather than Playwright: it drives the system's own chromium through the system's own
chromedriver (both from apt, `scripts/setup.sh`), where Playwright wants its own browser build
downloaded. Every wait is bounded; a PNG of each state goes to $MESHD_DASHBOARD_SHOTS or
bench/results/dashboard/ (printed).
"""

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from meshd.testing.localmesh import Mesh, ctl

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


def bars(driver) -> list[tuple[str, str]]:
    """(range, peer) of every bar of the coverage map, in layer order."""
    return sorted(((e.get_attribute("data-range"), e.get_attribute("data-peer"))
                   for e in driver.find_elements(By.CSS_SELECTOR, "#coverage g.bar")),
                  key=lambda rp: [int(v) for v in rp[0].split(":")])


def gaps(driver) -> list[str]:
    return [e.get_attribute("data-range") for e in driver.find_elements(By.CSS_SELECTOR, "#coverage g.gap")]


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
    own = browser.find_element(By.CSS_SELECTOR, "#coverage g.bar.self")
    assert own.get_attribute("data-range") == "0:10"
    title = own.find_element(By.TAG_NAME, "title").get_attribute("textContent")  # what hovering shows
    assert daemons[0].status()["peer_id"] in title and "layer/s" in title
    peer_title = browser.find_element(By.CSS_SELECTOR, '#coverage g.bar[data-range="20:30"] title')
    assert "rtt" in peer_title.get_attribute("textContent") and "reached directly" in peer_title.get_attribute("textContent")
    assert browser.find_element(By.CSS_SELECTOR, '#node dd[data-key="state"]').text == "serving"
    shot(browser, "1-complete")


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
    wait(browser, 10, "the generation in the recent table",
         lambda d: len(d.find_elements(By.CSS_SELECTOR, "#recent tbody tr")) >= 2)  # meshctl's, then the page's
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
