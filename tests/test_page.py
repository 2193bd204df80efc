"""The leaderboard page as a user sees it: built by the real CLI, opened from disk in headless Chromium.

Chromium (Debian's `chromium`, `make browser`) is driven over the Chrome DevTools Protocol on
`--remote-debugging-pipe`: NUL-terminated JSON messages on file descriptors 3 (to the browser) and 4
(from it), so no websocket client or WebDriver is needed. The click is a real mouse event
(`Input.dispatchMouseEvent`) at the column header's coordinates.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockgen.harness.reports.leaderboard import Leaderboard, Row, write
from limits import HANG_S

REPO = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1400, 1000
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  f"--window-size={WIDTH},{HEIGHT}", "--remote-debugging-pipe"]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI: chromium is missing (make browser)")
        pytest.skip("no chromium (make browser: apt-get install chromium)")
    return path


class DevTools:
    """A headless Chromium and a CDP session on its first page, over --remote-debugging-pipe."""

    def __init__(self, binary: str, user_data_dir: Path, timeout: float = HANG_S):
        self.timeout = timeout
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # above 4, so moving them onto 3 and 4 in the child cannot clobber one another
        to_browser_r, from_browser_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser_r, from_browser_w))

        def child_fds():
            os.dup2(to_browser_r, 3)  # dup2 clears close-on-exec on the copies
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
                                     preexec_fn=child_fds, pass_fds=(3, 4),  # kept through close_fds
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict] = []
        try:
            page = self._wait_for_page()
            self.session = self.call("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise

    def _wait_for_page(self) -> str:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            pages = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
            if pages:
                return pages[0]["targetId"]
            time.sleep(0.05)
        raise TimeoutError("chromium opened no page")

    def _receive(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            if not select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError("no message from chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ConnectionError(f"chromium closed the pipe (exit code {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            if "method" in reply:
                self._events.append(reply)

    def wait_for_event(self, method: str) -> dict:
        while True:
            for i, event in enumerate(self._events):
                if event["method"] == method:
                    return self._events.pop(i)
            self._events.append(self._receive())

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        """A left click as a mouse makes it: move, press, release."""
        self.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (OSError, RuntimeError, TimeoutError, ConnectionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def gsm_row(model: str, prior: str | None, sampler: str, nfe: int, value: float, steps: int, ge: int = 1,
            source: str = "test") -> Row:
    return Row(model=model, task="gsm8k_code", metric="exact_match", value=value, stderr=0.02, n=500,
               higher_is_better=True, prior=prior, sampler=sampler, steps=steps, ge=ge, warmup=0, temperature=0.1,
               block_size=16 if sampler not in ("ar_greedy", "ar_sample") else 1, nfe_per_block=nfe,
               model_calls_per_block=float(nfe), source=source)


# Our rows, in file order deliberately not sorted by any numeric column.
OURS = [
    gsm_row("tinygsm-masked-mix", "masked", "arpc", 8, 0.31, steps=6, ge=3, source="a </script> in a field"),
    gsm_row("tinygsm-masked-mix", "masked", "arpc", 4, 0.12, steps=3, ge=3),
    gsm_row("tinygsm-masked-16", "masked", "ancestral", 16, 0.45, steps=16),
    gsm_row("tinygsm-ar", None, "ar_greedy", 1, 0.52, steps=1),
    gsm_row("tinygsm-uniform-16", "uniform", "ancestral", 4, 0.07, steps=4),
]

VALUES_JS = """[...document.querySelectorAll('table[data-task="gsm8k_code"] tbody td[data-field="value"]')]
               .map(td => parseFloat(td.textContent))"""
FROM_JS = """[...document.querySelectorAll('table[data-task="gsm8k_code"] tbody td[data-field="published"]')]
             .map(td => td.textContent)"""
# scrolled into view first: the plots come before the tables, below the fold
HEADER_JS = """(() => { const th = document.querySelector('table[data-task="gsm8k_code"] th[data-field="value"]');
               th.scrollIntoView({block: "center"}); const r = th.getBoundingClientRect();
               return [r.x + r.width / 2, r.y + r.height / 2]; })()"""
SORT_JS = """document.querySelector('table[data-task="gsm8k_code"] th[data-field="value"]').getAttribute('aria-sort')"""


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page of a small leaderboard plus the paper's GSM8K rows, built by the real CLI."""
    tmp = tmp_path_factory.mktemp("page")
    write(Leaderboard(OURS, description="test rows"), tmp / "ours.json")
    out = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "blockgen.harness.cli", "leaderboard", "page", str(tmp / "ours.json"),
                           str(REPO / "leaderboards" / "paper.json"), "--task", "gsm8k_code", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=HANG_S, cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(out / "index.html")
    return out / "index.html"


def test_page_is_self_contained(page):
    html = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # no CDN, no network
    data = json.loads(re.search(r'<script type="application/json" id="leaderboard-data">(.*?)</script>', html, re.S)
                      .group(1))
    paper_gsm = [r for r in json.loads((REPO / "leaderboards" / "paper.json").read_text())["rows"] if r["task"] == "gsm8k_code"]
    assert len(data["rows"]) == len(OURS) + len(paper_gsm)
    assert [r["value"] for r in data["rows"][:len(OURS)]] == [r.value for r in OURS]
    assert data["rows"][0]["source"] == OURS[0].source  # "</" escaped: a field cannot end the script element
    assert data["plots"] and all((page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in data["plots"])


def test_headless_chromium_screenshot_and_sort_by_click(page, tmp_path):
    browser = DevTools(chromium(), tmp_path / "profile")
    try:
        browser.call("Page.enable", session=True)
        # the viewport itself (--window-size counts the window, not the page)
        browser.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=HEIGHT,
                     deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", session=True, url=page.as_uri())
        browser.wait_for_event("Page.loadEventFired")
        # the plots load from disk beside the page
        assert browser.evaluate("document.images.length") >= 1
        assert browser.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 0)")

        shot = base64.b64decode(browser.call("Page.captureScreenshot", session=True, format="png")["data"])
        (tmp_path / "page.png").write_bytes(shot)
        if os.environ.get("BLOCKGEN_PAGE_SCREENSHOT"):  # to look at it: BLOCKGEN_PAGE_SCREENSHOT=page.png pytest ...
            Path(os.environ["BLOCKGEN_PAGE_SCREENSHOT"]).write_bytes(shot)
        assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image
        import numpy as np

        pixels = matplotlib.image.imread(tmp_path / "page.png")
        assert pixels.shape[:2] == (HEIGHT, WIDTH)
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50  # text and tables, not a blank page

        before = browser.evaluate(VALUES_JS)
        assert before[:len(OURS)] == [r.value for r in OURS]  # file order: ours first, then the paper's
        assert browser.evaluate(FROM_JS)[:len(OURS) + 1] == ["ours"] * len(OURS) + ["paper"]
        assert browser.evaluate(SORT_JS) is None

        browser.click(*browser.evaluate(HEADER_JS))
        ascending = browser.evaluate(VALUES_JS)
        assert ascending != before and ascending == sorted(before)
        assert browser.evaluate(SORT_JS) == "ascending"

        browser.click(*browser.evaluate(HEADER_JS))  # again: reversed
        assert browser.evaluate(VALUES_JS) == sorted(before, reverse=True)
        assert browser.evaluate(SORT_JS) == "descending"

        # filters: hide the paper's rows, then keep ARPC only
        browser.evaluate("document.getElementById('show-published').click()")
        assert set(browser.evaluate(FROM_JS)) == {"ours"}
        assert browser.evaluate(VALUES_JS) == sorted((r.value for r in OURS), reverse=True)  # the sort survives
        browser.evaluate("""(() => { const s = document.getElementById('filter-sampler'); s.value = 'arpc';
                            s.dispatchEvent(new Event('change')); })()""")
        assert browser.evaluate(VALUES_JS) == [0.31, 0.12]
    finally:
        browser.close()


# ------------------------------------------------------------------------------ the comparison view


def _with_outcomes(tmp: Path, name: str, outcomes: list[float]) -> str:
    """A demo-style results file with its per-problem log beside it (X.json + X.samples.jsonl)."""
    results = tmp / f"{name}.json"
    results.write_text(json.dumps({"results": {"gsm8k_code": {"exact_match,sandbox": sum(outcomes) / len(outcomes)}}}))
    (tmp / f"{name}.samples.jsonl").write_text("".join(
        json.dumps({"doc_id": i, "doc_hash": f"h{i}", "exact_match": v}) + "\n" for i, v in enumerate(outcomes)))
    return str(results)


def _outcomes(both: int, a_only: int, b_only: int, neither: int) -> tuple[list[float], list[float]]:
    pairs = [(1.0, 1.0)] * both + [(1.0, 0.0)] * a_only + [(0.0, 1.0)] * b_only + [(0.0, 0.0)] * neither
    return [a for a, _ in pairs], [b for _, b in pairs]


COMPARE_ROW_JS = """(() => {{ const tr = document.querySelector('table[data-task="gsm8k_code"] tr[data-id="{id}"]');
    return Object.fromEntries([...tr.cells].map(td => [td.dataset.field, td.textContent])); }})()"""
RADIO_JS = """(() => {{ const radio = document.querySelector('table[data-task="gsm8k_code"] tr[data-id="{id}"] input[type=radio]');
    radio.scrollIntoView({{block: "center"}}); const r = radio.getBoundingClientRect();
    return [r.x + r.width / 2, r.y + r.height / 2]; }})()"""


def test_page_leads_with_the_comparison(tmp_path):
    """Plots first; one row per setting with its outcome shares folded beside the accuracy (and the
    entropy beside Gen PPL); a metric selector; a reference row picked by a click, every other row's
    paired difference and interval as `blockgen leaderboard compare` computes them."""
    from dataclasses import replace

    from blockgen.harness.reports.compare import compare_accuracy

    a, b = _outcomes(both=40, a_only=9, b_only=1, neither=50)
    row_a = gsm_row("m-a", "masked", "arpc", 4, sum(a) / 100, steps=3, ge=2, source=_with_outcomes(tmp_path, "a", a))
    row_b = gsm_row("m-b", "masked", "ancestral", 4, sum(b) / 100, steps=4, source=_with_outcomes(tmp_path, "b", b))
    shares = [replace(row_a, metric=f"outcome_{o}", value=v, stderr=None, higher_is_better=False)
              for o, v in (("wrong_answer", 0.3), ("syntax_error", 0.1), ("timeout", 0.0))]
    gen = Row(model="m-a", task="owt_genppl", metric="gen_ppl", value=120.5, sampler="arpc", steps=3, ge=2, warmup=0,
              temperature=1.0, nfe_per_block=4, higher_is_better=False, source="g")
    entropy = replace(gen, metric="unigram_entropy", value=5.25, higher_is_better=True)
    write(Leaderboard([row_a, *shares, row_b, gen, entropy]), tmp_path / "board.json")
    out = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "blockgen.harness.cli", "leaderboard", "page", str(tmp_path / "board.json"),
                           "--out-dir", str(out)], capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = compare_accuracy(a, b)

    def points(x: float) -> str:
        return ("+" if x >= 0 else "\u2212") + f"{abs(100 * x):.1f}"

    browser = DevTools(chromium(), tmp_path / "profile")
    try:
        browser.call("Page.enable", session=True)
        browser.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=HEIGHT,
                     deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", session=True, url=(out / "index.html").as_uri())
        browser.wait_for_event("Page.loadEventFired")
        # plots come before the tables
        assert browser.evaluate("!!(document.getElementById('plots').compareDocumentPosition("
                                "document.getElementById('tables')) & Node.DOCUMENT_POSITION_FOLLOWING)")
        # one row per setting: the shares are folded into A's row, largest first, zero shares left out
        assert browser.evaluate(VALUES_JS) == [row_a.value, row_b.value]
        cells_a = browser.evaluate(COMPARE_ROW_JS.format(id=0))
        assert cells_a["folded"] == "wrong_answer 30.0% \u00B7 syntax_error 10.0%" and cells_a["diff"] == "\u2014"
        assert browser.evaluate("""document.querySelector('table[data-task="owt_genppl"] td[data-field="folded"]')
                                   .textContent""") == "unigram_entropy 5.25"
        # B as the reference, by a click on its radio button: A's paired difference A - B and its interval
        browser.click(*browser.evaluate(RADIO_JS.format(id=4)))
        cells_a, cells_b = browser.evaluate(COMPARE_ROW_JS.format(id=0)), browser.evaluate(COMPARE_ROW_JS.format(id=4))
        assert cells_b["diff"] == "reference"
        assert cells_a["diff"] == f"{points(expected.difference)} ({points(expected.low)}..{points(expected.high)})"
        assert expected.resolved and browser.evaluate(
            """document.querySelector('table[data-task="gsm8k_code"] tr[data-id="0"] td[data-field="diff"]').className""") == "diff resolved"
        # the metric selector: another metric's rows
        browser.evaluate("""(() => { const s = document.getElementById('metric'); s.value = 'outcome_wrong_answer';
                            s.dispatchEvent(new Event('change')); })()""")
        assert browser.evaluate(VALUES_JS) == [0.3]
    finally:
        browser.close()
