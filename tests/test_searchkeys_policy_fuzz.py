"""Policy fuzzer (issue 21): a key never gets more than it was given.

Thousands of random requests (routes of Meilisearch 1.50's table, methods, encodings of path
and query, bodies with filters, limits, pages, federation and multi-search; API keys, tenant
tokens and broken credentials) go through the real `searchkeys.py serve` to a stand-in backend
that records what it receives. Every request the backend receives, and every answer the guard
filters, is checked against an independent statement of Meilisearch's rules written here from
the spec and Meilisearch's source (nothing of searchkeys.py is imported):

  (a) the caller's key (or its tenant token's parent key) may do the route's action(s) on every
      index the request touches (path, `queries[].indexUid`, swap bodies, index creation
      `uid`), with wildcard actions, index patterns and expiry as Meilisearch reads them;
      listings and answers of a restricted key hold only its indexes;
  (b) a tenant token's filter for the index is AND-ed in as Meilisearch's `fuse_filters` does;
  (c) no search asks for more hits than the key's `maxHitsPerQuery`, and no multi-search runs
      more queries than the key's rate limit allows (each query counts as one request);
  (d) the backend gets the upstream key, never the caller's credential, and no hop-by-hop
      header the caller sent;
  (e) a key's forcedParameters (issue 23): on an index its most specific pattern covers, every
      search the backend runs has the forced filter AND-ed in after the caller's and the
      token's, and each other forced parameter as forced (on the routes that take it; a
      federated query's `facets` in the federation's facetsByIndex); documents of a covered
      index, and routes whose indexes the guard cannot see, never reach the backend;
  (f) documents read (issue 34: searchkeys lets a tenant token read documents when its key
      may): listed or fetched, with the token's and the forced filter fused in as on a search,
      the fields within a forced attributesToRetrieve and no vectors unless it shows them, and
      for a token within the index's displayedAttributes too (as its searches show them); one
      document under a filter, or of a token on an index that hides attributes, never asked of
      the backend by its id alone (its fetch is (f));
  (g) issue 34's restrictions: an admin credential (the master key, or a key holding more than
      `search` without `allowBrowser`) sent with a browser's signal (`Origin`, `Referer`,
      `Sec-Fetch-Mode`) gets nothing through; the backend never runs more searches of a key at
      once than its maxConcurrentSearches, and `/authorize` never lets one of them through
      (nginx never says when the answer has gone); a tenant token revoked (by
      `/keys/{key}/revoke-tokens` before its `iat`, or singly) is refused.
A `GET /authorize` answered 204 is checked as if nginx forwarded the request unchanged, and the
same request is then forwarded through the guard: it must reach the backend exactly as sent
(`/authorize` never allows what forwarding refuses or would rewrite).

Seeded: FUZZ_SEED (default fixed), FUZZ_COUNT (cases), FUZZ_CASE (run one case only).
FUZZ_STRICT=1 also fails on requests the guard refused that Meilisearch would have allowed
(otherwise they are only counted).
"""
import base64
import calendar
import hashlib
import collections
import hmac
import http.client
import http.server
import json
import os
import random
import re
import threading
import time
import urllib.parse
import uuid

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd, serve_in_thread

SEED = int(os.environ.get("FUZZ_SEED", "20261126"))
COUNT = int(os.environ.get("FUZZ_COUNT", "2000"))
ONLY_CASE = os.environ.get("FUZZ_CASE")
STRICT = os.environ.get("FUZZ_STRICT") == "1"
WORKERS = 4

MASTER = "fuzz-master-key-0123456789abcdef"
UPSTREAM_KEY = "FUZZ-UPSTREAM-ADMIN-KEY"

# ---------------------------------------------------------------------------------------------
# The oracle: Meilisearch 1.50's rules, written from meilisearch-keys.md and Meilisearch's source
# (crates/meilisearch-types/src/keys.rs, meilisearch-auth/src/{lib,store}.rs, the routes).
# ---------------------------------------------------------------------------------------------

ACTIONS = """* search documents.* documents.add documents.get documents.delete indexes.*
indexes.create indexes.get indexes.update indexes.delete indexes.swap tasks.* tasks.cancel
tasks.delete tasks.get settings.* settings.get settings.update stats.* stats.get metrics.*
metrics.get dumps.* dumps.create snapshots.* snapshots.create version keys.create keys.get
keys.update keys.delete experimental.get experimental.update export network.get network.update
chatCompletions chats.* chats.get chats.delete chatsSettings.* chatsSettings.get
chatsSettings.update *.get webhooks.get webhooks.update webhooks.delete webhooks.create
webhooks.* indexes.compact fields.post tasks.compact dynamicSearchRules.get
dynamicSearchRules.create dynamicSearchRules.update dynamicSearchRules.delete
dynamicSearchRules.*""".split()
READ_ACTIONS = set("""search documents.get export indexes.get tasks.get settings.get stats.get
metrics.get version experimental.get network.get chats.get chatsSettings.get webhooks.get
fields.post dynamicSearchRules.get""".split())
FAMILY = {  # store.rs put_api_key: what a wildcard action stands for
    "*": set(ACTIONS) - {"*.get"}, "*.get": READ_ACTIONS,
    "documents.*": {"documents.add", "documents.get", "documents.delete"},
    "indexes.*": {"indexes.create", "indexes.get", "indexes.update", "indexes.delete",
                  "indexes.swap", "indexes.compact"},
    "tasks.*": {"tasks.get", "tasks.delete", "tasks.cancel", "tasks.compact"},
    "settings.*": {"settings.get", "settings.update"}, "stats.*": {"stats.get"},
    "metrics.*": {"metrics.get"}, "dumps.*": {"dumps.create"},
    "snapshots.*": {"snapshots.create"}, "chats.*": {"chats.get", "chats.delete"},
    "chatsSettings.*": {"chatsSettings.get", "chatsSettings.update"},
    "webhooks.*": {"webhooks.get", "webhooks.update", "webhooks.delete", "webhooks.create"},
    "dynamicSearchRules.*": {"dynamicSearchRules.get", "dynamicSearchRules.create",
                             "dynamicSearchRules.update", "dynamicSearchRules.delete"},
}
# keys.rs index_scope: actions an index-scoped key may use on routes without an index
ROUTE_HANDLER_CHECKS = set("""search documents.get indexes.create indexes.get indexes.swap
tasks.cancel tasks.delete tasks.get settings.get stats.* stats.get chatCompletions""".split())
DENY_INDEX_SCOPE = set("""metrics.* metrics.get dumps.* dumps.create snapshots.*
snapshots.create version keys.create keys.get keys.update keys.delete experimental.get
experimental.update export network.get network.update chats.* chats.get chats.delete
chatsSettings.* chatsSettings.get chatsSettings.update webhooks.get webhooks.update
webhooks.delete webhooks.create webhooks.* tasks.compact dynamicSearchRules.get
dynamicSearchRules.create dynamicSearchRules.update dynamicSearchRules.delete
dynamicSearchRules.*""".split())


def granted(actions):
    out = set()
    for action in actions:
        out |= FAMILY.get(action, {action})
    return out


def matches(pattern, index):
    """IndexUidPattern::matches_str: one trailing `*` makes a prefix."""
    return index.startswith(pattern[:-1]) if pattern.endswith("*") else pattern == index


VALID_UID = re.compile(r"[A-Za-z0-9_-]{1,400}\Z")

SETTINGS_PUT = """filterable-attributes sortable-attributes displayed-attributes
searchable-attributes stop-words non-separator-tokens separator-tokens dictionary synonyms
distinct-attribute proximity-precision localized-attributes ranking-rules search-cutoff-ms
facet-search prefix-search foreign-keys""".split()
SETTINGS_PATCH = "typo-tolerance faceting pagination embedders chat".split()

# (path, {method: actions}); first path that matches wins, as actix's resources. A route's
# special handling (what it touches besides the path) is looked up by (method, path).
ROUTE_TABLE = [
    ("/version", {"GET": ["version"]}), ("/stats", {"GET": ["stats.get"]}),
    ("/keys", {"GET": ["keys.get"], "POST": ["keys.create"]}),
    ("/keys/{key}", {"GET": ["keys.get"], "PATCH": ["keys.update"], "DELETE": ["keys.delete"]}),
    ("/indexes", {"GET": ["indexes.get"], "POST": ["indexes.create"]}),
    ("/indexes/{index_uid}", {"GET": ["indexes.get"], "PATCH": ["indexes.update"],
                              "DELETE": ["indexes.delete"]}),
    ("/indexes/{index_uid}/stats", {"GET": ["stats.get"]}),
    ("/indexes/{index_uid}/fields", {"POST": ["fields.post"]}),
    ("/indexes/{index_uid}/compact", {"POST": ["indexes.compact"]}),
    ("/indexes/{index_uid}/search", {"GET": ["search"], "POST": ["search"]}),
    ("/indexes/{index_uid}/facet-search", {"POST": ["search"]}),
    ("/indexes/{index_uid}/similar", {"GET": ["search"], "POST": ["search"]}),
    ("/indexes/{index_uid}/documents", {"GET": ["documents.get"], "POST": ["documents.add"],
                                        "PUT": ["documents.add"],
                                        "DELETE": ["documents.delete"]}),
    ("/indexes/{index_uid}/documents/delete-batch", {"POST": ["documents.delete"]}),
    ("/indexes/{index_uid}/documents/delete", {"POST": ["documents.delete"]}),
    ("/indexes/{index_uid}/documents/fetch", {"POST": ["documents.get"]}),
    ("/indexes/{index_uid}/documents/edit", {"POST": ["documents.*"]}),
    ("/indexes/{index_uid}/documents/{document_id}", {"GET": ["documents.get"],
                                                      "DELETE": ["documents.delete"]}),
    ("/indexes/{index_uid}/settings", {"GET": ["settings.get"], "PATCH": ["settings.update"],
                                       "DELETE": ["settings.update"]}),
] + [("/indexes/{index_uid}/settings/" + name,
      {"GET": ["settings.get"], verb: ["settings.update"], "DELETE": ["settings.update"]})
     for names, verb in ((SETTINGS_PUT, "PUT"), (SETTINGS_PATCH, "PATCH")) for name in names] + [
    ("/multi-search", {"POST": ["search"]}), ("/swap-indexes", {"POST": ["indexes.swap"]}),
    ("/render-template", {"POST": ["settings.get", "documents.get"]}),
    ("/tasks", {"GET": ["tasks.get"], "DELETE": ["tasks.delete"]}),
    ("/tasks/cancel", {"POST": ["tasks.cancel"]}), ("/tasks/compact", {"POST": ["tasks.compact"]}),
    ("/tasks/{task_id}", {"GET": ["tasks.get"]}),
    ("/tasks/{task_id}/documents", {"GET": ["tasks.get"]}),
    ("/batches", {"GET": ["tasks.get"]}), ("/batches/{batch_id}", {"GET": ["tasks.get"]}),
    ("/dumps", {"POST": ["dumps.create"]}), ("/snapshots", {"POST": ["snapshots.create"]}),
    ("/metrics", {"GET": ["metrics.get"]}),
    ("/logs/stream", {"POST": ["metrics.get"], "DELETE": ["metrics.get"]}),
    ("/logs/stderr", {"POST": ["metrics.get"]}),
    ("/experimental-features", {"GET": ["experimental.get"], "PATCH": ["experimental.update"]}),
    ("/export", {"POST": ["export"]}),
    ("/network", {"GET": ["network.get"], "PATCH": ["network.update"]}),
    ("/network/control", {"POST": ["network.update"]}),
    ("/webhooks", {"GET": ["webhooks.get"], "POST": ["webhooks.create"]}),
    ("/webhooks/{uuid}", {"GET": ["webhooks.get"], "PATCH": ["webhooks.update"],
                          "DELETE": ["webhooks.delete"]}),
    ("/dynamic-search-rules", {"POST": ["dynamicSearchRules.get"],
                               "DELETE": ["dynamicSearchRules.delete"]}),
    ("/dynamic-search-rules/{rule}", {"GET": ["dynamicSearchRules.get"],
                                      "PATCH": ["dynamicSearchRules.update"],
                                      "DELETE": ["dynamicSearchRules.delete"]}),
    ("/chats", {"GET": ["chats.get"]}),
    ("/chats/{workspace}", {"GET": ["chats.get"], "DELETE": ["chats.delete"]}),
    ("/chats/{workspace}/settings", {"GET": ["chatsSettings.get"],
                                     "PATCH": ["chatsSettings.update"],
                                     "DELETE": ["chatsSettings.update"]}),
    ("/chats/{workspace}/chat/completions", {"POST": ["chatCompletions"]}),
    ("/health", {"GET": []}), ("/", {"GET": []}),
]
TOKEN_ACTIONS = ("search", "chatCompletions", "documents.get")  # (f): searchkeys' addition
SEARCH_BODY = {("POST", "/indexes/{index_uid}/search"), ("POST", "/indexes/{index_uid}/similar"),
               ("POST", "/indexes/{index_uid}/facet-search")}
SEARCH_QUERY = {("GET", "/indexes/{index_uid}/search"), ("GET", "/indexes/{index_uid}/similar")}
TASK_LISTINGS = {("GET", "/tasks"), ("GET", "/batches"), ("DELETE", "/tasks"),
                 ("POST", "/tasks/cancel")}
TASK_FILTERS = ("uids batchUids canceledBy types statuses indexUids afterEnqueuedAt "
                "beforeEnqueuedAt afterStartedAt beforeStartedAt afterFinishedAt "
                "beforeFinishedAt").split()
# writes that create a missing index when the key may create indexes (allow_index_creation)
CREATING = {("POST", "/indexes/{index_uid}/documents"), ("PUT", "/indexes/{index_uid}/documents"),
            ("PATCH", "/indexes/{index_uid}/settings")} | {
    ("PUT", "/indexes/{index_uid}/settings/" + n) for n in SETTINGS_PUT} | {
    ("PATCH", "/indexes/{index_uid}/settings/" + n) for n in SETTINGS_PATCH}
# (g) the routes that run searches: a key's maxConcurrentSearches holds them
SEARCHES = SEARCH_BODY | SEARCH_QUERY | {("POST", "/multi-search")}
# handlers whose index checks the guard cannot see (the chat's search tool, template's document)
UNVERIFIABLE = {("POST", "/render-template"), ("POST", "/chats/{workspace}/chat/completions")}
DEFAULT_LIMIT = 20
# (e) forcedParameters given to some keys of the pool, and which of them each route takes
FORCED_CHOICES = [
    {"movies*": {"filter": "public = true", "attributesToRetrieve": ["title"],
                 "facets": ["genre"], "showRankingScore": False}},
    {"*": {"filter": ["a = 1", ["b = 2", "c = 3"]]},
     "tenant_a": {"attributesToRetrieve": ["id", "title"], "matchingStrategy": "all"}},
]
FORCED_KEYS = {name for forced in FORCED_CHOICES for entry in forced.values() for name in entry}
SIMILAR_TAKES = {"filter", "attributesToRetrieve", "retrieveVectors", "showRankingScore",
                 "showRankingScoreDetails", "rankingScoreThreshold"}
FACET_SEARCH_TAKES = {"filter", "matchingStrategy", "attributesToSearchOn",
                      "rankingScoreThreshold", "locales"}
DOCUMENT_READS = {("GET", "/indexes/{index_uid}/documents"),
                  ("GET", "/indexes/{index_uid}/documents/{document_id}"),
                  ("POST", "/indexes/{index_uid}/documents/fetch")}
FORCED_BYPASSES = {("GET", "/tasks/{task_id}/documents"), ("POST", "/export"),
                   ("POST", "/render-template"), ("POST", "/chats/{workspace}/chat/completions")}


def _route_parts(path):
    return tuple(path.split("/")[1:]) if path != "/" else ()


ROUTES = [(_route_parts(path), path, methods) for path, methods in ROUTE_TABLE]
_PCT = re.compile(rb"%([0-9A-Fa-f]{2})")


def requote(segment):
    """actix's Url: percent escapes decoded, except those of `/`, `%` and `+`."""
    def one(match):
        byte = int(match.group(1), 16)
        return match.group(0) if byte in (0x2F, 0x25, 0x2B) else bytes([byte])
    return _PCT.sub(one, segment.encode("latin-1", "replace")).decode("utf-8", "replace")


def route_of(method, target):
    """Meilisearch's routing of a request target: (path template, actions, params) with the
    params fully decoded; "405" or None (404)."""
    path = target.split("?", 1)[0]
    path = re.sub("/+", "/", path)  # NormalizePath::trim
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    segments = tuple(path.split("/")[1:]) if path not in ("", "/") else ()
    for parts, template, methods in ROUTES:
        if len(parts) != len(segments):
            continue
        params = {}
        for want, got in zip(parts, segments):
            if want.startswith("{"):
                if not got:
                    break
                params[want[1:-1]] = urllib.parse.unquote(got, errors="replace")
            elif requote(got) != want:
                break
        else:
            if method not in methods:
                return "405"
            return template, methods[method], params
    return None


def query_pairs(query):
    """(decoded name, decoded value) pairs of a query string, as serde_urlencoded reads them."""
    return urllib.parse.parse_qsl(query, keep_blank_values=True, errors="replace")


def last_param(pairs, name):
    values = [v for n, v in pairs if n == name]
    return values[-1] if values else None


def rust_usize(text):
    if text is None or not re.match(r"\+?[0-9]+\Z", text):
        return None
    value = int(text)
    return value if value < 2 ** 64 else None


class Credential:
    """What the caller presented, and what Meilisearch makes of it."""

    def __init__(self, header, kind, key=None, token_rules=None, token_valid=False, secret=None):
        # kind: none, bad (malformed header), master, key, token, unknown (no such key)
        self.header, self.kind, self.key = header, kind, key
        self.rules, self.token_valid, self.secret = token_rules, token_valid, secret

    def describe(self):
        key = self.key
        shape = "" if key is None else " key(actions=%s, indexes=%s, expired=%s, cap=%s, " \
            "rate=%s/second%s%s%s)" % (key["actions"], key["indexes"], key["expired"],
                                       key["cap"], key["rate"],
                                       ", deleted" if key["deleted"] else "",
                                       ", forced=%s" % json.dumps(key["forced"])
                                       if key.get("forced") else "", "".join(
                                           ", %s=%s" % (name, key[name]) for name in EXTRAS
                                           if key.get(name)))
        rules = "" if self.rules is None else " searchRules=%s valid=%s" % (
            json.dumps(self.rules), self.token_valid)
        return self.kind + shape + rules

    def key_for(self, action):
        """The key record this credential authenticates as for `action`, "master", or None."""
        if self.kind == "master":
            return "master"
        if self.key is not None and self.key["deleted"]:
            return None
        if self.kind == "key":
            return self.key
        if self.kind == "token":
            # only search routes read tenant tokens; elsewhere a JWT is an unknown API key
            return self.key if action in TOKEN_ACTIONS and self.token_valid else None
        return None

    def covers(self, index, action):
        """AuthFilter::is_index_authorized for the principal of `action`."""
        key = self.key_for(action)
        if key is None:
            return False
        if key == "master":
            return True
        if not any(matches(p, index) for p in key["indexes"]):
            return False
        if self.kind == "token":
            return any(matches(p, index) for p in self.rules)
        return True

    def may(self, action, index):
        """ActionPolicy::authenticate + is_key_authorized for a route's index (or None)."""
        key = self.key_for(action)
        if key is None:
            return False
        if key == "master":
            return True
        if index is not None and not self.covers(index, action):
            return False
        if key["expired"] or action not in granted(key["actions"]):
            return False
        if "*" in key["indexes"] or index is not None:
            return True
        return action in ROUTE_HANDLER_CHECKS and bool(key["indexes"])

    def all_indexes(self, action):
        """AuthFilter::all_indexes_authorized: nothing for a handler to filter."""
        key = self.key_for(action)
        if key == "master":
            return True
        if key is None or "*" not in key["indexes"]:
            return False
        return self.kind != "token" or "*" in self.rules

    def may_create_index(self, index):
        """allow_index_creation: indexes.create on no particular index, and the index covered."""
        return self.may("indexes.create", None) and self.covers(index, "indexes.create")

    def tenant_filters(self, index):
        """The filters the token's most specific rule for `index` adds (ties: any of them)."""
        if self.kind != "token" or not isinstance(self.rules, dict):
            return [None]
        hits = [p for p in self.rules if matches(p, index)]
        if not hits:
            return [None]
        best = max((not p.endswith("*"), len(p)) for p in hits)
        rules = [self.rules[p] for p in hits if (not p.endswith("*"), len(p)) == best]
        # serde reads the one-field IndexSearchRules from an object or a one-element array
        return [r.get("filter") if isinstance(r, dict) else r[0] if isinstance(r, list)
                else None for r in rules]

    def cap(self):
        key = self.key if self.kind in ("key", "token") else None
        return key["cap"] if key else None

    def forced(self, index):
        """(e) The parameters the key's most specific forcedParameters pattern forces on
        `index`, or None."""
        key = self.key if self.kind in ("key", "token") else None
        forced = key.get("forced") if key else None
        hits = [p for p in forced or () if matches(p, index)]
        if not hits:
            return None
        return forced[max(hits, key=lambda p: (not p.endswith("*"), len(p)))]

    def has_forced(self):
        key = self.key if self.kind in ("key", "token") else None
        return bool(key and key.get("forced"))

    def rate(self):
        """The requests per second the key's perKey rate limit allows, or None."""
        key = self.key if self.kind in ("key", "token") else None
        return key["rate"] if key else None

    def concurrent(self):
        """(g) The searches the key may run at once (maxConcurrentSearches), or None."""
        key = self.key if self.kind in ("key", "token") else None
        return key.get("concurrent") if key else None

    def admin_from_browser(self, browser):
        """(g) A credential a browser may not use: the master key, or an API key holding any
        action beyond `search` without `allowBrowser` (a tenant token only ever searches)."""
        if not browser:
            return False
        return self.kind == "master" or self.kind == "key" and not self.key.get(
            "allow_browser") and any(action != "search" for action in self.key["actions"])


ABSENT = object()  # no filter at all (a GET's `filter=null` is JSON null, a filter of its own)


def fuse(left, right):
    """search::fuse_filters; `left` is ABSENT or a value (None: JSON null)."""
    if left is ABSENT:
        return right
    if right is None:
        return left
    return (left if isinstance(left, list) else [left]) + (right if isinstance(right, list)
                                                          else [right])


def asked_hits(query, route):
    """Hits a search object asks for, as Meilisearch reads it (0: the backend refuses it).
    `page`/`hitsPerPage` set (not null) switch to pages of `hitsPerPage` (default 20)."""
    if not isinstance(query, dict):
        return 0
    def count(name):
        value = query.get(name)
        return value if type(value) is int and value >= 0 else (None if value is None else -1)
    if route == "similar" and ("page" in query or "hitsPerPage" in query):
        return 0  # unknown fields for /similar
    page, per_page, limit = count("page"), count("hitsPerPage"), count("limit")
    if -1 in (page, per_page, limit):
        return 0
    if page is not None or per_page is not None:
        return DEFAULT_LIMIT if per_page is None else per_page
    return DEFAULT_LIMIT if limit is None else limit


def asked_hits_in_query(pairs, route):
    names = {n for n, _ in pairs}
    if route == "similar" and names & {"page", "hitsPerPage"}:
        return 0
    values = {}
    for name in ("page", "hitsPerPage", "limit"):
        raw = last_param(pairs, name)
        if raw is not None:
            values[name] = rust_usize(raw)
            if values[name] is None:
                return 0
    if "page" in values or "hitsPerPage" in values:
        return values.get("hitsPerPage", DEFAULT_LIMIT)
    return values.get("limit", DEFAULT_LIMIT)


def get_filter(pairs):
    """A GET search's `filter` parameter as Meilisearch reads it: JSON if it parses, else text."""
    raw = last_param(pairs, "filter")
    if raw is None:
        return ABSENT
    try:
        return json.loads(raw)
    except ValueError:
        return raw


# ---------------------------------------------------------------------------------------------
# The stand-in backend's world: which indexes exist, tasks and batches with their indexes.
# ---------------------------------------------------------------------------------------------

INDEX_POOL = ["movies", "movies_fr", "movies-2", "mov", "books", "books_de", "music", "secret",
              "tenant_a", "tenant_b", "a", "ab", "new_index", "zzz"]
EXISTING = ["movies", "movies_fr", "movies-2", "books", "books_de", "music", "secret",
            "tenant_a", "a", "ab"]
# The existing indexes' displayedAttributes (the others': all, `*`).
DISPLAYED = {"movies": ["id", "title"], "music": ["id", "_vectors"]}
PATTERNS = ["movies", "movies*", "mov*", "books*", "books", "music", "tenant_a", "tenant_*",
            "a*", "ab", "secret", "m*", "nothing", "new_index"]
TASK_INDEX = {t: (INDEX_POOL[t % len(INDEX_POOL)] if t % 7 else None) for t in range(40)}
ERRING_TASKS = range(50, 60)  # exist (on `secret`) but the backend answers 500 to GET /tasks/{id}
BATCH_INDEXES = {b: [INDEX_POOL[(b * k) % len(INDEX_POOL)] for k in range(1, 2 + b % 3)]
                 for b in range(20)}
# A batch's `stats.types`: one-index writes, but for a dump and a swap, whose tasks have no
# `indexUid` (so none in `stats.indexUids`) and which Meilisearch never batches with others.
BATCH_TYPES = {b: {"documentAdditionOrUpdate": 1, "settingsUpdate": 1} for b in BATCH_INDEXES}
BATCH_INDEXES[0], BATCH_TYPES[0] = [], {"dumpCreation": 1}
BATCH_INDEXES[18], BATCH_TYPES[18] = [], {"indexSwap": 1}
# Kind::related_to_one_index (meilisearch-types tasks/mod.rs)
ONE_INDEX_KINDS = set("""documentAdditionOrUpdate documentEdition documentDeletion settingsUpdate
indexCreation indexDeletion indexUpdate indexCompaction dsrUpdate dsrClear""".split())


def world_task_index(task_id):
    """(exists, index uid or None) of a task in the world."""
    if task_id in TASK_INDEX:
        return True, TASK_INDEX[task_id]
    if task_id in ERRING_TASKS:
        return True, "secret"
    return False, None


class Backend:
    """Records every request (tagged by X-Fuzz-Case when the guard forwarded a caller's) and
    answers like a Meilisearch holding the world above. A search of a case registered in
    `held` (tag -> its key's uid: the key has maxConcurrentSearches) is held HOLD seconds, and
    its record says how many searches of that key the backend was running then (`running`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tagged, self.untagged = {}, []
        self.held, self.running = {}, collections.Counter()
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_any(self):
                headers = [(n.lower(), v) for n, v in self.headers.items()]
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        body += self.rfile.read(size)
                        self.rfile.readline()
                        if not size:
                            break
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                record = {"method": self.command, "target": self.path, "headers": headers,
                          "body": body}
                tag = self.headers.get("X-Fuzz-Case")
                route = route_of(self.command, self.path)
                held = backend.held.get(tag) if isinstance(route, tuple) and \
                    (self.command, route[0]) in SEARCHES else None
                with backend.lock:
                    if tag is None:
                        backend.untagged.append(record)
                    else:
                        backend.tagged.setdefault(tag, []).append(record)
                    if held is not None:
                        backend.running[held] += 1
                        record["running"] = backend.running[held]
                if held is not None:
                    time.sleep(HOLD)
                    with backend.lock:  # before answering: the guard holds its place until then
                        backend.running[held] -= 1
                status, payload = backend.answer(self.command, self.path)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_any

            def log_message(self, *args):
                pass

        self.server = serve_in_thread(Handler)
        self.url = self.server.url

    def take(self, tag):
        with self.lock:
            return self.tagged.pop(tag, [])

    @staticmethod
    def answer(method, target):
        route = route_of(method, target)
        if not isinstance(route, tuple):
            return 404, {"message": "not found"}
        template, _, params = route
        pairs = query_pairs(target.partition("?")[2])
        if (method, template) == ("GET", "/indexes"):
            offset = rust_usize(last_param(pairs, "offset") or "0") or 0
            limit = rust_usize(last_param(pairs, "limit") or "20")
            limit = 20 if limit is None else limit
            results = [{"uid": u, "primaryKey": "id"} for u in EXISTING]
            return 200, {"results": results[offset:offset + limit], "offset": offset,
                         "limit": limit, "total": len(results)}
        if (method, template) == ("GET", "/indexes/{index_uid}") and \
                params["index_uid"] not in EXISTING:
            return 404, {"message": "Index `%s` not found." % params["index_uid"],
                         "code": "index_not_found", "type": "invalid_request",
                         "link": "https://docs.meilisearch.com/errors#index_not_found"}
        if (method, template) == ("GET", "/indexes/{index_uid}/settings/foreign-keys"):
            return 200, []  # no index joins another (foreignKeys)
        if (method, template) == ("GET", "/indexes/{index_uid}/settings/displayed-attributes"):
            return 200, DISPLAYED.get(params["index_uid"], ["*"])
        if (method, template) == ("POST", "/indexes/{index_uid}/documents/fetch"):
            return 200, {"results": [{"id": 1}], "offset": 0, "limit": 20, "total": 1}
        if (method, template) == ("GET", "/stats"):
            return 200, {"databaseSize": 1, "indexes": {u: {"numberOfDocuments": 1}
                                                        for u in EXISTING}}
        if (method, template) == ("GET", "/tasks/{task_id}"):
            task_id = rust_usize(params["task_id"])
            exists, index = world_task_index(task_id)
            if task_id in ERRING_TASKS:
                return 500, {"message": "the task store is busy", "code": "internal"}
            if not exists:
                return 404, {"message": "Task not found.", "code": "task_not_found"}
            return 200, {"uid": task_id, "indexUid": index, "status": "succeeded"}
        if (method, template) == ("GET", "/batches/{batch_id}"):
            batch_id = rust_usize(params["batch_id"])
            if batch_id not in BATCH_INDEXES:
                return 404, {"message": "Batch not found.", "code": "batch_not_found"}
            return 200, {"uid": batch_id, "stats": {"indexUids": {
                u: 1 for u in BATCH_INDEXES[batch_id]}, "types": BATCH_TYPES[batch_id]}}
        return 200, {"hits": [], "ok": True}


HOLD = 0.03  # seconds the backend takes over a search of a key with maxConcurrentSearches


# ---------------------------------------------------------------------------------------------
# The checks: every request the backend received for a case, and the answers the guard filters
# ---------------------------------------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
              "proxy-authorization", "te", "trailer", "upgrade"}


def header_problems(case, record):
    problems = []
    auth = [v for n, v in record["headers"] if n == "authorization"]
    if auth != ["Bearer " + UPSTREAM_KEY]:
        problems.append("(d) backend Authorization is %r, not the upstream key" % auth)
    for secret in case.secrets:
        if any(secret in v for _, v in record["headers"]) or secret in record["target"]:
            problems.append("(d) the caller's credential reached the backend")
    dropped = HOP_BY_HOP | case.connection_listed
    for name, value in record["headers"]:
        if name in dropped:
            problems.append("(d) hop-by-hop header %s: %s forwarded" % (name, value))
        if name == "transfer-encoding" and value.lower() != "chunked":
            problems.append("(d) transfer-encoding %r forwarded" % value)
        if name.startswith("x-meili-proxy-") or name.startswith("meili-proxy-"):
            problems.append("(d) network header %s forwarded" % name)
    return problems


def body_json(data):
    try:
        return json.loads(data.decode("utf-8")) if data else None
    except ValueError:
        return "<not json>"


def request_problems(case, method, target, body, unseen_body=False):
    """Properties (a)-(c) of one request as the backend would execute it. `body` is the parsed
    JSON the backend got; `unseen_body` for /authorize, where nobody checked the body."""
    cred = case.cred
    route = route_of(method, target)
    if route is None or route == "405":
        return ["the backend got a request Meilisearch has no route for (%s)" % route]
    template, actions, params = route
    problems = []
    if template.startswith("/keys"):
        return ["a /keys request reached the backend (it manages the backend's keys)"]
    index = params.get("index_uid")
    if index is not None and not VALID_UID.match(index):
        return []  # Meilisearch answers 400 invalid_index_uid after authorizing
    action = actions[0] if actions else None
    for needed in actions:
        if not cred.may(needed, index):
            problems.append("(a) %s on %s not granted" % (needed, index or "(no index)"))
    if problems or not actions:
        return problems
    if cred.admin_from_browser(case.browser):
        problems.append("(g) an admin credential sent from a browser got through")
    key = (method, template)
    restricted = not cred.all_indexes(action)
    pairs = query_pairs(target.partition("?")[2])
    touched = []
    if key == ("POST", "/indexes"):
        if unseen_body and restricted:
            problems.append("(a) index creation body unseen for a restricted key")
        elif isinstance(body, dict) and isinstance(body.get("uid"), str):
            if not cred.may_create_index(body["uid"]):
                problems.append("(a) may not create index %r" % body["uid"])
    if key == ("POST", "/swap-indexes"):
        if unseen_body and restricted:
            problems.append("(a) swap body unseen for a restricted key")
        for swap in body if isinstance(body, list) else ():
            uids = swap.get("indexes") if isinstance(swap, dict) else None
            touched += [u for u in (uids if isinstance(uids, list) else ()) if isinstance(u, str)]
    if key == ("POST", "/multi-search"):
        problems += multi_search_problems(case, body, unseen_body, restricted)
    for uid in touched:
        if not cred.covers(uid, action):
            problems.append("(a) body touches index %r not covered" % uid)
    if key in UNVERIFIABLE and restricted:
        problems.append("(a) %s %s forwarded for a restricted credential" % key)
    if key in TASK_LISTINGS:
        problems += task_listing_problems(case, key, pairs, restricted, unseen_body)
    if key == ("GET", "/tasks/{task_id}/documents") and restricted:
        task_id = rust_usize(params["task_id"])
        exists, task_index = world_task_index(task_id)
        if unseen_body or (exists and (task_index is None or not cred.covers(task_index, action))):
            problems.append("(a) documents of task %s (index %s) forwarded" % (
                task_id, task_index))
    if key in (("GET", "/indexes"), ("GET", "/stats"), ("GET", "/tasks/{task_id}"),
               ("GET", "/batches/{batch_id}")) and restricted and unseen_body:
        problems.append("(a) answer of %s %s unfiltered for a restricted key" % key)
    if key in CREATING and index not in EXISTING and not cred.may_create_index(index):
        problems.append("(a) write creates missing index %r without indexes.create" % index)
    if key in SEARCH_BODY | SEARCH_QUERY:
        problems += search_problems(case, key, index, body, pairs, unseen_body)
    if key in SEARCHES and unseen_body and cred.concurrent() is not None:
        problems.append("(g) /authorize let a search of a key with maxConcurrentSearches "
                        "through")
    if key in DOCUMENT_READS:
        problems += document_problems(case, key, index, body, pairs, unseen_body)
    if key in FORCED_BYPASSES and cred.has_forced():
        problems.append("(e) %s %s forwarded for a key with forced parameters" % key)
    return problems


def document_problems(case, key, index, body, pairs, unseen_body):
    """(f) A documents read: the filter it runs, the fields and vectors it shows."""
    cred = case.cred
    forced = {n: v for n, v in (cred.forced(index) or {}).items()
              if n in ("filter", "attributesToRetrieve", "retrieveVectors")}
    displayed = DISPLAYED.get(index, ["*"]) if cred.kind == "token" else ["*"]
    held = cred.tenant_filters(index) != [None] or forced or "*" not in displayed
    if key[1].endswith("{document_id}"):
        return ["(f) one document asked by its id for a held credential"] if held else []
    if key[0] == "POST" and unseen_body:
        return ["(f) documents fetch body unseen for a held credential"] if held else []
    if key[0] == "GET":
        sent_filter, fields = get_filter(pairs), last_param(pairs, "fields")
        fields = fields.split(",") if fields is not None else None
        vectors = last_param(pairs, "retrieveVectors") == "true"
        caller_filter = get_filter(query_pairs(case.target.partition("?")[2]))
    else:
        if not isinstance(body, dict):
            return []  # Meilisearch refuses it
        sent_filter, fields = body.get("filter", ABSENT), body.get("fields")
        vectors = body.get("retrieveVectors") is True
        caller_filter = ABSENT if case.method == "GET" else body_filter(case.body_value)
    problems = filter_problems(cred, index, caller_filter, sent_filter)
    shown = forced.get("attributesToRetrieve")
    if shown is not None and "*" not in shown:
        if not isinstance(fields, list) or "*" in fields or not set(fields) <= set(shown):
            problems.append("(f) fields %r outside the forced %r" % (fields, shown))
        if vectors and "_vectors" not in shown and forced.get("retrieveVectors") is not True:
            problems.append("(f) vectors retrieved under a forced attributesToRetrieve")
    if "retrieveVectors" in forced and vectors != forced["retrieveVectors"]:
        problems.append("(f) retrieveVectors is not the forced %r" % forced["retrieveVectors"])
    if "*" not in displayed:
        if not isinstance(fields, list) or "*" in fields or not set(fields) <= set(displayed):
            problems.append("(f) a token's fields %r outside the displayed %r" % (
                fields, displayed))
        if vectors and "_vectors" not in displayed:
            problems.append("(f) a token's vectors retrieved, not displayed")
    return problems


def search_problems(case, key, index, body, pairs, unseen_body):
    cred, problems = case.cred, []
    route = key[1].rsplit("/", 1)[1]
    cap = cred.cap()
    if key in SEARCH_QUERY:
        sent_filter, hits = get_filter(pairs), asked_hits_in_query(pairs, route)
        caller_filter = get_filter(query_pairs(case.target.partition("?")[2]))
    else:
        if unseen_body:
            if cap is not None and route != "facet-search":
                problems.append("(c) body unseen for a capped key")
            if cred.tenant_filters(index) != [None]:
                problems.append("(b) body unseen, tenant filter not fused")
            if cred.forced(index) is not None:
                problems.append("(e) body unseen, forced parameters not applied")
            return problems
        sent_filter = body.get("filter") if isinstance(body, dict) else None
        hits = asked_hits(body, route) if route != "facet-search" else 0
        caller_filter = body_filter(case.body_value)
    if cap is not None and hits > cap:
        problems.append("(c) asks for %d hits, cap %d" % (hits, cap))
    refused_anyway = not isinstance(body, dict) and key in SEARCH_BODY
    problems += filter_problems(cred, index, caller_filter, sent_filter, refused_anyway)
    if not refused_anyway:
        takes = {"similar": SIMILAR_TAKES, "facet-search": FACET_SEARCH_TAKES}.get(route)
        problems += forced_problems(cred.forced(index), takes, body if key in SEARCH_BODY
                                    else None, pairs if key in SEARCH_QUERY else None)
        facets = (cred.forced(index) or {}).get("facets")
        if route == "facet-search" and facets is not None and body.get("facetName") not in facets:
            problems.append("(e) facet search on %r outside the forced facets" % (
                body.get("facetName"),))
    return problems


def spelled(value):
    """A forced value as a GET search's query string spells it."""
    if isinstance(value, list):
        return ",".join(value)
    return json.dumps(value) if not isinstance(value, str) else value


def forced_problems(forced, takes, body, pairs, where=""):
    """(e) Each forced parameter but the filter (checked with the token's) as forced, in a
    JSON body or a GET's query pairs; `takes`: the route's parameters (None: all)."""
    problems = []
    for name, value in (forced or {}).items():
        if name == "filter" or (takes is not None and name not in takes):
            continue
        if body is not None:
            sent = body.get(name, ABSENT)
            ok = sent == value
        else:
            sent = [v for n, v in pairs if n == name]
            ok = sent == [spelled(value)] or (value == [] and not sent)
        if not ok:
            problems.append("(e)%s %s is %r, forced %r" % (where, name, sent, value))
    return problems


def filter_problems(cred, index, caller_filter, sent_filter, refused_anyway=False):
    rules = cred.tenant_filters(index)
    forced = (cred.forced(index) or {}).get("filter")  # (e) AND-ed after the token's
    if (rules == [None] and forced is None) or refused_anyway:
        return []
    def plain(value):
        """ABSENT and null alike, where a tie lets Meilisearch add nothing; and `[null]`
        (a GET's `filter=null` fused with a token's `[]`) as `null`: Meilisearch refuses
        both (400 invalid_search_filter, a null in a filter), and `[]` holds no condition."""
        return None if value is ABSENT or value == [None] else value
    def expected(rule):
        fused = caller_filter if rule is None else fuse(caller_filter, rule)
        return fused if forced is None else fuse(fused, forced)
    if any(plain(sent_filter) == plain(expected(rule)) for rule in rules):
        return []
    return ["(b/e) filter %s is not %s AND-ed with the token's %s and the forced %s" % (
        json.dumps(plain(sent_filter)), json.dumps(plain(caller_filter)), json.dumps(rules),
        json.dumps(forced))]


def body_filter(query):
    """A JSON search object's filter as deserr reads it: null is no filter."""
    value = query.get("filter") if isinstance(query, dict) else None
    return ABSENT if value is None else value


def multi_search_problems(case, body, unseen_body, restricted):
    cred, problems = case.cred, []
    cap = cred.cap()
    rate = cred.rate()
    if unseen_body:
        if restricted or cap is not None or rate is not None or cred.has_forced():
            problems.append("(a) multi-search body unseen for a restricted, capped, rated or "
                            "forced key")
        return problems
    if not isinstance(body, dict) or not isinstance(body.get("queries"), list):
        return problems
    caller = case.body_value if isinstance(case.body_value, dict) else {}
    caller_queries = caller.get("queries") if isinstance(caller.get("queries"), list) else []
    if rate is not None and len(body["queries"]) > rate:
        problems.append("(c) a multi-search of %d queries forwarded, rate %d/second" % (
            len(body["queries"]), rate))
    federation = body.get("federation")
    for position, query in enumerate(body["queries"]):
        uid = query.get("indexUid") if isinstance(query, dict) else None
        if not isinstance(uid, str):
            continue
        if not cred.covers(uid, "search"):
            problems.append("(a) queries[%d] on index %r not covered" % (position, uid))
            continue
        before = body_filter(caller_queries[position] if position < len(caller_queries) else {})
        problems += ["queries[%d]: %s" % (position, p) for p in filter_problems(
            cred, uid, before, query.get("filter"))]
        forced = cred.forced(uid)
        problems += forced_problems(forced, None if federation is None else
                                    set(FORCED_KEYS) - {"facets"}, query, None,
                                    " queries[%d]" % position)
        by_index = federation.get("facetsByIndex") if isinstance(federation, dict) else None
        if isinstance(federation, dict) and "facets" in (forced or {}) and (
                not isinstance(by_index, dict) or by_index.get(uid) != forced["facets"]):
            problems.append("(e) federation.facetsByIndex of %r is not the forced facets" % uid)
        if federation is None:
            hits = asked_hits(query, "search")
            if cap is not None and hits > cap:
                problems.append("(c) queries[%d] asks for %d hits, cap %d" % (
                    position, hits, cap))
    if isinstance(federation, dict) and cap is not None:
        hits = asked_hits(federation, "search")
        if hits > cap:
            problems.append("(c) federation asks for %d hits, cap %d" % (hits, cap))
    return problems


def task_listing_problems(case, key, pairs, restricted, unseen_body):
    problems = []
    caller_pairs = query_pairs(case.target.partition("?")[2])
    if key in (("DELETE", "/tasks"), ("POST", "/tasks/cancel")) and \
            not any(n in TASK_FILTERS for n, _ in caller_pairs) and any(
                n in TASK_FILTERS for n, _ in pairs):
        problems.append("(a) %s %s without filter (Meilisearch: 400) got one added" % key)
    if not restricted:
        return problems
    if unseen_body:
        return problems + ["(a) %s %s forwarded unfiltered for a restricted key" % key]
    asked = [v for n, v in pairs if n == "indexUids"]
    if not asked:
        return problems + ["(a) %s %s reached the backend without indexUids" % key]
    known = set(INDEX_POOL)
    for value in asked:
        for uid in (u.strip() for u in value.split(",")):
            if uid == "*" or (uid in known and not case.cred.covers(uid, "tasks.get")):
                problems.append("(a) %s %s lists tasks of %r" % (key + (uid,)))
    return problems


def answer_problems(case, status, data):
    """What the guard answered itself or filtered, for a restricted credential."""
    route = route_of(case.method, case.target)
    if not isinstance(route, tuple) or status != 200:
        return []
    template, actions, params = route
    cred, key = case.cred, (case.method, template)
    if template.startswith("/keys"):
        if cred.admin_from_browser(case.browser):
            return ["(g) %s %s answered 200 to an admin credential from a browser" % key]
        return [] if all(cred.may(a, None) for a in actions) else [
            "(a) %s %s answered 200" % key]
    if not actions or cred.all_indexes(actions[0]):
        return []
    answer = body_json(data)
    if not isinstance(answer, dict):
        return ["answer of %s %s is not a JSON object" % key]
    if key == ("GET", "/indexes"):
        shown = [i.get("uid") for i in answer.get("results", [])]
        return ["(a) GET /indexes shows %r" % u for u in shown if not cred.covers(u, actions[0])]
    if key == ("GET", "/stats"):
        return ["(a) GET /stats shows %r" % u for u in answer.get("indexes", {})
                if not cred.covers(u, actions[0])]
    if key == ("GET", "/tasks/{task_id}"):
        uid = answer.get("indexUid")
        return [] if isinstance(uid, str) and cred.covers(uid, actions[0]) else [
            "(a) task on %r shown" % uid]
    if key == ("GET", "/batches/{batch_id}"):
        stats = answer.get("stats", {})
        if not batch_shown(cred, stats.get("indexUids", {}), stats.get("types", {})):
            return ["(a) batch on %r of %r shown" % (list(stats.get("indexUids", {})),
                                                     list(stats.get("types", {})))]
    return []


def batch_shown(cred, indexes, types):
    """get_batch_ids_from_authorized_indexes for a key not covering every index: a batch of
    tasks not tied to one index (a swap, a dump...) is left out, then a batch none of whose
    indexes is covered. (Meilisearch 1.50 means the first step but subtracts the *task* uids of
    those kinds from the batch uids, a slip copied from the tasks' version: it shows a swap
    batch to a key covering a swapped index, a batch of no index to every such key, and hides a
    one-index batch whose uid is that of such a task. The guard follows the intent.)"""
    return set(types) <= ONE_INDEX_KINDS and any(cred.covers(u, "tasks.get") for u in indexes)


def batch_refusal_problems(case, status):
    """A batch Meilisearch shows the key must not be refused."""
    route = route_of(case.method, case.target)
    if not isinstance(route, tuple) or (case.method, route[0]) != ("GET", "/batches/{batch_id}"):
        return []
    batch = rust_usize(route[2]["batch_id"])
    if not case.cred.may("tasks.get", None) or batch not in BATCH_INDEXES or \
            case.cred.all_indexes("tasks.get") or case.cred.admin_from_browser(case.browser):
        return []
    if batch_shown(case.cred, BATCH_INDEXES[batch], BATCH_TYPES[batch]) and \
            status in (401, 403, 404):  # (a 429 is the key's rate limit)
        return ["batch %s on %s answered %s, Meilisearch shows it" % (
            batch, BATCH_INDEXES[batch], status)]
    return []


def meilisearch_allows(case):
    """Would Meilisearch authorize and run the caller's request as sent? (Checks (a) on the
    request itself; the chat and template routes, which the guard refuses for restricted
    credentials by design, do not count.)"""
    route = route_of(case.method, case.target)
    if not isinstance(route, tuple) or not route[1] or (case.method, route[0]) in UNVERIFIABLE:
        return False
    if case.cred.rate() is not None or case.cred.admin_from_browser(case.browser):
        return False  # a rate limit, or admin keys kept out of browsers, refuse by design
    index = route[2].get("index_uid")
    if (index is not None and not VALID_UID.match(index)) or \
            not all(case.cred.may(a, index) for a in route[1]):
        return False  # refused, or a 400 for the index uid
    problems = request_problems(case, case.method, case.target, case.body_value)
    return not any("(a)" in p for p in problems)


# ---------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------

GLOBAL_FREE = [a for a in ACTIONS if a not in DENY_INDEX_SCOPE]
FILTERS = ["genre = horror", "tenant = 1", "(a = 1 OR b = 2)", "x = 'y) OR (1 = 1'",
           ["year > 2000", ["genre = a", "genre = b"]], [], ["id = 1"], None]


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint(secret, claims, algorithm="HS256"):
    digest = {"HS256": hashlib.sha256, "HS384": hashlib.sha384, "HS512": hashlib.sha512}
    signing = b64url(json.dumps({"alg": algorithm, "typ": "JWT"}).encode()) + "." + \
        b64url(json.dumps(claims).encode())
    signature = hmac.new(secret.encode(), signing.encode(), digest[algorithm]).digest()
    return signing + "." + b64url(signature)


def key_shapes(rng, count):
    """Keys for the pool, (actions, indexes, maxHitsPerQuery, perKey rate a second): well-known
    shapes, then random ones; global actions only on `*`."""
    shapes = [(["search"], ["*"], None, None), (["*"], ["*"], None, None),
              (["search"], ["movies*"], 5, None), (["*.get", "keys.get"], ["*"], None, None),
              (["search"], ["*"], 20, None),
              (["search", "tasks.*", "indexes.*", "documents.*", "settings.*", "stats.*"],
               ["movies*", "tenant_a"], 50, None),
              (["documents.add", "settings.update", "search"], ["*"], None, None),
              (["documents.*"], ["movies"], None, None),
              (["tasks.get", "indexes.get"], ["mov*"], None, None),
              (["search"], ["*"], 20, 3), (["search", "tasks.get"], ["movies*"], None, 3)]
    while len(shapes) < count:
        indexes = ["*"] if rng.random() < 0.3 else rng.sample(PATTERNS, rng.randint(0, 3))
        pool = ACTIONS if "*" in indexes or not indexes else GLOBAL_FREE
        actions = rng.sample(pool, rng.randint(1, 4))
        if rng.random() < 0.5:
            actions.append("search")
        shapes.append((actions, indexes, rng.choice([None, None, 1, 5, 20, 50, 100]), None))
    return shapes


class Case:
    """One generated request; `target` and `method` are what Meilisearch would see (for an
    /authorize case, the original request nginx asks about)."""

    def __init__(self, number):
        self.number, self.tag = number, "%d-%d" % (SEED, number)
        self.method = self.target = None
        self.body = b""
        self.body_value = None
        self.headers = []
        self.authorize = False
        self.method_header = True  # /authorize: X-Original-Method sent
        self.chunked = False  # the body sent with chunked coding
        self.cred = None
        self.secrets = []
        self.connection_listed = set()
        self.browser = False  # (g) sent with a browser's signal
        self.crowd = False  # (g) a search forwarded: sent again by several callers at once

    def describe(self):
        reproduce = "FUZZ_SEED=%d FUZZ_CASE=%d" % (SEED, self.number)
        return "case %s (%s): %s%s %s\n  headers: %s\n  body: %r\n  credential: %s" % (
            self.tag, reproduce, "GET /authorize for " if self.authorize else "", self.method,
            self.target, self.headers, self.body[:600], self.cred.describe())


class Generator:
    def __init__(self, pool):
        self.pool = pool  # key records: actions, indexes, expired, cap, key, uid

    def case(self, number):
        rng = random.Random("%d:%d" % (SEED, number))
        more = random.Random("%d:%d:more" % (SEED, number))  # (g)'s: rng's draws stay as they were
        case = Case(number)
        template, methods = rng.choice(WEIGHTED_ROUTES)
        method = rng.choice(sorted(methods))
        case.authorize = rng.random() < 0.15 and not template.startswith("/keys")
        case.method_header = not (case.authorize and rng.random() < 0.5)
        if not case.method_header and "GET" in methods and len(methods) > 1:
            # a credential for the GET of this path, asking about another method
            method = rng.choice(sorted(set(methods) - {"GET"}))
            case.cred = self.credential(rng, more, methods["GET"])
        else:
            case.cred = self.credential(rng, more, methods[method])
        if case.cred.concurrent() is not None and (method, template) in SEARCHES and \
                more.random() < 0.3:
            case.authorize = True  # (g) which /authorize must never let through
        if rng.random() < 0.03 and not template.startswith("/keys"):  # the pool stays as made
            method = rng.choice(["HEAD", "OPTIONS", "PUT", "PATCH", "DELETE", "POST", "GET"])
        case.method = method
        key = case.cred.key
        covered = [i for i in INDEX_POOL if key and any(matches(p, i) for p in key["indexes"])]
        params = self.params(rng, template, covered)
        path = encode_path(rng, template, params)
        query = self.query(rng, method, template)
        case.target = path + ("?" + query if query or rng.random() < 0.05 else "")
        if True:  # an /authorize case's body is sent when its request is forwarded too
            value = self.body(rng, method, template, covered)
            if value is not None:
                case.body_value = value
                case.body = encode_json(rng, value).encode()
                case.chunked = rng.random() < 0.1
        case.headers = self.headers(rng, more, case)
        case.crowd = more.random() < 0.3
        return case

    def credential(self, rng, more, actions):
        """Mostly a key that holds the route's actions, so that most requests get through."""
        roll = rng.random()
        if roll < 0.03:
            return Credential(None, "none")
        if roll < 0.05:
            return Credential(rng.choice(["Basic abc", "bearer " + self.pool[0]["key"], "Bearer",
                                          "Token x"]), "bad")
        if roll < 0.10:
            return Credential("Bearer " + MASTER, "master", secret=MASTER)
        if roll < 0.13:
            return Credential("Bearer " + "%064x" % rng.getrandbits(256), "unknown")
        holders = [k for k in self.pool if set(actions) <= granted(k["actions"])]
        capped = [k for k in holders if k["cap"] is not None]
        rated = [k for k in holders if k["rate"] is not None]
        scoped = [k for k in holders if "*" not in k["indexes"]]
        held = [k for k in holders if k["concurrent"] is not None]
        if "search" in actions and rated and rng.random() < 0.1:
            holders = rated  # multi-searches counted query by query want rated keys
        elif "search" in actions and capped and rng.random() < 0.4:
            holders = capped  # hit caps want capped keys
        elif scoped and rng.random() < 0.5:
            holders = scoped  # what handlers filter wants keys restricted to some indexes
        if "search" in actions and held and more.random() < 0.5:
            holders = held  # searches held at once want keys with maxConcurrentSearches
        key = rng.choice(holders if holders and rng.random() < 0.7 else self.pool)
        if roll < 0.65 or (set(actions).isdisjoint(TOKEN_ACTIONS) and rng.random() < 0.9):
            value = key["key"].upper() if rng.random() < 0.05 else key["key"]
            return Credential("Bearer " + value, "key", key=key, secret=key["key"])
        credential = self.token(rng, more, key)
        if key["revoked_token"] is not None and more.random() < 0.2:
            token, rules = key["revoked_token"]  # (g) revoked singly
            return Credential("Bearer " + token, "token", key=key, token_rules=rules,
                              token_valid=False, secret=token)
        return credential

    def token(self, rng, more, key):
        rules = self.rules(rng)
        claims = {"searchRules": rules, "apiKeyUid": key["uid"]}
        issued = more.random()  # (g) issued now, an hour ago, or not said: revoked by time?
        if issued < 0.6:
            claims["iat"] = int(time.time()) - (3600 if issued < 0.2 else 0)
        valid = True  # as a token; its parent key's expiry and rights are checked apart
        exp_roll = rng.random()
        if exp_roll < 0.1:
            claims["exp"] = int(time.time()) - 3600
            valid = False
        elif exp_roll < 0.4:
            claims["exp"] = int(time.time()) + 3600
        secret = key["key"]
        algorithm = rng.choice(["HS256", "HS384", "HS512"])
        parent = key
        trouble = rng.random()
        if trouble < 0.02:  # unsigned
            token = mint(secret, claims, algorithm).rsplit(".", 1)[0].split(".", 1)[1]
            token = b64url(b'{"alg":"none","typ":"JWT"}') + "." + token + "."
            return Credential("Bearer " + token, "token", key=key, token_rules=rules,
                              token_valid=False, secret=token)
        if trouble < 0.04:
            secret, valid = self.pool[(self.pool.index(key) + 1) % len(self.pool)]["key"], False
        elif trouble < 0.06:
            claims["apiKeyUid"] = str(uuid.UUID(int=rng.getrandbits(128)))
            valid, parent = False, None
        before = key["revoked_before"]
        if before is not None and claims.get("iat", before - 1) < before:
            valid = False  # revoked: issued before, or no iat (counts as issued before)
        token = mint(secret, claims, algorithm)
        return Credential("Bearer " + token, "token", key=parent or key, token_rules=rules,
                          token_valid=valid, secret=token)

    @staticmethod
    def rules(rng):
        patterns = rng.sample(["*"] + PATTERNS, rng.randint(1, 3))
        if "*" not in patterns and rng.random() < 0.4:
            patterns.append("*")  # a rule for every index: most searches get a filter to fuse
        if rng.random() < 0.35:
            return patterns
        return {p: rng.choice([None, {}, {"filter": None}, {"filter": rng.choice(FILTERS[:-1])},
                               {"filter": rng.choice(FILTERS[:-1])}, [rng.choice(FILTERS)],
                               {"filter": rng.choice(FILTERS[:-1]), "note": 1}])
                for p in patterns}

    def params(self, rng, template, covered):
        """Path parameters; the index often one the key covers (`covered`)."""
        params = {}
        for part in _route_parts(template):
            if not part.startswith("{"):
                continue
            name = part[1:-1]
            if name == "index_uid" and covered and rng.random() < 0.5:
                value = rng.choice(covered)
            elif name == "index_uid":
                value = rng.choice(INDEX_POOL) if rng.random() < 0.97 else rng.choice(
                    ["mo%2Fvies", "movies%00", "m\u00f6vies", "movies.x"])
            elif name == "task_id":
                ids = list(range(0, 48))
                if rng.random() < 0.5:
                    ids = list(ERRING_TASKS)
                value = rng.choice([str(rng.choice(ids)), "+%d" % rng.choice(ids), "x"])
            elif name == "batch_id":
                value = str(rng.randrange(0, 24))
            elif name == "key":
                value = rng.choice(self.pool)["uid"]
            else:
                value = rng.choice(["1", "w", "00000000-0000-0000-0000-000000000000"])
            params[name] = value
        return params

    @staticmethod
    def query(rng, method, template):
        pairs = []
        key = (method, template)
        if key in SEARCH_QUERY:
            for name in rng.sample(["q", "limit", "offset", "page", "hitsPerPage", "filter"],
                                   rng.randint(0, 4)):
                pairs.append((name, search_value(rng, name)))
            if template.endswith("similar"):
                pairs += [("id", "1"), ("embedder", "default")]
            if rng.random() < 0.2 and pairs:
                name = rng.choice(["limit", "hitsPerPage", "page", "filter"])
                pairs.append((name, search_value(rng, name)))
        elif key in TASK_LISTINGS:
            filters = rng.sample(["indexUids", "statuses", "types", "uids"], rng.randint(0, 2))
            for name in filters:
                value = {"indexUids": ",".join(rng.sample(INDEX_POOL + ["*"], rng.randint(1, 3))),
                         "statuses": "succeeded", "types": "documentAdditionOrUpdate",
                         "uids": "1,2"}[name]
                pairs.append((name, value))
            if rng.random() < 0.1:
                pairs.append(("indexUids", rng.choice(INDEX_POOL)))
        elif key == ("GET", "/indexes"):
            pairs = [(n, str(rng.randint(0, 5))) for n in rng.sample(["offset", "limit"],
                                                                     rng.randint(0, 2))]
        elif key in DOCUMENT_READS:
            names = ["fields", "retrieveVectors"] + (
                ["filter", "ids", "offset", "limit"] if template.endswith("documents") else [])
            for name in rng.sample(names, rng.randint(0, len(names))) + (
                    ["filter"] if rng.random() < 0.1 else []):  # twice, or where unknown
                pairs.append((name, document_value(rng, name)))
        return encode_query(rng, pairs)

    @staticmethod
    def body(rng, method, template, covered):
        key = (method, template)

        def some_index():
            return rng.choice(covered if covered and rng.random() < 0.7 else INDEX_POOL)
        if key in SEARCH_BODY:
            return search_object(rng, template.rsplit("/", 1)[1])
        if key == ("POST", "/multi-search"):
            many = rng.random() < 0.1
            queries = [dict(search_object(rng, "search"), indexUid=some_index())
                       for _ in range(rng.randint(30, 80) if many else rng.randint(0, 4))]
            body = {"queries": queries}
            roll = rng.random()
            if roll < 0.3:
                for q in queries:
                    for name in ("limit", "offset", "page", "hitsPerPage"):
                        q.pop(name, None)
                body["federation"] = {k: v for k, v in search_object(rng, "search").items()
                                      if k in ("limit", "offset", "page", "hitsPerPage")}
            elif roll < 0.4:
                body["federation"] = None
            return body
        if key == ("POST", "/indexes/{index_uid}/documents/fetch"):
            body = {name: rng.choice(DOCUMENT_BODY_VALUES[name]) for name in rng.sample(
                sorted(DOCUMENT_BODY_VALUES), rng.randint(0, 4))}
            return body if rng.random() < 0.9 else [body]
        if key == ("POST", "/swap-indexes"):
            return [{"indexes": [some_index(), some_index()]} for _ in range(rng.randint(1, 2))]
        if key == ("POST", "/indexes"):
            return {"uid": some_index(), "primaryKey": "id"}
        if method in ("POST", "PUT", "PATCH"):
            return rng.choice([{}, [{"id": 1}], {"rankingRules": []}])
        return None

    def headers(self, rng, more, case):
        headers = [("X-Fuzz-Case", case.tag)]
        if more.random() < 0.2:  # (g) a browser's signals, whatever their value or spelling
            case.browser = True
            headers += more.sample([("Origin", "https://shop.example"), ("sec-fetch-mode", "cors"),
                                    ("Referer", "https://shop.example/find?q=x"),
                                    ("Sec-Fetch-Mode", "")], more.randint(1, 2))
        if case.body:  # what Meilisearch takes for JSON, mostly plain
            headers.append(("Content-Type", rng.choice(["application/json"] * 8 + [
                "application/json; charset=utf-8", "application/x-ndjson", "text/plain"])))
        if case.cred.header is not None:
            headers.append(("Authorization", case.cred.header))
            if rng.random() < 0.03:  # a second credential: the first one counts
                headers.append(("Authorization", "Bearer " + MASTER))
                case.secrets.append(MASTER)
        if case.cred.secret:
            case.secrets.append(case.cred.secret)
        roll = rng.random()
        if roll < 0.15:
            extra = rng.choice([("Keep-Alive", "timeout=5"), ("TE", "trailers"),
                                ("Proxy-Authorization", "Basic cHJveHk6c2VjcmV0"),
                                ("Proxy-Connection", "keep-alive"), ("Upgrade", "h2c"),
                                ("X-Hop-Secret", "hop-secret")])
            headers.append(extra)
            if extra[0] == "X-Hop-Secret" or rng.random() < 0.5:  # hop-by-hop by name alone?
                headers.append(("Connection", "keep-alive, " + extra[0]))
                case.connection_listed.add(extra[0].lower())
        if rng.random() < 0.15:
            headers += rng.sample([("X-Meili-Proxy-Origin-Remote", "ms-0"),
                                   ("X-Meili-Proxy-Origin-TaskUid", "5"),
                                   ("X-Meili-Proxy-Origin-Network-Version", "1"),
                                   ("Meili-Proxy-Search", "true"),
                                   ("Meili-Proxy-Origin-Remote", "ms-1"),
                                   ("X-Meili-Proxy-Import-Remote", "ms-2")], 2)
        return headers


def search_value(rng, name):
    if name == "q":
        return rng.choice(["", "a b", "caf\u00e9", "&x=1"])
    if name == "filter":
        value = rng.choice(FILTERS)
        return value if isinstance(value, str) else json.dumps(value)
    return rng.choice(["0", "1", "5", "20", "21", "100", "1000", "+1000", "007", "-1", "x", ""])


DOCUMENT_BODY_VALUES = {
    "filter": FILTERS, "fields": [["title"], ["title", "secret"], ["*"], ["secret", "*"], [],
                                  ["_vectors"], None, "secret"],
    "ids": [["1"], [1, "2"], ["x-4"], []], "offset": [0, 1, 5, -1, "x"], "limit": [0, 1, 20],
    "retrieveVectors": [True, False, "yes", None]}


def document_value(rng, name):
    """A documents read's query parameter, as a GET spells it."""
    if name == "filter":
        return search_value(rng, name)
    if name == "fields":
        return rng.choice(["title", "title,secret", "*", "secret,*", "", "_vectors", "id,title"])
    if name == "ids":
        return rng.choice(["1", "1,2", "x-4"])
    if name == "retrieveVectors":
        return rng.choice(["true", "false", "yes"])
    return rng.choice(["0", "1", "5", "-1", "x"])


def search_object(rng, route):
    body = {}
    if route == "similar":
        body.update(id=1, embedder="default")
    elif route == "facet-search":
        body.update(facetName="genre", facetQuery="a")
    if rng.random() < 0.7:
        body["q"] = "x"
    names = ["filter"] + ([] if route == "facet-search" else ["limit", "offset"]) + \
        (["page", "hitsPerPage"] if route == "search" else [])
    for name in rng.sample(names, rng.randint(0, len(names))):
        if name == "filter":
            body[name] = rng.choice(FILTERS)
        else:
            body[name] = rng.choice([0, 1, 5, 20, 21, 50, 100, 1000, 10 ** 6, "1000", 5.0,
                                     True, -1])
    if route != "facet-search" and rng.random() < 0.3:
        body["attributesToRetrieve"] = ["secret"]
        body["showRankingScore"] = True
    if route == "search" and rng.random() < 0.3:
        body[rng.choice(["page", "hitsPerPage"])] = None
        body["limit"] = rng.choice([1000, 10 ** 6])
    return body


def encode_json(rng, value):
    """JSON text: compact, spaced, or with keys written in \\u escapes (same value)."""
    roll = rng.random()
    if roll < 0.6:
        return json.dumps(value)
    if roll < 0.8:
        return json.dumps(value, indent=rng.choice([None, 1]), separators=(" , ", " : "))
    text = json.dumps(value)
    return re.sub(r'"(indexUid|limit|filter|uid|page|hitsPerPage|queries|federation)"',
                  lambda m: '"' + "".join("\\u%04x" % ord(c) if rng.random() < 0.3 else c
                                          for c in m.group(1)) + '"', text)


def encode_path(rng, template, params):
    segments = []
    for part in _route_parts(template):
        text = params[part[1:-1]] if part.startswith("{") else part
        if "%" not in text:
            text = urllib.parse.quote(text, safe="")
            if rng.random() < 0.15:
                text = "".join("%%%02X" % ord(c) if c.isalnum() and rng.random() < 0.3 else c
                               for c in text)
        segments.append(text)
    path = "/" + "/".join(segments)
    if rng.random() < 0.08:
        path = path.replace("/", "//", 1)
    if rng.random() < 0.08:
        path += "/"
    if rng.random() < 0.03:  # dot segments: actix routes them as they are
        cut = path.find("/", 1)
        path = path[:cut] + rng.choice(["/..", "/.", "/%2e%2e", "/secret/.."]) + path[cut:] \
            if cut > 0 else path + "/.."
    return path


def encode_query(rng, pairs):
    parts = []
    for name, value in pairs:
        name = urllib.parse.quote(name, safe="")
        if rng.random() < 0.1:
            name = "".join("%%%02x" % ord(c) if rng.random() < 0.4 else c for c in name)
        quote = urllib.parse.quote_plus if rng.random() < 0.5 else urllib.parse.quote
        parts.append(name + "=" + quote(value, safe=""))
    return "&".join(parts)


WEIGHTS = {"/indexes/{index_uid}/search": 8, "/multi-search": 8, "/indexes/{index_uid}/similar": 3,
           "/indexes/{index_uid}/facet-search": 2, "/tasks": 4, "/tasks/cancel": 2,
           "/tasks/{task_id}": 3, "/tasks/{task_id}/documents": 3, "/batches": 2,
           "/batches/{batch_id}": 3, "/indexes": 4, "/stats": 2, "/swap-indexes": 2,
           "/indexes/{index_uid}/documents": 5, "/indexes/{index_uid}/settings": 2,
           "/keys": 1, "/keys/{key}": 1}


def _weighted_routes():
    """Routes to draw from, the interesting ones more often; two of the per-setting routes
    stand for all of them; /keys only read (the pool stays as made)."""
    routes = []
    for _, template, methods in ROUTES:
        if template.startswith("/indexes/{index_uid}/settings/") and \
                not template.endswith(("ranking-rules", "typo-tolerance")):
            continue
        if template.startswith("/keys"):
            methods = {"GET": methods["GET"]}
        routes += [(template, methods)] * WEIGHTS.get(template, 1)
    return routes


WEIGHTED_ROUTES = _weighted_routes()


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def admin(port, method, path, value):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, None if value is None else json.dumps(value), {
            "Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


EXTRAS = ("allow_browser", "concurrent", "revoked_before", "revoked_token")  # (g), issue 34


def make_pool(port, rng):
    """40 keys, two of them (an admin key and a random one) expired by the time it returns.
    (g): some may be used from browsers, some run a few searches at once, some had their
    tenant tokens revoked (those issued before a time, or one)."""
    shapes = key_shapes(rng, 40)
    forcing = random.Random("%d:forced" % SEED)  # apart, so the shapes stay as they were
    forced_of = [forcing.choice(FORCED_CHOICES) if forcing.random() < 0.25 else None
                 for _ in shapes]
    more = random.Random("%d:more" % SEED)
    extras_of = [{"allow_browser": more.random() < 0.3,
                  "concurrent": {2: 1, 4: 2}.get(n) or (  # two of key_shapes' search keys
                      more.choice([1, 2]) if more.random() < 0.1 else None),
                  "revoked_before": more.random() < 0.2, "revoked_token": more.random() < 0.2}
                 for n in range(len(shapes))]
    pool = [None] * len(shapes)
    expiring = (1, len(shapes) - 1)
    latest = time.time()
    for n in list(expiring) + [n for n in range(len(shapes)) if n not in expiring]:
        actions, indexes, cap, rate = shapes[n]
        expired, expires_at = n in expiring, None
        for _ in range(10):  # an expiring key: whole seconds, 1 to 2 s from now
            if expired:
                latest = time.time() + 2
                expires_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(latest))
            status, key = admin(port, "POST", "/keys", {
                "actions": actions, "indexes": indexes, "expiresAt": expires_at})
            if status != 400 or not expired:
                break  # (a 400 for an expiring key: the machine was too slow, try again)
        assert status == 201, (actions, indexes, key)
        extras = extras_of[n]
        restrictions = {"maxHitsPerQuery": cap, "forcedParameters": forced_of[n],
                        "maxConcurrentSearches": extras["concurrent"],
                        "allowBrowser": extras["allow_browser"]}
        if rate is not None:
            restrictions["rateLimit"] = {"perKey": "%d/second" % rate}
        if any(value not in (None, False) for value in restrictions.values()):
            status, shown = admin(port, "PUT", "/keys/%s/restrictions" % key["uid"],
                                  restrictions)
            assert status == 200, shown
        pool[n] = dict(extras, key=key["key"], uid=key["uid"], actions=actions,
                       indexes=indexes, expired=expired, cap=cap, rate=rate,
                       forced=forced_of[n])
        revoke_tokens(port, pool[n])
    status, key = admin(port, "POST", "/keys", {"actions": ["*"], "indexes": ["*"],
                                                "expiresAt": None})
    assert status == 201 and admin(port, "DELETE", "/keys/" + key["uid"], None)[0] == 204
    for record in pool:
        record["deleted"] = False
    pool.append(dict(dict.fromkeys(EXTRAS), key=key["key"], uid=key["uid"], actions=["*"],
                     indexes=["*"], expired=False, cap=None, rate=None, deleted=True))
    while time.time() < latest + 0.5:  # past the expiry of the expiring keys
        time.sleep(0.1)
    return pool


def revoke_tokens(port, key):
    """(g) Revoke what `key` says of its tenant tokens through the API: those issued before
    now (`revoked_before` becomes the Unix second they were issued before), and one token
    (`revoked_token` becomes it and its rules)."""
    if key["revoked_before"]:
        status, answer = admin(port, "POST", "/keys/%s/revoke-tokens" % key["uid"], {})
        assert status == 200, answer
        key["revoked_before"] = calendar.timegm(time.strptime(answer["issuedBefore"][:19],
                                                              "%Y-%m-%dT%H:%M:%S"))
    else:
        key["revoked_before"] = None
    if key["revoked_token"]:
        rules = ["*"]
        token = mint(key["key"], {"searchRules": rules, "apiKeyUid": key["uid"],
                                  "exp": int(time.time()) + 3600})
        status, answer = admin(port, "POST", "/keys/%s/revoke-token" % key["uid"],
                               {"token": token})
        assert status == 200 or key["expired"], answer
        key["revoked_token"] = token, rules
    else:
        key["revoked_token"] = None


class Client:
    """One keep-alive connection to the guard, reopened when it closes."""

    def __init__(self, port):
        self.port = port
        self.connection = None

    def send(self, method, target, headers, body, chunked=False):
        """(status, body); a connection the guard closed is reopened (`retried` tells).
        A `chunked` body goes in two chunks, without Content-Length."""
        self.retried = False
        for attempt in (1, 2):
            self.retried = attempt == 2
            if self.connection is None:
                self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.connection.putrequest(method, target, skip_accept_encoding=True)
                for name, value in headers:
                    self.connection.putheader(name, value)
                if chunked:
                    self.connection.putheader("Transfer-Encoding", "chunked")
                    half = len(body) // 2
                    self.connection.endheaders(iter([body[:half], body[half:]]),
                                               encode_chunked=True)
                else:
                    if body or method in ("POST", "PUT", "PATCH"):
                        self.connection.putheader("Content-Length", str(len(body)))
                    self.connection.endheaders(body or None)
                response = self.connection.getresponse()
                data = response.read()
                if response.will_close:
                    self.connection.close()
                    self.connection = None
                return response.status, data
            except (OSError, http.client.HTTPException):
                self.connection.close()
                self.connection = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


class LockedCounter(collections.Counter):
    """A Counter the workers may bump at once."""
    lock = threading.Lock()

    def bump(self, name):
        with self.lock:
            self[name] += 1


def run_case(client, backend, case, stats):
    """Send one case; the problems found in what the backend received and what was answered."""
    most = case.cred.concurrent()
    if most is not None:
        backend.held[case.tag] = case.cred.key["uid"]
    if case.authorize:
        headers = [h for h in case.headers if h[0] != "Content-Type"]
        headers.append(("X-Original-URI", case.target))
        if case.method_header:
            headers.append(("X-Original-Method", case.method))
        status, data = client.send("GET", "/authorize", headers, b"")
    else:
        status, data = client.send(case.method, case.target, case.headers, case.body,
                                   case.chunked)
    records = backend.take(case.tag)
    problems = []
    if case.authorize:
        if records:
            problems.append("/authorize forwarded something")
        if status == 204:
            stats.bump("authorized")
            found = request_problems(case, case.method, case.target, None, unseen_body=True)
            if not any(name == "X-Original-Method" for name, _ in headers):
                found = ["judged as GET: " + p for p in found]
            else:
                found += forwarding_problems(client, backend, case, stats)
            problems += found
        return problems, records, status
    if len(records) > 1 and not client.retried:
        problems.append("the backend got the request %d times" % len(records))
    for record in records:
        problems += header_problems(case, record)
        problems += request_problems(case, record["method"], record["target"],
                                     body_json(record["body"]))
        problems += held_problems(record, most)
    if case.crowd and most is not None and records and \
            (case.method, route_of(case.method, case.target)[0]) in SEARCHES:
        problems += crowd_problems(client.port, backend, case, most, stats)
    if records:
        stats.bump("forwarded")
    else:
        stats.bump("answered by the guard %d" % status)
        if status == 429 and b"too_many_search_requests" in data:
            stats.bump("refused at maxConcurrentSearches")
        if status == 403 and b"api_key_not_for_browsers" in data:
            stats.bump("refused from a browser")
        if status == 403 and b"was revoked" in data:
            stats.bump("refused a revoked token")
        if status in (401, 403) and meilisearch_allows(case):
            stats.bump("refused, Meilisearch allows")
            if STRICT:
                problems.append("refused %d though Meilisearch allows it" % status)
    problems += answer_problems(case, status, data)
    problems += batch_refusal_problems(case, status)
    return problems, records, status


def held_problems(record, most):
    """(g) A search of a key with maxConcurrentSearches `most` the backend ran with more."""
    if record.get("running", 0) <= (most or 0):
        return []
    return ["(g) the backend ran %d searches of a key with maxConcurrentSearches %d at once" % (
        record["running"], most)]


def crowd_problems(port, backend, case, most, stats):
    """(g) The case's search sent again by `most` + 1 callers at once, each with a tag of its
    own: the backend never runs more than `most` of them at once (the others get 429)."""
    tags = ["%s/%d" % (case.tag, n) for n in range(most + 1)]
    statuses = []

    def send(tag):
        backend.held[tag] = case.cred.key["uid"]
        caller = Client(port)
        headers = [(n, tag if n == "X-Fuzz-Case" else v) for n, v in case.headers]
        statuses.append(caller.send(case.method, case.target, headers, case.body,
                                    case.chunked)[0])
        if caller.connection is not None:
            caller.connection.close()

    threads = [threading.Thread(target=send, args=(tag,)) for tag in tags]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats.bump("crowds of searches answered %s" % "/".join(map(str, sorted(statuses))))
    return [problem for tag in tags for record in backend.take(tag)
            for problem in held_problems(record, most)]


def forwarding_problems(client, backend, case, stats):
    """An /authorize 204 lets nginx forward the request as sent: forwarding the same request
    through the guard must neither refuse it nor change it (target and body as sent)."""
    status, data = client.send(case.method, case.target, case.headers, case.body, case.chunked)
    records = backend.take(case.tag)
    if status == 429:  # the /authorize call took the rate's last request
        stats.bump("authorized, forward over its rate")
        return []
    if not records:
        return ["/authorize allowed what forwarding refuses (%d %r)" % (status, data[:300])]
    stats.bump("authorized, forwarded as sent")
    # http.server (the stand-in backend) reads a target starting `//` as starting `/`
    sent = "/" + case.target.lstrip("/") if case.target.startswith("//") else case.target
    return ["/authorize allowed what forwarding rewrites: %s %r" % (r["target"], r["body"][:300])
            for r in records if r["target"] != sent or r["body"] != case.body]


def check_internal(backend):
    """The guard's own reads (index lists and lookups, task lookups, an index's foreignKeys
    and displayedAttributes): GETs with the upstream key."""
    problems = []
    for record in backend.untagged:
        route = route_of(record["method"], record["target"])
        auth = [v for n, v in record["headers"] if n == "authorization"]
        if record["method"] != "GET" or not isinstance(route, tuple) or route[0] not in (
                "/indexes", "/indexes/{index_uid}", "/tasks/{task_id}",
                "/indexes/{index_uid}/settings/foreign-keys",
                "/indexes/{index_uid}/settings/displayed-attributes") or \
                auth != ["Bearer " + UPSTREAM_KEY]:
            problems.append("untagged backend request %s %s (auth %r)" % (
                record["method"], record["target"], auth))
    return problems


def property_of(problem):
    """The property, (a) to (g), a problem breaks, or "other"."""
    match = re.search(r"\(([a-g])\)", problem)
    return "(%s)" % match.group(1) if match else "other"


@pytest.fixture(scope="module")
def setup():
    backend = Backend()
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                      "--upstream", backend.url, "--upstream-key", UPSTREAM_KEY)
    with Daemon(argv, port, timeout=30.0) as guard:
        pool = make_pool(port, random.Random("%d:pool" % SEED))
        yield guard, backend, pool
    backend.server.shutdown()
    backend.server.server_close()


def test_policy_fuzz(setup):
    guard, backend, pool = setup
    generator = Generator(pool)
    numbers = [int(ONLY_CASE)] if ONLY_CASE else list(range(COUNT))
    stats = LockedCounter()
    failures, lock = [], threading.Lock()
    started = time.monotonic()

    def work(share):
        client = Client(guard.port)
        for number in share:
            case = generator.case(number)
            problems, records, status = run_case(client, backend, case, stats)
            if problems:
                with lock:
                    failures.append((case, problems, records, status))

    threads = [threading.Thread(target=work, args=(numbers[i::WORKERS],))
               for i in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    internal = check_internal(backend)
    elapsed = time.monotonic() - started
    summary = "policy fuzz: seed %d, %d cases in %.1fs; %s" % (
        SEED, len(numbers), elapsed, dict(sorted(stats.items())))
    print(summary)
    if failures or internal:
        failures.sort(key=lambda f: f[0].number)
        kinds = collections.Counter(property_of(p) for f in failures for p in f[1])
        firsts = []
        for kind in sorted(kinds):  # the first case of each kind, then the next ones
            firsts += [f for f in failures if any(property_of(p) == kind for p in f[1])][:2]
        report = [summary, "%d failing cases; problems by kind: %s; examples:" % (
            len(failures), dict(kinds))]
        for case, problems, records, status in firsts[:16]:
            report.append(case.describe())
            report.append("  guard answered %s; problems: %s" % (status, problems))
            for record in records:
                report.append("  backend got: %s %s %s body=%r" % (
                    record["method"], record["target"], record["headers"],
                    record["body"][:600]))
        report += internal[:10]
        pytest.fail("\n".join(report))
