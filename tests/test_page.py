"""The page at / of the server, in a real browser: Chromium from the system packages, driven
with Selenium through the Debian chromium-driver (CI installs both; skipped, with the reason,
only where no Chromium is installed). The page's text must be the API's answer to the same
greedy request, its accepted drafts marked, its statistics, charts and comparison shown, and a
wrong API key answered with an error. Also, without a browser: the trace extension of the
stream the page reads, the info and costs views, and ``--no-ui``."""

from __future__ import annotations

import json
import shutil
import urllib.parse

import httpx
import pytest

from specdecode.api import Decoder
from specdecode.server import create_app

from test_server import ServerThread

MODEL = "smollm2-135m-instruct"
PROMPT = ("Copy this Python code exactly, with no comment:\n\ndef area(width, height):\n    return width * height\n\n"
          "def perimeter(width, height):\n    return 2 * (width + height)\n")
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 60
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module", autouse=True)
def _keep_the_cost_cache():
    """These tests generate beside a browser, whose CPU use the controller would take for the
    machine's speed and write into the shared cost cache (a live rewrite), slowing the tests
    after them; the cache is put back as it was."""
    from specdecode.assembly import registry

    costs = registry.cache_dir() / "costs"
    before = {p: p.read_bytes() for p in costs.glob("*.json")} if costs.is_dir() else {}
    yield
    for p in costs.glob("*.json") if costs.is_dir() else ():
        if p not in before:
            p.unlink()
    for p, data in before.items():
        p.write_bytes(data)


@pytest.fixture(scope="module")
def decoder():
    """Prompt lookup at a fixed K: on these CPUs the controller drafts little for smollm2 (its
    T(2) is nearly 2 T(1)), and the page must show accepted drafts."""
    dec = Decoder(target=MODEL, draft="ngram", num_speculative_tokens=4, n_ctx=1024, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def auto_decoder():
    """The cost-aware controller (it plans with the measured cost curve the Costs view draws)."""
    dec = Decoder(target=MODEL, draft="auto", num_speculative_tokens="auto", n_ctx=1024, n_threads=1, progress=False)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def server(decoder):
    with ServerThread(create_app(decoder, max_queue=4)) as s:
        yield s


@pytest.fixture(scope="module")
def api_answer(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]["content"]


def _stream(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_the_trace_names_where_each_piece_of_text_came_from(server, api_answer):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "speculative": {"trace": True}}
    chunks = _stream(server.url, body)
    traced = [c for c in chunks if "speculation_trace" in c]
    assert traced, "no chunk carried speculation_trace"
    for c in traced:  # the runs are exactly the chunk's text
        t = c["speculation_trace"]
        assert "".join(r["text"] for r in t["runs"]) == c["choices"][0]["delta"]["content"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == api_answer
    runs = [r for c in traced for r in c["speculation_trace"]["runs"]]
    assert any(r["by"] for r in runs) and any(r["by"] is None for r in runs)  # drafts accepted, and the target's own
    steps = [c["speculation_trace"]["step"] for c in traced if c["speculation_trace"]["step"]]
    assert sum(s["committed"] for s in steps) <= len(text) and all(s["accepted"] <= s["k"] for s in steps)
    plain = _stream(server.url, {**body, "speculative": {"trace": False}})  # no trace unless asked
    assert not any("speculation_trace" in c for c in plain)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "speculative": {"trace": "yes"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.trace"


def test_info_and_costs_views(server, auto_decoder):
    info = httpx.get(server.url + "/v1/specdecode/info").json()
    assert info["model"] == MODEL and info["drafters"] == ["ngram"] and info["num_speculative_tokens"] == 4
    # where the model runs (a CPU-only build here): llama.cpp's device name and its layers, in words too
    assert (info["device"], info["gpu_layers"], info["n_layers"], info["draft_models"]) == ("CPU", 0, 31, [])
    assert info["runs_on"] == "target on the CPU" == httpx.get(server.url + "/health").json()["runs_on"]
    costs = httpx.get(server.url + "/v1/specdecode/costs").json()
    assert costs["target"] is None and "fixed K" in costs["note"]  # a fixed K plans with no curve
    with ServerThread(create_app(auto_decoder)) as s:
        info = httpx.get(s.url + "/v1/specdecode/info").json()
        assert {"ngram", "suffix"} <= set(info["drafters"]) and info["num_speculative_tokens"] == 32
        costs = httpx.get(s.url + "/v1/specdecode/costs").json()
    t = costs["target"]
    assert t["ns"][0] == 1 and len(t["seconds"]) == len(t["ns"]) and all(x > 0 for x in t["seconds"])
    assert costs["copy_limit"] > 0 and {d["name"] for d in costs["drafters"]} >= {"ngram"}


def test_no_ui_serves_no_page(decoder):
    with ServerThread(create_app(decoder, ui=False)) as s:
        assert httpx.get(s.url + "/").status_code == 404
        assert httpx.get(s.url + "/health").status_code == 200
    with pytest.raises(Exception, match="ui"):
        create_app(decoder, ui="no")


# --- in a real browser ------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium installed (apt-get install chromium chromium-driver): the page is tested in a "
                    "real browser only")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def _wait(driver, condition, seconds=300):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.2).until(lambda d: condition(d))


def _canvas_drawn(driver, canvas_id: str) -> bool:
    return driver.execute_script(
        "const c = document.getElementById(arguments[0]); const d = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data; for (let i = 3; i < d.length; i += 4) if (d[i]) return true;"
        " return false;", canvas_id)


def test_the_page_streams_the_apis_answer_with_its_accepted_drafts_marked(browser, server, api_answer, tmp_path):
    from selenium.webdriver.common.by import By

    query = urllib.parse.urlencode({"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    browser.get(f"{server.url}/?{query}")  # a prompt in the address is sent on load
    _wait(browser, lambda d: d.find_element(By.ID, "answer").get_attribute("data-done") == "true")
    answer = browser.find_element(By.ID, "answer")
    assert browser.execute_script("return document.getElementById('answer').textContent") == api_answer
    marked = answer.find_elements(By.CSS_SELECTOR, "span:not([data-by='target'])")
    assert marked and answer.find_elements(By.CSS_SELECTOR, "span[data-by='target']")
    # Each drafter's text has its legend's colour (a suffix draft was once painted as ngram's).
    colours = browser.execute_script(
        "const out = {}; for (const kind of ['ngram', 'suffix', 'prediction', 'heads', 'model']) {"
        " const a = document.createElement('span'); a.className = 'by-' + kind; a.dataset.by = kind;"
        " document.getElementById('answer').appendChild(a);"
        " const b = document.createElement('span'); b.className = 'by-' + kind;"
        " document.getElementById('legend').appendChild(b);"
        " out[kind] = [getComputedStyle(a).backgroundColor, getComputedStyle(b).backgroundColor]; a.remove(); b.remove(); }"
        " return out;")
    assert all(a == b for a, b in colours.values()) and len({a for a, _ in colours.values()}) == 5, colours
    assert browser.find_element(By.ID, "s-rate").text not in ("", "-")
    assert float(browser.find_element(By.ID, "s-len").text) >= 1.0
    assert browser.find_element(By.ID, "reason").text.startswith("fixed: ngram drafts K = 4")  # the line that says why
    assert _canvas_drawn(browser, "kchart")
    assert MODEL in browser.find_element(By.ID, "model").text
    assert browser.find_element(By.ID, "runs-on").text == "runs: target on the CPU"  # where the model runs, in words
    assert not browser.find_element(By.ID, "keybox").is_displayed()  # no key asked of a server without one
    assert not browser.find_element(By.ID, "view-costs").is_displayed()
    browser.find_element(By.ID, "compare").click()
    _wait(browser, lambda d: d.find_element(By.ID, "comparison").get_attribute("data-plain"))
    comparison = browser.find_element(By.ID, "comparison").text
    assert "speculative" in comparison and "plain" in comparison and comparison.endswith("x")
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    browser.find_element(By.ID, "tab-costs").click()  # a fixed K: the view says why there is no curve
    _wait(browser, lambda d: "fixed K" in d.find_element(By.ID, "costtext").text, 30)


def test_a_wrong_api_key_shows_an_error_and_the_right_one_works(browser, auto_decoder):
    from selenium.webdriver.common.by import By

    with ServerThread(create_app(auto_decoder, api_key="s3cret")) as s:
        browser.get(s.url + "/")
        _wait(browser, lambda d: d.find_element(By.ID, "keybox").is_displayed(), 30)
        assert "401" in browser.find_element(By.ID, "error").text
        browser.find_element(By.ID, "apikey").send_keys("wrong")
        browser.find_element(By.ID, "keyset").click()
        _wait(browser, lambda d: "incorrect API key" in d.find_element(By.ID, "error").text, 30)
        key = browser.find_element(By.ID, "apikey")
        key.clear()
        key.send_keys("s3cret")
        browser.find_element(By.ID, "keyset").click()
        _wait(browser, lambda d: MODEL in d.find_element(By.ID, "model").text, 30)
        assert not browser.find_element(By.ID, "error").is_displayed()
        assert browser.execute_script("return window.localStorage.length + document.cookie.length") == 0
        browser.find_element(By.ID, "tab-costs").click()  # the controller's measured curve, drawn
        _wait(browser, lambda d: "T(1)" in d.find_element(By.ID, "costtext").text, 30)
        assert _canvas_drawn(browser, "costchart")
