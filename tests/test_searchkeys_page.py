"""Issue 34 item 7, a page for people at `/keys/page`: the master key alone opens it (as HTTP
Basic's password, so that a browser can, or as Bearer); it lists the keys with their usage,
highlights the ones expiring soon and the ones never used, and charts each key's requests by
hour; its forms create a key from a preset, rotate or delete one, through the /keys API's own
handlers, and only from the page itself (same origin and the page's nonce). Black-box:
`searchkeys.py serve` on a free loopback port in front of a stand-in backend, real HTTP, and a
headless Chromium in a phone-sized window."""
import base64
import datetime
import http.server
import json
import re
import threading
import urllib.parse

import pytest

import searchkeys as sk

from test_searchkeys_restrictions import (  # noqa: F401 (backend: the stand-in's fixture)
    ADMIN, MASTER, backend, new_key, serve)
from test_webhookd_page import browser_or_skip, page_problems, wait_for

HOSTILE = '<script>window.pwned=1</script><img src=x>'
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def basic(user, password):
    return "Basic " + base64.b64encode(("%s:%s" % (user, password)).encode()).decode()


PEOPLE = {"Authorization": basic("admin", MASTER)}


@pytest.fixture(scope="module")
def guard(backend):  # noqa: F811
    with serve(backend) as daemon:
        yield daemon


def page(daemon, headers=PEOPLE, path="/keys/page"):
    status, answer, body = daemon.request("GET", path, None, headers)
    return status, answer, body.decode()


def nonce_of(text):
    return re.search(r'name="nonce" value="([^"]+)"', text).group(1)


def post(daemon, fields, headers=None):
    sent = dict(PEOPLE, **FORM)
    sent.update(headers or {})
    return daemon.request("POST", "/keys/page", urllib.parse.urlencode(fields), sent)


def key_named(daemon, uid):
    status, _, data = daemon.request("GET", "/keys/" + uid, None, ADMIN)
    return status, json.loads(data) if data else None


def search(daemon, key, index="movies"):
    return daemon.request("POST", "/indexes/%s/search" % index, '{"q": "x"}',
                          {"Authorization": "Bearer " + key["key"],
                           "Content-Type": "application/json"})[0]


# ---------------------------------------------------------------------------------------------
# Who may open it
# ---------------------------------------------------------------------------------------------

def test_without_the_master_key_the_page_asks_for_it(guard):
    for authorization in (None, basic("admin", "wrong"), basic(MASTER, ""), "Bearer wrong",
                          "Basic !!!not-base64!!!", "Basic " + base64.b64encode(
                              MASTER.encode()).decode(), "Digest " + MASTER):
        status, headers, body = page(guard, {"Authorization": authorization}
                                     if authorization else {})
        assert status == 401, (authorization, status)
        assert headers["www-authenticate"] == 'Basic realm="searchkeys", charset="UTF-8"'
        assert json.loads(body)["code"] == "master_key_required"
        assert "Default Search API Key" not in body
    for authorization in (basic("admin", MASTER), basic("", MASTER), "Bearer " + MASTER):
        status, headers, body = page(guard, {"Authorization": authorization})
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert "Default Search API Key" in body
    status, headers, _ = page(guard, {"Authorization": basic("admin", MASTER),
                                      "Origin": "http://127.0.0.1:%d" % guard.port,
                                      "Sec-Fetch-Mode": "navigate"})
    assert status == 200  # a browser's: the one place meant for the master key in a browser


def test_an_admin_key_is_refused_and_the_api_still_keeps_the_master_key_from_browsers(guard):
    admin = new_key(guard, None, ["*"])
    for authorization in (basic("admin", admin["key"]), "Bearer " + admin["key"]):
        status, headers, body = page(guard, {"Authorization": authorization})
        assert status == 401 and "www-authenticate" in headers, status
        assert admin["uid"] not in body
        status, _, _ = post(guard, {"change": "delete", "uid": admin["uid"]},
                            {"Authorization": authorization})
        assert status == 401
    assert key_named(guard, admin["uid"])[0] == 200
    status, _, data = guard.request("GET", "/keys/%s/usage" % admin["uid"], None, ADMIN)
    assert json.loads(data)["refused"]["action"] == 4  # counted like any refusal of a key
    # the API: the master key from a browser stays refused, and Basic is not a credential there
    status, _, data = guard.request("GET", "/keys", None, dict(ADMIN, Origin="http://x.example"))
    assert status == 403 and json.loads(data)["code"] == "api_key_not_for_browsers"
    status, _, data = guard.request("GET", "/keys", None, PEOPLE)
    assert status == 401 and json.loads(data)["code"] == "missing_authorization_header"


# ---------------------------------------------------------------------------------------------
# What it shows
# ---------------------------------------------------------------------------------------------

def test_the_page_lists_keys_with_usage_and_highlights_expiring_and_never_used_ones(guard):
    used = new_key(guard, {"rateLimit": {"perKey": "1000/minute"}}, ["search"], ["movies"])
    assert search(guard, used) == 200 and search(guard, used) == 200
    assert search(guard, used, "books") == 403
    soon = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=3)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    status, _, data = guard.request("POST", "/keys", json.dumps({
        "name": "expiring", "actions": ["search"], "indexes": ["*"], "expiresAt": soon}), ADMIN)
    expiring = json.loads(data)
    later = new_key(guard, None, ["search"])
    status, headers, body = page(guard)
    assert status == 200
    assert headers["cache-control"] == "no-store" and headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-content-type-options"] == "nosniff"
    policy = headers["content-security-policy"]
    assert policy.startswith("default-src 'none';") and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy and '<meta name="viewport"' in body
    rows = dict(re.findall(r'<tr id="key-([0-9a-f-]+)"(.*?)</tr>', body, re.S))
    assert "allowed 2" in rows[used["uid"]] and "index 1" in rows[used["uid"]]
    assert "last used 20" in rows[used["uid"]] and "never used" not in rows[used["uid"]]
    assert "movies" in rows[used["uid"]] and "1000/minute" in rows[used["uid"]]
    assert re.search(r"<title>this hour: 3</title>", rows[used["uid"]])  # the chart's bar
    assert rows[expiring["uid"]].startswith(' class="ends-soon"') and soon in rows[expiring["uid"]]
    assert 'class="soon">expires soon' in rows[expiring["uid"]]
    assert 'class="never"' in rows[expiring["uid"]] and 'class="never"' in rows[later["uid"]]
    assert not rows[later["uid"]].startswith(' class=')  # expires never: not highlighted
    # no key's value is on the page
    _, _, data = guard.request("GET", "/keys?limit=1000", None, ADMIN)
    for key in json.loads(data)["results"]:
        assert key["key"] not in body


def test_a_key_named_with_markup_is_shown_escaped(guard):
    status, _, data = guard.request("POST", "/keys", json.dumps({
        "name": HOSTILE, "description": '"><b>bold</b>', "actions": ["search"],
        "indexes": ["*"], "expiresAt": None}), ADMIN)
    _, _, body = page(guard)
    assert HOSTILE not in body and "<b>bold</b>" not in body
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;&lt;img src=x&gt;" in body
    assert "&quot;&gt;&lt;b&gt;bold&lt;/b&gt;" in body


# ---------------------------------------------------------------------------------------------
# Changes: only from the page itself
# ---------------------------------------------------------------------------------------------

def test_a_change_without_the_page_nonce_or_from_another_site_is_refused(guard):
    victim = new_key(guard, None, ["search"])
    _, _, body = page(guard)
    nonce = nonce_of(body)
    served, _, signature = nonce.rpartition(".")
    delete = {"change": "delete", "uid": victim["uid"]}
    refused = [
        ({}, {}), ({"nonce": ""}, {}), ({"nonce": "x" * 60}, {}),
        ({"nonce": served + "." + signature[:-2] + ("AA" if signature[-2:] != "AA" else "BB")},
         {}),
        ({"nonce": served.replace(".", ".x", 1) + "." + signature}, {}),
        ({"nonce": nonce}, {"Origin": "http://evil.example"}),
        ({"nonce": nonce}, {"Origin": "null"}),
        ({"nonce": nonce}, {"Origin": "null", "Sec-Fetch-Site": "same-site"}),
        ({"nonce": nonce}, {"Origin": "http://127.0.0.1:%d.evil.example" % guard.port}),
        ({"nonce": nonce}, {"Sec-Fetch-Site": "cross-site"}),
        ({"nonce": nonce}, {"Sec-Fetch-Site": "same-site"}),
        ({"nonce": nonce}, {"Sec-Fetch-Site": "same-origin", "Origin": "https://evil.example"}),
    ]
    for fields, headers in refused:
        status, answer, data = post(guard, dict(delete, **fields), headers)
        assert status == 403, (fields, headers, status)
        assert "nothing was changed" in data.decode() and "location" not in answer
        assert key_named(guard, victim["uid"])[0] == 200, (fields, headers)
    # from the page: Chromium sends Origin: null under the page's no-referrer policy
    for headers in ({"Origin": "http://127.0.0.1:%d" % guard.port, "Sec-Fetch-Site":
                     "same-origin"}, {"Origin": "null", "Sec-Fetch-Site": "same-origin"}, {}):
        victim = new_key(guard, None, ["search"])
        status, answer, _ = post(guard, dict(delete, uid=victim["uid"], nonce=nonce), headers)
        assert status == 303 and answer["location"] == "/keys/page"
        assert key_named(guard, victim["uid"])[0] == 404


def test_a_failed_change_shows_the_page_with_the_api_error(guard):
    nonce = nonce_of(page(guard)[2])
    status, _, data = post(guard, {"nonce": nonce, "change": "create", "preset": "search",
                                   "indexes": "bad index!", "name": "x"})
    assert status == 400 and "bad index!" in data.decode() and 'id="problem"' in data.decode()
    status, _, data = post(guard, {"nonce": nonce, "change": "rotate",
                                   "uid": "00000000-0000-4000-8000-000000000000"})
    assert status == 404 and "not found" in data.decode()


# ---------------------------------------------------------------------------------------------
# In a real browser, on a phone-sized screen
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    driver = browser_or_skip()  # a 390x844 window: a phone's
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


def open_page(browser, guard):
    browser.get("http://admin:%s@127.0.0.1:%d/keys/page" % (MASTER, guard.port))
    wait_for(browser, lambda: browser.find_elements("id", "keys"), "the keys table")


def row_button(browser, uid, label):
    row = browser.find_element("id", "key-" + uid)
    return [button for button in row.find_elements("tag name", "button")
            if button.text == label][0]


def submit_and_confirm(browser, button):
    from selenium.webdriver.support.ui import WebDriverWait
    button.click()
    alert = WebDriverWait(browser, 20).until(lambda driver: driver.switch_to.alert)
    alert.accept()


def test_in_a_browser_create_rotate_and_delete_work_and_the_api_sees_them(browser, guard):
    from selenium.webdriver.support.ui import Select
    open_page(browser, guard)
    assert page_problems(browser) == []
    # a phone: the table fits the width (rows become cards), nothing scrolls sideways
    assert browser.execute_script("return document.documentElement.scrollWidth"
                                  " <= window.innerWidth")
    Select(browser.find_element("name", "preset")).select_by_visible_text("backend")
    browser.find_element("name", "name").send_keys("made in a browser")
    indexes = browser.find_element("name", "indexes")
    indexes.clear()
    indexes.send_keys("movies, books")
    browser.find_element("css selector", "#create button").click()
    wait_for(browser, lambda: browser.find_elements("id", "created"), "the new key")
    uid = re.search(r"created=([0-9a-f-]+)", browser.current_url).group(1)
    status, made = key_named(guard, uid)
    assert status == 200 and made["name"] == "made in a browser"
    assert made["indexes"] == ["movies", "books"] and "documents.*" in made["actions"]
    assert made["key"] in browser.find_element("id", "created").text  # shown once, here
    open_page(browser, guard)
    assert made["key"] not in browser.page_source  # and not in the listing

    submit_and_confirm(browser, row_button(browser, uid, "Rotate"))
    wait_for(browser, lambda: "created=" in browser.current_url
             and browser.find_elements("id", "created"), "the rotated key")
    new_uid = re.search(r"created=([0-9a-f-]+)", browser.current_url).group(1)
    status, old = key_named(guard, uid)
    assert status == 200 and old["replacedBy"] == new_uid and old["retiresAt"]
    status, new = key_named(guard, new_uid)
    assert status == 200 and new["name"] == "made in a browser"
    assert new["key"] in browser.find_element("id", "created").text

    open_page(browser, guard)
    submit_and_confirm(browser, row_button(browser, new_uid, "Delete"))
    wait_for(browser, lambda: not browser.find_elements("id", "key-" + new_uid), "the deletion")
    assert key_named(guard, new_uid)[0] == 404
    assert page_problems(browser) == []

    # the deleted key is listed, without its value, and the page brings it back
    deleted = browser.find_element("id", "deleted-" + new_uid)
    assert new["key"] not in browser.page_source
    submit_and_confirm(browser, deleted.find_element("css selector", "button"))
    wait_for(browser, lambda: browser.find_elements("id", "key-" + new_uid)
             and not browser.find_elements("id", "deleted-" + new_uid), "the restore")
    status, restored = key_named(guard, new_uid)
    assert status == 200 and restored["key"] == new["key"]
    assert page_problems(browser) == []


def test_in_a_browser_a_form_from_another_site_changes_nothing(browser, guard):
    """Another site's page (here another port: same site, another origin) posts the delete
    form, even with a nonce it somehow holds: the browser says where the form comes from."""
    victim = new_key(guard, None, ["search"])
    nonce = nonce_of(page(guard)[2])
    form = ('<!DOCTYPE html><form method="post" action="http://127.0.0.1:%d/keys/page">'
            '<input type="hidden" name="nonce" value="%s"><input type="hidden" name="change" '
            'value="delete"><input type="hidden" name="uid" value="%s"><button id="go">win'
            '</button></form>' % (guard.port, nonce, victim["uid"])).encode()

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(form)))
            self.end_headers()
            self.wfile.write(form)

        def log_message(self, *args):
            pass
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)  # (speculative
    # connections a browser opens and leaves idle must not hold the one that is asked)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        open_page(browser, guard)  # signed in: the browser holds the master key for the page
        browser.get("http://127.0.0.1:%d/" % site.server_address[1])
        browser.find_element("id", "go").click()
        wait_for(browser, lambda: "nothing was changed" in browser.page_source, "the refusal")
        assert "another site (Sec-Fetch-Site: same-site)" in browser.page_source
        assert key_named(guard, victim["uid"])[0] == 200
    finally:
        site.shutdown()
        site.server_close()
    browser.get_log("browser")  # (the refusal's 403 is the test's, not the page's, problem)


def test_in_a_browser_a_hostile_key_name_runs_nothing(browser, guard):
    status, _, data = guard.request("POST", "/keys", json.dumps({
        "name": HOSTILE, "actions": ["search"], "indexes": ["*"], "expiresAt": None}), ADMIN)
    uid = json.loads(data)["uid"]
    open_page(browser, guard)
    assert browser.execute_script("return window.pwned") is None
    assert HOSTILE in browser.find_element("id", "key-" + uid).text
    assert page_problems(browser) == []


# ---------------------------------------------------------------------------------------------
# The pure parts no test can wait for: an hour's nonce, a day of hourly counts
# ---------------------------------------------------------------------------------------------

def test_a_page_nonce_holds_for_an_hour_from_its_page_and_with_its_master_key():
    nonces, now = sk.PageNonces(MASTER), 1800000000
    nonce = nonces.mint(now)
    assert nonces.valid(nonce, now) and nonces.valid(nonce, now + 3600)
    assert not nonces.valid(nonce, now + 3601) and not nonces.valid(nonce, now - 1)
    assert not sk.PageNonces(MASTER + "x").valid(nonce, now)
    assert nonces.mint(now) != nonce  # one a page
    assert not sk.PageNonces(None).valid(nonce, now)


def test_hourly_counts_keep_the_last_day_per_key():
    usage, hour = sk.Usage(), 3600 * 10 ** 9
    start = 500000 * hour
    for at, count in ((start, 3), (start + hour, 1), (start + 30 * hour, 2)):
        for _ in range(count):
            usage.count("k", None, at + 5)
    assert usage.hourly("k", start + hour) == [0] * 22 + [3, 1]
    assert usage.hourly("k", start + 24 * hour) == [1] + [0] * 23  # start's hour is past
    assert usage.hourly("k", start + 30 * hour) == [0] * 23 + [2]  # a reused bucket starts at 0
    usage.count("k", "index", start + 30 * hour)
    assert usage.hourly("k", start + 30 * hour)[-1] == 3 and usage.hourly("j", start) == [0] * 24
    usage.load(None, {})  # the key is gone (another process deleted it): so are its hours
    assert usage.hourly("k", start + 30 * hour) == [0] * 24
