"""The README's picture of the page: the default pair under `auto` on a copy-heavy prompt.

Starts `specdecode serve` with its defaults (qwen2.5-coder-1.5b-instruct, draft auto, K auto),
opens the page in headless Chromium (Selenium and the Debian chromium-driver, as
tests/test_page.py uses them), sends an edit that returns a whole file (the function of
examples/edit_function_prediction.py), waits for the answer, presses "Compare with plain"
and saves the window:

    python benchmarks/page_picture.py --out docs/page.png

Prints the page's figures (tokens/s, mean accepted length, the comparison line) and the CPU,
for the README's caption.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import httpx

from specdecode.bench import cpu_name, free_port, serve_process

SOURCE = Path(__file__).resolve().parent.parent / "examples" / "edit_function_prediction.py"


def edit_prompt() -> str:
    """The request: rename a parameter of examples/edit_function_prediction.py's function and
    return it whole (a copy-heavy answer)."""
    code = SOURCE.read_text().split("```python\n", 1)[1].rsplit("```", 1)[0]
    return ("Rename the parameter `min_total` to `threshold` everywhere in this function. Change nothing else and "
            "return the whole function in one code block.\n\n```python\n" + code + "```")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/page.png")
    ap.add_argument("--max-tokens", type=int, default=400)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        sys.exit("needs Chromium and its driver: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="page-picture-")) / "serve.log"
    server = serve_process([], port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", timeout=900,  # the first request's one-off work, untimed
                   json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]})
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400"):
            opts.add_argument(arg)
        browser = webdriver.Chrome(service=Service(driver_path), options=opts)
        try:
            wait = lambda cond, s=900: WebDriverWait(browser, s, poll_frequency=0.2).until(cond)  # noqa: E731
            query = urllib.parse.urlencode({"prompt": edit_prompt(), "max_tokens": args.max_tokens})
            browser.get(f"{url}/?{query}")  # a prompt in the address is sent on load
            wait(lambda d: d.find_element(By.ID, "answer").get_attribute("data-done") == "true")
            browser.find_element(By.ID, "compare").click()
            wait(lambda d: d.find_element(By.ID, "comparison").get_attribute("data-plain"))
            time.sleep(1)  # the last paint
            figures = {k: browser.find_element(By.ID, k).text for k in ("s-rate", "s-len", "s-accept", "comparison")}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(args.out)
        finally:
            browser.quit()
    finally:
        server.terminate()
        server.wait(60)
    print(f"{args.out}: tokens/s {figures['s-rate']}, mean accepted length {figures['s-len']}, acceptance "
          f"{figures['s-accept']}; {figures['comparison']}; {cpu_name()}")


if __name__ == "__main__":
    main()
