"""The status page and run history as HTML for people (issue 22, item 1).

Plain HTTP tests check what any client gets (content negotiation, access, escaping, the page
without JavaScript); browser tests drive a real headless Chromium through selenium: the page
loads with nothing from elsewhere, a triggered run appears, and a running run's output arrives
live until its state turns to succeeded, without a reload.  Commands that must be "running"
wait for a gate file the test creates, so no test depends on how fast anything is.
"""
import base64
import json
import re
import shutil
import subprocess
import urllib.parse

import pytest

from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import gated_command, script, wait_until, write_hooks

# What Chromium sends when it navigates to a page.
BROWSER_ACCEPT = ("text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,"
                  "image/webp,image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7")
HTML = {"Accept": BROWSER_ACCEPT}
HOSTILE_ID = '"><script>window.pwned=1</script>'
HOSTILE_OUTPUT = '</pre></script><script>window.pwned=2</script><b>not bold</b>'
TOKEN = "s3cret-token"
WAIT = 20  # seconds: a hang detector only, never a speed requirement


def hooks_for(tmp_path):
    slow, gate = gated_command(tmp_path, "slow", "first-line", "second-line")
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "echo", "execute-command": "/bin/echo",
         "pass-arguments-to-command": [{"source": "string", "name": HOSTILE_OUTPUT}]},
        {"id": HOSTILE_ID, "execute-command": "/bin/echo"},
        {"id": "slow", "execute-command": slow}])
    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": "half-written", ')
    return hooks, broken, gate


def start(hooks, broken, *flags):
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-nopanic", "-hooks", hooks, "-hooks", broken, "-ip",
                             "127.0.0.1", "-port", str(port), "-status-path", "/-/status",
                             *flags), port)


def trigger(daemon, hook_id):
    status, headers, _ = daemon.request("GET", "/hooks/" + urllib.parse.quote(hook_id, safe=""))
    assert status == 200, status
    return headers["x-webhookd-run"]


def ended(daemon, run_id):
    def done():
        record = json.loads(daemon.request("GET", "/-/status/runs/" + run_id)[2])
        return record["state"] not in ("queued", "running") and record
    return wait_until(done, WAIT, "run %s to end" % run_id)


def basic(user, password):
    return "Basic " + base64.b64encode(("%s:%s" % (user, password)).encode()).decode()


def html_of(daemon, path, headers=None):
    status, answer_headers, body = daemon.request("GET", path,
                                                  headers=dict(HTML, **(headers or {})))
    assert status == 200, (path, status, body[:300])
    assert answer_headers["content-type"] == "text/html; charset=utf-8"
    return answer_headers, body.decode()


# ---------------------------------------------------------------------------------------------
# Plain HTTP: what the page holds, who gets it
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("page")
    hooks, broken, gate = hooks_for(tmp_path)
    with start(hooks, broken) as running:
        running.gate = gate
        yield running


def test_browsers_get_html_everyone_else_json(daemon):
    for accept in (None, "*/*", "application/json", "text/html;q=0, */*",
                   "application/json, text/html", "text/html;q=0.5, application/json"):
        status, headers, body = daemon.request(
            "GET", "/-/status", headers={"Accept": accept} if accept else {})
        assert status == 200 and headers["content-type"] == "application/json", accept
        assert json.loads(body)["hooks_loaded"] == 3
    for accept in (BROWSER_ACCEPT, "text/html", "TEXT/HTML;Q=0.9, application/json;q=0.5"):
        headers, _ = html_of(daemon, "/-/status", {"Accept": accept})
    policy = headers["content-security-policy"]
    nonce = re.search(r"script-src 'nonce-([A-Za-z0-9+/=]+)'", policy).group(1)
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert "style-src 'nonce-%s'" % nonce in policy and "unsafe-inline" not in policy
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    assert html_of(daemon, "/-/status")[0]["content-security-policy"] != policy  # per answer
    # the run history's JSON and a run's raw output stay as they were, browser or not
    run_id = trigger(daemon, "echo")
    record = ended(daemon, run_id)
    assert record in json.loads(daemon.request("GET", "/-/status/runs?hook=echo")[2])
    status, headers, body = daemon.request("GET", "/-/status/runs/%s/output" % run_id,
                                           headers=HTML)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert body == (HOSTILE_OUTPUT + "\n").encode()


def test_the_page_is_readable_without_javascript_and_escapes_everything(daemon, tmp_path):
    echo_run, hostile_run = trigger(daemon, "echo"), trigger(daemon, HOSTILE_ID)
    ended(daemon, echo_run), ended(daemon, hostile_run)
    _, page = html_of(daemon, "/-/status")
    assert '<meta name="viewport"' in page
    for shown in ("echo", "slow", echo_run, hostile_run, "succeeded", "hooks.json",
                  "broken.json", "did not find expected"):
        assert shown in page, shown
    for hostile in (HOSTILE_ID, HOSTILE_OUTPUT):
        assert hostile not in page
    assert "&quot;&gt;&lt;script&gt;window.pwned=1&lt;/script&gt;" in page
    assert re.search(r"\b(?:src|href)=\"?(?:https?:)?//", page) is None  # nothing from elsewhere

    _, detail = html_of(daemon, "/-/status/runs/" + echo_run)
    assert "&lt;/pre&gt;&lt;/script&gt;&lt;script&gt;window.pwned=2" in detail
    assert HOSTILE_OUTPUT not in detail and "data-live" not in detail  # ended: nothing to follow

    _, filtered = html_of(daemon, "/-/status?hook=echo&state=succeeded&limit=5")
    runs_shown = filtered.split("<h2>Runs</h2>")[1]  # (the hooks table shows each last run)
    assert echo_run in runs_shown and hostile_run not in runs_shown
    _, none_failed = html_of(daemon, "/-/status/runs?state=failed")
    assert echo_run not in none_failed and "No run matches." in none_failed
    status, headers, body = daemon.request("GET", "/-/status?state=bogus", headers=HTML)
    assert status == 400 and b"state must be one of" in body
    assert daemon.request("GET", "/-/status/runs/20990101T000000Z-00000000", headers=HTML)[0] == 404


def test_a_browser_gives_the_token_as_basic_password(tmp_path):
    hooks, broken, _ = hooks_for(tmp_path)
    with start(hooks, broken, "-status-token", TOKEN) as daemon:
        run_id = trigger(daemon, "echo")
        for path in ("/-/status", "/-/status/runs", "/-/status/runs/" + run_id):
            for authorization in (None, basic("admin", "wrong"), basic(TOKEN, ""),
                                  "Basic !!!not-base64!!!", "Basic " + "é" * 3,
                                  "Basic " + base64.b64encode(TOKEN.encode()).decode()):
                status, headers, body = daemon.request("GET", path, headers=dict(
                    HTML, **({"Authorization": authorization} if authorization else {})))
                assert status == 401, (path, authorization, status)
                assert headers["www-authenticate"] == 'Basic realm="webhookd", charset="UTF-8"'
                assert headers["content-type"] == "text/html; charset=utf-8"
                assert b"echo" not in body and b"hooks.json" not in body and run_id.encode() \
                    not in body
            for user in ("admin", "", "\u00fcser"):
                _, page = html_of(daemon, path, {"Authorization": basic(user, TOKEN)})
                assert run_id in page
        # JSON clients: as before (health to all, runs refused), and the one check for both
        assert set(json.loads(daemon.request("GET", "/-/status", headers={
            "Authorization": "Basic !!!"})[2])) == {"status", "version"}
        assert daemon.request("GET", "/-/status/runs", headers={
            "Authorization": "Basic !!!"})[0] == 403
        status, _, body = daemon.request("GET", "/-/status/runs", headers={
            "Authorization": basic("prometheus", TOKEN)})
        assert status == 200 and json.loads(body)[0]["id"] == run_id


def test_an_untrusted_browser_without_a_token_set_sees_only_health(daemon):
    relayed = dict(HTML, **{"X-Forwarded-For": "203.0.113.9"})
    status, headers, body = daemon.request("GET", "/-/status", headers=relayed)
    assert status == 200 and "www-authenticate" not in headers  # no password would help
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert b"webhookd is degraded" in body and b"echo" not in body and b"hooks.json" not in body
    status, headers, body = daemon.request("GET", "/-/status/runs", headers=relayed)
    assert status == 403 and "www-authenticate" not in headers and b"echo" not in body


def loud_daemon(tmp_path, commands, max_output):
    """A daemon whose hook `loud` runs these shell commands, keeping max_output per run."""
    loud = script(tmp_path / "loud.sh", commands)
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "loud", "execute-command": loud}])
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                             "-status-path", "/-/status", "-runs-max-output", str(max_output)),
                  port)


def test_a_run_page_holds_at_most_the_last_mib_of_output(tmp_path):
    with loud_daemon(tmp_path, "head -c 1572864 /dev/zero | tr '\\0' '<'\necho END\n",
                     4194304) as daemon:
        run_id = trigger(daemon, "loud")
        assert ended(daemon, run_id)["output_bytes"] == 1572864 + 4
        _, page = html_of(daemon, "/-/status/runs/" + run_id)
        assert page.count("&lt;") == (1 << 20) - 4 and "END" in page
        assert "Only the last 1024 KiB are shown here" in page
        assert '<a href="/-/status/runs/%s/output">all the kept output</a>' % run_id in page


@pytest.mark.parametrize("path", ["/status/", "/a//b", "/a/./b", "/st?x", "/st#x"])
def test_a_status_path_no_request_can_reach_is_refused_at_start(tmp_path, path):
    """Requests are routed cleaned (`/status//runs` is redirected to `/status/runs`) and cut at
    `?`: with such a -status-path the runs and metrics (or all of it) could never be reached."""
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "a", "execute-command": "/bin/true"}])
    result = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-status-path", path, "-ip",
                                       "127.0.0.1", "-port", str(free_port())),
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 1 and result.stderr == ""
    assert result.stdout.startswith("error: -status-path") and result.stdout.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# A real browser
# ---------------------------------------------------------------------------------------------

def browser_or_skip():
    missing = [name for name in ("chromium", "chromedriver") if not shutil.which(name)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium")
    if missing:
        pytest.skip("browser tests need %s: apt-get install chromium chromium-driver; "
                    "pip install 'selenium<4.52'" % ", ".join(missing))
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=390,844", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


@pytest.fixture(scope="module")
def browser():
    driver = browser_or_skip()
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def requested(browser):
    """The URLs the browser asked for since the last call."""
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def page_problems(browser):
    """Console errors since the last call (a refused inline script or style is one)."""
    return [entry["message"] for entry in browser.get_log("browser")
            if entry["level"] == "SEVERE" or "Content Security Policy" in entry["message"]]


def text_of(browser, css):
    from selenium.webdriver.common.by import By
    return browser.find_element(By.CSS_SELECTOR, css).text


def wait_for(browser, condition, what):
    """Wait (a hang detector) for condition(), read again when the page replaced an element."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, WAIT, ignored_exceptions=[StaleElementReferenceException]
                         ).until(lambda _: condition(), what)


def test_a_triggered_run_appears_on_the_page(browser, daemon):
    from selenium.webdriver.support.ui import Select
    base = "http://127.0.0.1:%d" % daemon.port
    requested(browser), page_problems(browser)
    browser.get(base + "/-/status")
    assert "slow" in text_of(browser, "body")
    run_id = trigger(daemon, "echo")
    ended(daemon, run_id)
    browser.refresh()
    assert run_id in text_of(browser, "body")
    browser.find_element("link text", run_id).click()
    wait_for(browser, lambda: HOSTILE_OUTPUT in text_of(browser, "#output"), "the run's output")
    assert text_of(browser, ".state") == "succeeded"
    assert browser.execute_script("return window.pwned") is None
    # it fits a phone: the page itself never scrolls sideways (wide tables scroll in a box)
    browser.get(base + "/-/status")
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth")
    assert HOSTILE_ID in text_of(browser, "body")
    assert browser.execute_script("return window.pwned") is None
    # the filter is a plain form: it works with the page's own policy
    browser.find_element("name", "hook").send_keys("echo")
    Select(browser.find_element("name", "state")).select_by_visible_text("succeeded")
    browser.find_element("css selector", "form button").click()
    wait_for(browser, lambda: "state=succeeded" in browser.current_url, "the filtered page")
    runs_shown = text_of(browser, "section:last-of-type")
    assert run_id in runs_shown and HOSTILE_ID not in runs_shown
    assert all(url.startswith((base + "/", "data:")) for url in requested(browser)), \
        "a request left the page's origin"
    assert page_problems(browser) == []


def test_a_running_run_is_followed_live_until_it_ends(browser, daemon):
    base = "http://127.0.0.1:%d" % daemon.port
    requested(browser), page_problems(browser)
    run_id = trigger(daemon, "slow")
    wait_until(lambda: json.loads(daemon.request("GET", "/-/status/runs/" + run_id)[2])[
        "output_bytes"] > 0, WAIT, "the first line")  # /output itself would follow the run
    browser.get(base + "/-/status/runs/" + run_id)
    browser.execute_script("window.sameDocument = true")
    assert text_of(browser, ".state") == "running"
    assert "first-line" in text_of(browser, "#output")
    wait_for(browser, lambda: "live" in text_of(browser, "#live"), "the script following")
    daemon.gate.touch()  # the command may print its second line and end
    wait_for(browser, lambda: "second-line" in text_of(browser, "#output"), "live output")
    wait_for(browser, lambda: text_of(browser, ".state") == "succeeded", "the state to change")
    assert browser.execute_script("return window.sameDocument") is True  # never reloaded
    assert text_of(browser, "#output").split() == ["first-line", "second-line"]
    assert "exit 0" in text_of(browser, "#run")
    assert all(url.startswith((base + "/", "data:")) for url in requested(browser))
    assert page_problems(browser) == []


def test_following_a_run_that_prints_on_keeps_only_a_tail_in_the_page(browser, tmp_path):
    """The page holds at most the last MiB of output; following it live must not grow it
    without end (a run printing for hours would fill the browser's memory): 3 MiB printed
    while the page follows leave at most 2 MiB in it."""
    gates = [tmp_path / "printed.gate", tmp_path / "end.gate"]
    with loud_daemon(tmp_path, "echo first-line\nwhile [ ! -e %s ]; do sleep 0.05; done\n"
                     "head -c 3145728 /dev/zero | tr '\\0' x\necho END\n"
                     "while [ ! -e %s ]; do sleep 0.05; done\n" % tuple(gates), 8388608) as daemon:
        run_id = trigger(daemon, "loud")
        wait_until(lambda: json.loads(daemon.request("GET", "/-/status/runs/" + run_id)[2])[
            "output_bytes"] > 0, WAIT, "the first line")
        browser.get("http://127.0.0.1:%d/-/status/runs/%s" % (daemon.port, run_id))
        wait_for(browser, lambda: "live" in text_of(browser, "#live"), "the script following")
        gates[0].touch()
        shown = "return document.getElementById('output').textContent"
        wait_for(browser, lambda: browser.execute_script(shown + ".endsWith('END\\n')"),
                 "the end of the output")
        assert browser.execute_script(shown + ".length") <= 2 << 20
        assert text_of(browser, ".state") == "running"  # (followed, not reloaded)
        gates[1].touch()
        ended(daemon, run_id)


def test_a_hook_answer_that_is_html_runs_no_script_on_the_status_origin(browser, tmp_path):
    """A hook that echoes its input, captured in its answer: Go's sniffing serves `<script>...`
    as text/html from the origin the status page (and its run history) is served from.  The
    answer is sandboxed, so the script neither runs nor could read the run history."""
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "echo", "execute-command": "/bin/echo", "include-command-output-in-response": True,
         "pass-arguments-to-command": [{"source": "url", "name": "text"}]}])
    port = free_port()
    page = "<script>document.title = 'pwned:' + typeof fetch</script><p>hello</p>"
    with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                           "-status-path", "/-/status"), port) as daemon:
        query = "?text=" + urllib.parse.quote(page)
        status, headers, _ = daemon.request("GET", "/hooks/echo" + query)
        assert status == 200 and headers["content-type"].startswith("text/html"), headers
        browser.get("http://127.0.0.1:%d/hooks/echo%s" % (port, query))
        from selenium.webdriver.common.by import By
        assert browser.find_element(By.TAG_NAME, "p").text == "hello"  # the page did load
        assert "pwned" not in browser.title, browser.title
