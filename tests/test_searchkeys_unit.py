"""Unit tests of searchkeys.py's pure parts: permission model, validation,
dates, uuids, key derivation, tenant tokens and the key store.

The expectations are restated here from the specs (meilisearch-keys.md) rather
than read from the module, so a wrong constant in searchkeys.py fails a test.
"""
import functools
import json
import os
import random
import stat
import time

import pytest

import searchkeys as sk

MASTER = "MASTER_KEY"
FUTURE = "2099-01-01T00:00:00Z"

# ---------------------------------------------------------------------------------------------
# Actions and wildcards (spec §3)
# ---------------------------------------------------------------------------------------------

READS = {"search", "documents.get", "export", "indexes.get", "tasks.get", "settings.get",
         "stats.get", "metrics.get", "version", "experimental.get", "network.get", "chats.get",
         "chatsSettings.get", "webhooks.get", "fields.post", "dynamicSearchRules.get"}
# What each wildcard grants (§3.1); every other action grants itself only.
WILDCARDS = {
    "*.get": READS,
    "documents.*": {"documents.add", "documents.get", "documents.delete"},
    "indexes.*": {"indexes.create", "indexes.get", "indexes.update", "indexes.delete",
                  "indexes.swap", "indexes.compact"},
    "tasks.*": {"tasks.get", "tasks.delete", "tasks.cancel", "tasks.compact"},
    "settings.*": {"settings.get", "settings.update"},
    "stats.*": {"stats.get"}, "metrics.*": {"metrics.get"}, "dumps.*": {"dumps.create"},
    "snapshots.*": {"snapshots.create"},
    "chats.*": {"chats.get", "chats.delete"},
    "chatsSettings.*": {"chatsSettings.get", "chatsSettings.update"},
    "webhooks.*": {"webhooks.get", "webhooks.update", "webhooks.delete", "webhooks.create"},
    "dynamicSearchRules.*": {"dynamicSearchRules.get", "dynamicSearchRules.create",
                             "dynamicSearchRules.update", "dynamicSearchRules.delete"},
}


def grants_alone(action, required):
    """Does a key holding only `action` hold `required`? (`*` holds everything.)"""
    return action == "*" or required in WILDCARDS.get(action, {action})


def scoped_query(principal, index, query):
    """A GET search's query string with the principal's tenant filter fused in, as the guard
    forwards it: parsed once, the search value rewritten, written back once."""
    read = sk.parse_search_query(query)
    return sk.encode_search_query(query, read, sk.scope_search_value(principal, index,
                                                                      dict(read[0])))


def test_action_list_is_upstreams_in_order():
    assert len(sk.ACTIONS) == 58 and len(set(sk.ACTIONS)) == 58
    assert sk.ACTIONS[:6] == ("*", "search", "documents.*", "documents.add", "documents.get",
                              "documents.delete")
    assert sk.ACTIONS[-5:] == ("dynamicSearchRules.get", "dynamicSearchRules.create",
                               "dynamicSearchRules.update", "dynamicSearchRules.delete",
                               "dynamicSearchRules.*")
    assert sk.ACTIONS.index("*.get") == 44 and sk.ACTIONS.index("chatCompletions") == 37
    for missing in ("keys.*", "experimental.*", "network.*", "Search"):
        assert missing not in sk.ACTIONS


def test_expansion():
    assert sk.expand("*") == frozenset(sk.ACTIONS)
    for wildcard, members in WILDCARDS.items():
        assert sk.expand(wildcard) == members, wildcard
    assert "documents.*" not in sk.expand("documents.*")
    assert "keys.get" not in sk.expand("*.get") and "chatCompletions" not in sk.expand("*.get")
    assert sk.expand("search") == {"search"}
    assert sk.grants(("search", "documents.*")) == {"search", "documents.add", "documents.get",
                                                    "documents.delete"}


def test_index_scopes_partition_the_actions():
    # upstream's index_scope (keys.rs): the two scopes searchkeys acts on, and the rest
    index_only = {"documents.add", "documents.delete", "indexes.update", "indexes.delete",
                  "indexes.compact", "fields.post", "settings.update"}
    multi_scope = {"*", "*.get", "documents.*", "indexes.*", "tasks.*", "settings.*"}
    scopes = [sk.GLOBAL_ACTIONS, sk.HANDLER_CHECKED_ACTIONS, index_only, multi_scope]
    assert sum(len(s) for s in scopes) == 58 and set().union(*scopes) == set(sk.ACTIONS)
    assert {"version", "keys.get", "tasks.compact", "export"} <= sk.GLOBAL_ACTIONS
    assert {"search", "stats.*", "chatCompletions"} <= sk.HANDLER_CHECKED_ACTIONS
    assert sk.index_scoped_global_action(["search", "version", "keys.get"], ["products"]) \
        == "version"
    assert sk.index_scoped_global_action(["version"], ["products", "*"]) is None
    assert sk.index_scoped_global_action(["version"], []) is None
    assert sk.index_scoped_global_action(["*", "*.get"], ["products"]) is None


@pytest.mark.parametrize("pattern,index,matches", [
    ("*", "anything", True), ("movies", "movies", True), ("movies", "Movies", False),
    ("movies", "movies2", False), ("mov*", "mov", True), ("mov*", "movies", True),
    ("mov*", "mo", False), ("Zeta", "zeta", False),
])
def test_pattern_matches(pattern, index, matches):
    assert sk.pattern_matches(pattern, index) is matches


def test_index_pattern_validity():
    for good in ("*", "movies", "a-b_C9", "mov*", "1", "x" * 400, "x" * 400 + "*"):
        assert sk.is_valid_index_pattern(good), good
    for bad in ("", "*movies", "mo*vies", "movies**", "mo vies", "é", "a.b", "x" * 401, "**"):
        assert not sk.is_valid_index_pattern(bad), bad


# ---------------------------------------------------------------------------------------------
# The whole route table (§8), walked like upstream's authorization.rs
# ---------------------------------------------------------------------------------------------

SETTINGS_PUT = ("filterable-attributes", "sortable-attributes", "displayed-attributes",
                "searchable-attributes", "stop-words", "non-separator-tokens", "separator-tokens",
                "dictionary", "synonyms", "distinct-attribute", "proximity-precision",
                "localized-attributes", "ranking-rules", "search-cutoff-ms", "facet-search",
                "prefix-search", "foreign-keys")
SETTINGS_PATCH = ("typo-tolerance", "faceting", "pagination", "embedders", "chat")

# (method, path, required actions, scoped keys allowed on this index-less route)
# Paths naming an index use `products`.
ROUTE_TABLE = [
    ("GET", "/version", ["version"], False),
    ("GET", "/stats", ["stats.get"], True),
    ("GET", "/keys", ["keys.get"], False),
    ("POST", "/keys", ["keys.create"], False),
    ("GET", "/keys/some-key", ["keys.get"], False),
    ("PATCH", "/keys/some-key", ["keys.update"], False),
    ("DELETE", "/keys/some-key", ["keys.delete"], False),
    ("GET", "/indexes", ["indexes.get"], True),
    ("POST", "/indexes", ["indexes.create"], True),
    ("GET", "/indexes/products", ["indexes.get"], None),
    ("PATCH", "/indexes/products", ["indexes.update"], None),
    ("DELETE", "/indexes/products", ["indexes.delete"], None),
    ("GET", "/indexes/products/stats", ["stats.get"], None),
    ("POST", "/indexes/products/fields", ["fields.post"], None),
    ("POST", "/indexes/products/compact", ["indexes.compact"], None),
    ("GET", "/indexes/products/search", ["search"], None),
    ("POST", "/indexes/products/search", ["search"], None),
    ("POST", "/indexes/products/facet-search", ["search"], None),
    ("GET", "/indexes/products/similar", ["search"], None),
    ("POST", "/indexes/products/similar", ["search"], None),
    ("GET", "/indexes/products/documents", ["documents.get"], None),
    ("POST", "/indexes/products/documents", ["documents.add"], None),
    ("PUT", "/indexes/products/documents", ["documents.add"], None),
    ("DELETE", "/indexes/products/documents", ["documents.delete"], None),
    ("POST", "/indexes/products/documents/delete-batch", ["documents.delete"], None),
    ("POST", "/indexes/products/documents/delete", ["documents.delete"], None),
    ("POST", "/indexes/products/documents/fetch", ["documents.get"], None),
    ("POST", "/indexes/products/documents/edit", ["documents.*"], None),
    ("GET", "/indexes/products/documents/42", ["documents.get"], None),
    ("DELETE", "/indexes/products/documents/42", ["documents.delete"], None),
    ("GET", "/indexes/products/settings", ["settings.get"], None),
    ("PATCH", "/indexes/products/settings", ["settings.update"], None),
    ("DELETE", "/indexes/products/settings", ["settings.update"], None),
] + [
    (method, "/indexes/products/settings/" + name, [action], None)
    for names, verb in ((SETTINGS_PUT, "PUT"), (SETTINGS_PATCH, "PATCH")) for name in names
    for method, action in (("GET", "settings.get"), (verb, "settings.update"),
                           ("DELETE", "settings.update"))
] + [
    ("POST", "/multi-search", ["search"], True),
    ("POST", "/swap-indexes", ["indexes.swap"], True),
    ("POST", "/render-template", ["settings.get", "documents.get"], True),
    ("GET", "/tasks", ["tasks.get"], True),
    ("DELETE", "/tasks", ["tasks.delete"], True),
    ("POST", "/tasks/cancel", ["tasks.cancel"], True),
    ("POST", "/tasks/compact", ["tasks.compact"], False),
    ("GET", "/tasks/7", ["tasks.get"], True),
    ("GET", "/tasks/7/documents", ["tasks.get"], True),
    ("GET", "/batches", ["tasks.get"], True),
    ("GET", "/batches/7", ["tasks.get"], True),
    ("POST", "/dumps", ["dumps.create"], False),
    ("POST", "/snapshots", ["snapshots.create"], False),
    ("GET", "/metrics", ["metrics.get"], False),
    ("POST", "/logs/stream", ["metrics.get"], False),
    ("DELETE", "/logs/stream", ["metrics.get"], False),
    ("POST", "/logs/stderr", ["metrics.get"], False),
    ("GET", "/experimental-features", ["experimental.get"], False),
    ("PATCH", "/experimental-features", ["experimental.update"], False),
    ("POST", "/export", ["export"], False),
    ("GET", "/network", ["network.get"], False),
    ("PATCH", "/network", ["network.update"], False),
    ("POST", "/network/control", ["network.update"], False),
    ("GET", "/webhooks", ["webhooks.get"], False),
    ("POST", "/webhooks", ["webhooks.create"], False),
    ("GET", "/webhooks/0b9b6c52-3e33-4a2c-9b7a-0e7cba6cb9e2", ["webhooks.get"], False),
    ("PATCH", "/webhooks/0b9b6c52-3e33-4a2c-9b7a-0e7cba6cb9e2", ["webhooks.update"], False),
    ("DELETE", "/webhooks/0b9b6c52-3e33-4a2c-9b7a-0e7cba6cb9e2", ["webhooks.delete"], False),
    ("POST", "/dynamic-search-rules", ["dynamicSearchRules.get"], False),
    ("DELETE", "/dynamic-search-rules", ["dynamicSearchRules.delete"], False),
    ("GET", "/dynamic-search-rules/r1", ["dynamicSearchRules.get"], False),
    ("PATCH", "/dynamic-search-rules/r1", ["dynamicSearchRules.update"], False),
    ("DELETE", "/dynamic-search-rules/r1", ["dynamicSearchRules.delete"], False),
    ("GET", "/chats", ["chats.get"], False),
    ("GET", "/chats/w1", ["chats.get"], False),
    ("DELETE", "/chats/w1", ["chats.delete"], False),
    ("GET", "/chats/w1/settings", ["chatsSettings.get"], False),
    ("PATCH", "/chats/w1/settings", ["chatsSettings.update"], False),
    ("DELETE", "/chats/w1/settings", ["chatsSettings.update"], False),
    ("POST", "/chats/w1/chat/completions", ["chatCompletions"], True),
]
INVALID = "The provided API key is invalid."


def route_of(method, path):
    route = sk.match_route(method, sk.path_segments(path))
    assert isinstance(route, tuple), (method, path, route)
    return route


def test_route_table_matches_the_spec():
    for method, path, required, _scoped in ROUTE_TABLE:
        route, index, _params = route_of(method, path)
        assert list(route.actions) == required, (method, path)
        assert index == ("products" if path.startswith("/indexes/products") else None), path
    # every Meilisearch route of the module is in the table above (nothing extra is guarded)
    listed = {(m, route_of(m, p)[0].pattern) for m, p, _r, _s in ROUTE_TABLE}
    # searchkeys' own routes (/authorize, its additions under /keys/) are not Meilisearch's
    declared = {(r.method, r.pattern) for r in sk.ROUTES if r.actions
                and r.family != "authorize"
                and not (r.pattern.startswith("/keys/") and r.pattern != "/keys/{key}")}
    assert declared == listed
    assert route_of("GET", "/health")[0].actions == () and route_of("GET", "/")[0].actions == ()


def test_every_index_less_route_an_index_scoped_key_passes_has_a_rule():
    """authorize lets index-scoped keys onto index-less routes of HANDLER_CHECKED_ACTIONS on
    the promise that the route's rule holds them to their indexes: the module checks its table
    at import, and the check refuses a table that breaks the promise."""
    sk._check_route_table(sk.ROUTES)
    checked = [r for r in sk.ROUTES if r.handler is sk.Service.forward
               and "{index_uid}" not in r.pattern and set(r.actions) & sk.HANDLER_CHECKED_ACTIONS]
    assert len(checked) >= 10 and all(r.rule is not None for r in checked)
    broken = checked[0]._replace(rule=None)
    with pytest.raises(AssertionError, match="without a rule"):
        sk._check_route_table(sk.ROUTES + (broken,))


def test_route_lookup_edges():
    assert sk.match_route("GET", sk.path_segments("/nothing")) is None
    assert sk.match_route("PUT", sk.path_segments("/keys")) == "method"
    assert sk.match_route("GET", sk.path_segments("/indexes/products/documents/fetch")) \
        == "method"  # the literal resource wins, like actix
    assert route_of("GET", "/keys/")[0].pattern == "/keys"
    assert route_of("GET", "//indexes//products/search/")[1] == "products"
    assert route_of("GET", "/%6Beys")[0].pattern == "/keys"
    assert route_of("GET", "/keys/%2F")[2] == {"key": "/"}
    assert route_of("GET", "/indexes/mo%76ies/search?q=1")[1] == "movies"


@pytest.fixture(scope="module")
def one_action_keys():
    """For every action: a global key and a key scoped to `products`, holding only it."""
    store = sk.KeyStore(MASTER)
    made = {}
    for action in sk.ACTIONS:
        made[action, "global"] = store.create(
            {"actions": [action], "indexes": ["*"], "expiresAt": None}).value
        # the store does not re-check the index-scope rule (the HTTP layer does)
        made[action, "scoped"] = store.create(
            {"actions": [action], "indexes": ["products"], "expiresAt": None}).value
    return sk.Guard(store, MASTER), made


def decision(guard, token, method, path):
    route, index, _params = route_of(method, path)
    actions = route.actions
    try:
        guard.check("Bearer " + token, actions, index)
        return None
    except sk.ApiError as error:
        assert (error.status, error.code, error.kind) == (403, "invalid_api_key", "auth")
        return error.message


def test_authorize_walks_the_whole_route_table(one_action_keys):
    guard, made = one_action_keys
    for method, path, required, scoped_ok in ROUTE_TABLE:
        for action in sk.ACTIONS:
            granted = all(grants_alone(action, r) for r in required)
            got = decision(guard, made[action, "global"], method, path)
            assert (got is None) == granted, (method, path, action, got)
            scoped = decision(guard, made[action, "scoped"], method, path)
            allowed = granted and (scoped_ok is None or scoped_ok)
            assert (scoped is None) == allowed, (method, path, action, "scoped", scoped)
            if scoped is not None:
                assert scoped == INVALID
        assert decision(guard, MASTER, method, path) is None


def test_foreign_index_is_refused_before_the_action(one_action_keys):
    guard, made = one_action_keys
    for method, path, _required, scoped_ok in ROUTE_TABLE:
        if scoped_ok is not None:
            continue
        other = path.replace("/indexes/products", "/indexes/other")
        for action in ("search", "version", "*"):
            assert decision(guard, made[action, "scoped"], method, other) == (
                'The API key cannot acces the index `other`, authorized indexes are '
                '["products"].'), (method, other, action)


class FakeKey:
    """Just what authorize() reads from a key."""

    def __init__(self, actions, indexes, expires_ns=None):
        self.grants = sk.grants(tuple(actions))
        self.indexes = tuple(indexes)
        self.is_global = "*" in indexes
        self.expires_ns = expires_ns

    def is_expired(self, now_ns=None):
        return self.expires_ns is not None and now_ns >= self.expires_ns


def test_authorize_pure_rules():
    key = FakeKey(["search", "documents.get"], ["products", "Zeta", "movies*"])
    assert sk.authorize(key, "search", "movies2024", 0) is None
    assert sk.authorize(key, "search", None, 0) is None  # handler-checked
    assert sk.authorize(key, "documents.add", "products", 0).message == INVALID
    assert sk.authorize(key, "search", "zeta", 0).message == (
        'The API key cannot acces the index `zeta`, authorized indexes are '
        '["Zeta", "movies*", "products"].')
    expiring = FakeKey(["search"], ["*"], expires_ns=100)
    assert sk.authorize(expiring, "search", "x", 99) is None
    assert sk.authorize(expiring, "search", "x", 100).message == INVALID  # now < expiresAt only
    nothing = FakeKey(["search"], [])
    assert sk.authorize(nothing, "search", None, 0).message == INVALID
    assert "cannot acces" in sk.authorize(nothing, "search", "x", 0).message


def test_authorize_with_tenant_rules():
    parent = FakeKey(["search"], ["movies*", "shows"])
    assert sk.authorize(parent, "search", "movies", 0, tenant_rules=["movies"]) is None
    assert sk.authorize(parent, "search", "shows", 0, tenant_rules={"sh*": None}) is None
    assert sk.authorize(parent, "search", "other", 0, tenant_rules={"b": {}, "a*": None}) \
        .message == ('The provided tenant token cannot acces the index `other`, allowed '
                     'indexes are ["a*", "b"].')
    assert sk.authorize(parent, "search", "books", 0, tenant_rules=["*"]).message == (
        "The API key used to generate this tenant token cannot acces the index `books`.")


# ---------------------------------------------------------------------------------------------
# Authentication headers (§2.3, §7)
# ---------------------------------------------------------------------------------------------

def test_authentication_headers():
    store = sk.KeyStore(MASTER)
    guard = sk.Guard(store, MASTER)
    search = ("search",)

    def code(header, actions=search, index="movies", g=guard):
        try:
            g.check(header, actions, index)
            return "ok"
        except sk.ApiError as error:
            return error.status, error.code

    assert code(None) == (401, "missing_authorization_header")
    for header in ("Basic x", "bearer " + MASTER, "Token x", "Bearer\u00e9 x", ""):
        assert code(header) == (401, "missing_authorization_header"), header
    assert code("Bearer") == (403, "invalid_api_key")
    assert code("Bearer ") == (403, "invalid_api_key")
    assert code("Bearer " + MASTER) == "ok"
    assert code("Bearer  " + MASTER) == (403, "invalid_api_key")
    assert code(None, ()) == "ok"  # public route
    open_guard = sk.Guard(sk.KeyStore(None), None)
    assert code(None, g=open_guard) == "ok"
    assert code("Bearer anything", g=open_guard) == "ok"
    assert code("Basic x", g=open_guard) == (401, "missing_authorization_header")
    assert code("Bearer", g=open_guard) == (403, "invalid_api_key")
    for header in (None, "Bearer x", "Bearer " + MASTER):
        assert code(header, ("keys.get",), None, open_guard) == (401, "missing_master_key")


# ---------------------------------------------------------------------------------------------
# Validation messages (§1.2, §2)
# ---------------------------------------------------------------------------------------------

def create_error(body):
    with pytest.raises(sk.ApiError) as info:
        sk.validate_create(body, time.time_ns())
    return info.value.code, info.value.message


def test_damerau_levenshtein():
    assert sk.damerau_levenshtein("kitten", "sitting") == 3
    assert sk.damerau_levenshtein("ab", "ba") == 1
    assert sk.damerau_levenshtein("CA", "ABC") == 2  # unrestricted: not the OSA 3
    assert sk.damerau_levenshtein("", "abc") == 3
    assert sk.damerau_levenshtein("search", "search") == 0


@pytest.mark.parametrize("received,hint", [
    ("serch", "search"), ("Search", "search"), ("saerch", "search"), ("expires_at", "expiresAt"),
    ("sea", None),                        # 3 bytes: no typo allowed
    ("seerch", "search"), ("sxxrch", None),   # 6 bytes: 1 typo
    ("documents.ad", "documents.add"), ("documents.XXXX", None),  # 12 bytes: 2, 14: 3
    ("documentsXXX.add", "documents.add"),
])
def test_did_you_mean_thresholds(received, hint):
    accepted = list(sk.ACTIONS) + list(sk.CREATE_FIELDS)
    expected = "did you mean `%s`? " % hint if hint else ""
    assert sk.did_you_mean(received, accepted) == expected


def test_did_you_mean_on_huge_input_is_quick():
    started = time.monotonic()
    assert sk.did_you_mean("s" * 1_000_000, sk.ACTIONS) == ""
    assert time.monotonic() - started < 5  # generous: without the length guard, minutes


def test_create_validation_messages():
    assert create_error({}) == ("missing_api_key_actions", "Missing field `actions`")
    assert create_error({"actions": []}) == ("missing_api_key_indexes", "Missing field `indexes`")
    assert create_error({"actions": [], "indexes": []}) == (
        "missing_api_key_expires_at", "Missing field `expiresAt`")
    assert create_error([]) == (
        "bad_request", "Invalid value type: expected an object, but found an array: `[]`")
    assert create_error({"expires_at": 1}) == (
        "bad_request", "Unknown field `expires_at`: did you mean `expiresAt`? expected one of "
        "`description`, `name`, `uid`, `actions`, `indexes`, `expiresAt`")
    assert create_error({"name": 13}) == (
        "invalid_api_key_name",
        "Invalid value type at `.name`: expected a string, but found a positive integer: `13`")
    assert create_error({"description": {"name": "products"}}) == (
        "invalid_api_key_description", "Invalid value type at `.description`: expected a "
        'string, but found an object: `{"name":"products"}`')
    assert create_error({"actions": "search"}) == (
        "invalid_api_key_actions",
        'Invalid value type at `.actions`: expected an array, but found a string: `"search"`')
    assert create_error({"actions": [True]}) == (
        "invalid_api_key_actions",
        "Invalid value type at `.actions[0]`: expected a string, but found a boolean: `true`")
    code, message = create_error({"actions": ["search", "serch"]})
    assert code == "invalid_api_key_actions" and message.startswith(
        "Unknown value `serch` at `.actions[1]`: did you mean `search`? expected one of `*`, "
        "`search`, `documents.*`,")
    assert message.endswith("`dynamicSearchRules.delete`, `dynamicSearchRules.*`")
    assert create_error({"indexes": [-1]}) == (
        "invalid_api_key_indexes",
        "Invalid value type at `.indexes[0]`: expected a string, but found a negative integer: "
        "`-1`")
    assert create_error({"indexes": ["ok", "mo*vies"]}) == (
        "invalid_api_key_indexes", "Invalid value at `.indexes[1]`: `mo*vies` is not a valid "
        "index uid pattern. Index uid patterns can be an integer or a string containing only "
        "alphanumeric characters, hyphens (-), underscores (_), and optionally end with a star "
        "(*).")
    assert create_error({"uid": None}) == (
        "invalid_api_key_uid", "Invalid value type at `.uid`: expected a string, but found null")
    assert create_error({"uid": "doggo"}) == (
        "invalid_api_key_uid", "Invalid value at `.uid`: invalid character: found `o` at 1")
    assert create_error({"expiresAt": 1.5}) == (
        "invalid_api_key_expires_at",
        "Invalid value type at `.expiresAt`: expected a string, but found a number: `1.5`")
    code, message = create_error({"expiresAt": "2020-01-01"})
    assert code == "invalid_api_key_expires_at" and message == (
        "Invalid value at `.expiresAt`: `2020-01-01` is not a valid date. It should follow the "
        "RFC 3339 format to represents a date or datetime in the future or specified as a null "
        "value. e.g. 'YYYY-MM-DD' or 'YYYY-MM-DD HH:MM:SS'.\n")
    # document order: the first problem wins, whatever the field
    assert create_error({"uid": 1, "name": 2})[0] == "invalid_api_key_uid"
    assert create_error({"name": 2, "uid": 1})[0] == "invalid_api_key_name"
    assert create_error({"nope": 1, "actions": 2})[0] == "bad_request"
    assert create_error({"actions": ["search", "keys.get", "version"], "indexes": ["products"],
                         "expiresAt": None}) == (
        "index_scoped_api_key_with_global_action",
        'cannot create index-scoped API key with global action `"keys.get"`\n  - Hint: remove '
        'action `"keys.get"` from the action list, or remove `indexes` to make the key global')


def test_create_validation_accepts():
    fields = sk.validate_create({"uid": "{9A77A636-E4E2-4F1A-93AC-978C368FD596}",
                                 "actions": ["search", "search"], "indexes": [],
                                 "expiresAt": None, "name": "", "description": None},
                                time.time_ns())
    assert fields["uid"] == "9a77a636-e4e2-4f1a-93ac-978c368fd596"
    assert fields["actions"] == ["search", "search"] and fields["indexes"] == []
    assert fields["expiresAt"] is None and fields["name"] == ""


def test_patch_validation():
    assert sk.validate_patch({"name": None, "description": "d"}) == {"name": None,
                                                                      "description": "d"}
    for field, code in (("uid", "immutable_api_key_uid"), ("actions", "immutable_api_key_actions"),
                        ("indexes", "immutable_api_key_indexes"),
                        ("expiresAt", "immutable_api_key_expires_at"),
                        ("createdAt", "immutable_api_key_created_at"),
                        ("updatedAt", "immutable_api_key_updated_at")):
        with pytest.raises(sk.ApiError) as info:
            sk.validate_patch({field: 1})
        assert (info.value.code, info.value.message) == (
            code, "Immutable field `%s`: expected one of `description`, `name`" % field)
    with pytest.raises(sk.ApiError) as info:
        sk.validate_patch({"key": "x"})
    assert info.value.message == "Unknown field `key`: expected one of `description`, `name`"


def test_list_query():
    assert sk.validate_list_query("") == (0, 20)
    assert sk.validate_list_query("offset=2&limit=0") == (2, 0)
    assert sk.validate_list_query("limit=%2B5") == (0, 5)
    assert sk.validate_list_query("limit=oops&offset=1&limit=7") == (1, 7)
    for query, code, raw in (("offset=-1", "invalid_api_key_offset", "-1"),
                             ("limit=", "invalid_api_key_limit", ""),
                             ("limit=1.0", "invalid_api_key_limit", "1.0"),
                             ("limit=18446744073709551616", "invalid_api_key_limit",
                              "18446744073709551616")):
        with pytest.raises(sk.ApiError) as info:
            sk.validate_list_query(query)
        name = code.rsplit("_", 1)[1]
        assert (info.value.code, info.value.message) == (
            code, "Invalid value in parameter `%s`: could not parse `%s` as a positive integer"
            % (name, raw))
    with pytest.raises(sk.ApiError) as info:
        sk.validate_list_query("fields=uid")
    assert info.value.message == "Unknown parameter `fields`: expected one of `offset`, `limit`"


@pytest.mark.parametrize("text,value", [
    ("0", 0), ("20", 20), ("+20", 20), ("+0", 0), ("007", 7), ("+007", 7),
    ("18446744073709551615", 2 ** 64 - 1), ("0" * 5000 + "1", 1),
    ("", None), ("+", None), ("-0", None), ("-1", None), ("++1", None), (" 1", None),
    ("1 ", None), ("1.0", None), ("1e3", None), ("0x10", None), ("\u0661", None), ("²", None),
    ("1_000", None), ("18446744073709551616", None), ("9" * 5000, None),
])
def test_query_numbers_are_read_as_rust_usize_from_str(text, value):
    assert sk.parse_rust_uint(text) == value


def test_u32_numbers_overflow_at_u32():
    assert sk.parse_rust_uint("4294967295", sk.U32_MAX) == 2 ** 32 - 1
    assert sk.parse_rust_uint("4294967296", sk.U32_MAX) is None


def test_index_list_query_is_parsed_as_upstream_parses_it():
    assert sk.all_indexes_query("limit=%2B20&offset=%2B0") == ("offset=0&limit=1000000", 0, 20)
    assert sk.all_indexes_query("offset=%2B1&limit=1") == ("offset=0&limit=1000000", 1, 1)
    assert sk.all_indexes_query("limit=x&limit=3")[1:] == (0, 3)  # the last one wins
    for query, code, message in (
            ("limit=-1", "invalid_index_limit",
             "Invalid value in parameter `limit`: could not parse `-1` as a positive integer"),
            ("offset=%201&limit=x", "invalid_index_offset",
             "Invalid value in parameter `offset`: could not parse ` 1` as a positive integer"),
            ("limit=1&uid=x", "bad_request",
             "Unknown parameter `uid`: expected one of `offset`, `limit`")):
        with pytest.raises(sk.ApiError) as info:
            sk.all_indexes_query(query)
        assert (info.value.status, info.value.code, info.value.message) == (400, code, message)


def test_content_type_and_payload():
    for good in ("application/json", "application/json; charset=utf-8", "text/json",
                 "application/vnd.api+json", "Application/JSON"):
        sk.check_content_type(good)
    with pytest.raises(sk.ApiError) as info:
        sk.check_content_type(None)
    assert (info.value.status, info.value.code) == (415, "missing_content_type")
    with pytest.raises(sk.ApiError) as info:
        sk.check_content_type("")
    assert info.value.message == ("The Content-Type `` is invalid. Accepted values for the "
                                  "Content-Type header are: `application/json`")
    for body, code in ((b"", "missing_payload"), (b"{", "malformed_payload"),
                       (b"NaN", "malformed_payload"), (b'"\\ud800"', "malformed_payload"),
                       (b"\xff", "malformed_payload")):
        with pytest.raises(sk.ApiError) as info:
            sk.parse_json_body(body)
        assert info.value.code == code, body
    assert sk.parse_json_body(b'{"a": [1]}') == {"a": [1]}
    assert sk.parse_json_body(b"[" * 128 + b"]" * 128)
    for depth in (129, 978, 100000):
        with pytest.raises(sk.ApiError) as info:
            sk.parse_json_body(b"[" * depth + b"]" * depth)
        assert info.value.message == ("The json payload provided is malformed. `recursion "
                                      "limit exceeded`."), depth


def _parse_peak(parse, body):
    """The most memory `parse(body)` held at once, as tracemalloc counts it."""
    import tracemalloc
    tracemalloc.start()
    try:
        parse(body)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parsing_a_body_costs_a_small_multiple_of_its_size():
    """A search body of 400 kB of numbers costs what its parsed value costs (~5x the body), and
    no shape costs more than the plain parse of it: the nesting check holds memory for the
    depth, not for each value (a tuple per value made one 8 MB body cost ~340 MiB)."""
    numbers = b'{"q":"x","filter":[' + b"1," * 200000 + b"1]}"
    assert _parse_peak(sk.parse_json_body, numbers) < 8 * len(numbers)
    for item in (b"[]", b"{}", b'"ab"', b"[[1]]"):
        body = b'{"q":"x","filter":[' + (item + b",") * (400000 // len(item)) + item + b"]}"
        plain = _parse_peak(lambda data: json.loads(data.decode("utf-8")), body)
        assert _parse_peak(sk.parse_json_body, body) < 1.2 * plain, item


# ---------------------------------------------------------------------------------------------
# UUIDs (uuid crate forms and messages)
# ---------------------------------------------------------------------------------------------

def test_uuid_forms():
    canonical = "9a77a636-e4e2-4f1a-93ac-978c368fd596"
    for spelling in (canonical, canonical.upper(), canonical.replace("-", ""),
                     "{" + canonical + "}", "urn:uuid:" + canonical):
        assert sk.parse_uuid(spelling) == canonical, spelling


@pytest.mark.parametrize("text,message", [
    ("aaaaabbbbbccc", "invalid length: found 13"),
    ("doggo", "invalid character: found `o` at 1"),
    ("", "invalid length: found 0"),
    ("9a77a636-e4e2-4f1a-93ac", "invalid group count: expected 5, found 4"),
    ("9a77a63-6e4e2-4f1a-93ac-978c368fd596", "invalid group length in group 0: expected 8, found 7"),
    ("9a77a636-e4e2-4f1a-93ac-978c368fd5961", "invalid group length in group 4: expected 12, found 13"),
    ("9a77a636-e4e2-4f1a-93ac-978c368fd59g", "invalid character: found `g` at 35"),
])
def test_uuid_errors(text, message):
    with pytest.raises(ValueError) as info:
        sk.parse_uuid(text)
    assert str(info.value) == message


# ---------------------------------------------------------------------------------------------
# Dates (§1.1, §1.2)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,shown", [
    ("2050-11-13T00:00:00Z", "2050-11-13T00:00:00Z"),
    ("2050-11-13t00:00:00z", "2050-11-13T00:00:00Z"),
    ("2050-11-13T00:00:00.120Z", "2050-11-13T00:00:00.12Z"),
    ("2050-11-13T00:00:00.000Z", "2050-11-13T00:00:00Z"),
    ("2050-11-13T00:00:00.123456789Z", "2050-11-13T00:00:00.123456789Z"),
    ("2050-11-13T10:30:00+02:00", "2050-11-13T10:30:00+02:00"),
    ("2050-11-13T10:30:00-05:30", "2050-11-13T10:30:00-05:30"),
    ("2050-11-13T10:30:00+00:00", "2050-11-13T10:30:00Z"),
    ("2050-11-13T10:30:00-00:00", "2050-11-13T10:30:00Z"),
    ("2050-11-13T10:30:00", "2050-11-13T10:30:00Z"),
    ("2050-11-13 10:30:00", "2050-11-13T10:30:00Z"),
    ("2050-11-13", "2050-11-13T00:00:00Z"),
    # the `time` crate's RFC 3339 parser takes any one byte between date and time, any number
    # of fraction digits, and a leap second where one may fall (the last second of a UTC month)
    ("2050-11-13 10:30:00Z", "2050-11-13T10:30:00Z"),
    ("2050-11-13_10:30:00+01:00", "2050-11-13T10:30:00+01:00"),
    ("2050-11-13T00:00:00.1234567891234Z", "2050-11-13T00:00:00.123456789Z"),
    ("2050-11-30T23:59:60Z", "2050-11-30T23:59:59.999999999Z"),
    ("2050-12-01T00:59:60.25+01:00", "2050-12-01T00:59:59.999999999+01:00"),
    # its `[year repr:full]` takes a sign
    ("+2050-11-13", "2050-11-13T00:00:00Z"),
    ("+2050-11-13 10:30:00", "2050-11-13T10:30:00Z"),
])
def test_expires_at_accepted_forms(text, shown):
    assert sk.format_rfc3339(sk.parse_expires_at(text)) == shown


def test_expires_at_instant_and_rejects():
    assert sk.parse_expires_at("2050-11-13T02:00:00+02:00").ns == \
        sk.parse_expires_at("2050-11-13T00:00:00Z").ns
    for bad in ("2050-11-13T00:00:00.5", "2050-02-30", "2050-13-01", "2050-11-13T24:00:00Z",
                "2050-11-13T00:00:00+24:00", "13/11/2050", "tomorrow", "2050-11-13T00:00Z",
                "2050-11-13 10:30", "", "2050-11-29T23:59:60Z", "2050-11-30T23:59:60+01:00",
                "\u0662\u0660\u0665\u0660-11-13", "2050-11-13\u00e910:30:00Z", "+12050-11-13",
                "-2050-11-13", "2050-11-13T10:30:00.Z", "2050-11-13t10:30:00", "+2050-11-13T10:30:00Z"):
        assert sk.parse_expires_at(bad) is None, bad
    with pytest.raises(sk.ApiError):
        sk.validate_expires_at("2050-01-01", sk.parse_expires_at("2050-01-01").ns)
    assert sk.validate_expires_at(FUTURE, time.time_ns()).ns > time.time_ns()


def test_timestamps_always_carry_a_fraction():
    assert sk.format_timestamp(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456789Z"
    assert sk.format_timestamp(1_700_000_000_500_000_000) == "2023-11-14T22:13:20.5Z"
    clock = sk.Clock(last_ns=1_699_999_999_999_999_999)
    stamps = [clock.now_ns() for _ in range(1000)]
    assert stamps == sorted(set(stamps)) and all(ns % 10 ** 9 for ns in stamps)
    assert all("." in sk.format_timestamp(ns) for ns in stamps)


# ---------------------------------------------------------------------------------------------
# Key derivation (§5, upstream vectors)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("master,uid,key", [
    ("MASTER_KEY", "4bc0887a-0e41-4f3b-935d-0c451dcee9c8",
     "d9e776b8412f1db6974c9a5556b961c3559440b6588216f4ea5d9ed49f7c8f3c"),
    ("MASTER_KEY", "00000000-0000-0000-0000-000000000000",
     "aeb94973e0b6e912d94165430bbe87dee91a7c4f891ce19050c3910ec96977e9"),
    ("kefir", "9a77a636-e4e2-4f1a-93ac-978c368fd596",
     "760c6345918b5ab1d251c1a3e8f9666547628a710d91f6b1d558ba944ef15746"),
    ("kefir", "dc699ff0-a053-4956-a46a-912e51b3316b",
     "4d9376547ed779a05dde416148e7e98bd47530e28c500be674c9e60b2accb814"),
])
def test_key_derivation_vectors(master, uid, key):
    assert sk.derive_key(master, uid) == key
    assert sk.key_deriver(master)(uid) == key


def test_key_deriver_matches_hmac_for_any_master_length():
    rng = random.Random(20261121)
    for length in (0, 1, 16, 63, 64, 65, 200):
        master = "".join(rng.choice("abcé€ XYZ019") for _ in range(length))
        uid = sk.new_uid()
        assert sk.key_deriver(master)(uid) == sk.derive_key(master, uid), length


# ---------------------------------------------------------------------------------------------
# Tenant tokens (§9)
# ---------------------------------------------------------------------------------------------

PARENT_UID = "9a77a636-e4e2-4f1a-93ac-978c368fd596"
PARENT = sk.derive_key("kefir", PARENT_UID)


def craft(header, claims, secret=PARENT, algorithm="HS256"):
    signed = sk.b64url_encode(json.dumps(header).encode()) + "." + \
        sk.b64url_encode(json.dumps(claims).encode())
    return signed + "." + sk._jwt_signature(algorithm, secret, signed)


@pytest.mark.parametrize("algorithm", ["HS256", "HS384", "HS512"])
def test_token_round_trip(algorithm):
    token = sk.sign_tenant_token(PARENT, PARENT_UID.upper(), {"movies": {"filter": "a = 1"}},
                                 expires_at=int(time.time()) + 60, algorithm=algorithm)
    claims = sk.verify_tenant_token(token, PARENT)
    assert claims["apiKeyUid"] == PARENT_UID
    assert claims["searchRules"] == {"movies": {"filter": "a = 1"}}
    assert sk.verify_tenant_token(token, lambda uid: sk.derive_key("kefir", uid)) == claims


def test_token_made_by_the_official_sdk_verifies():
    meilisearch = pytest.importorskip("meilisearch", reason="needs the meilisearch client: run python3 tests/run.py, "
                                      "which installs requirements-dev.txt")
    client = meilisearch.Client("http://127.0.0.1:1", PARENT)
    token = client.generate_tenant_token(PARENT_UID, ["movies"])
    assert sk.verify_tenant_token(token, PARENT)["searchRules"] == ["movies"]


def token_error(token, now=None):
    with pytest.raises(sk.TenantTokenError) as info:
        sk.verify_tenant_token(token, PARENT, now=now)
    return str(info.value)


def test_token_refusals():
    good = {"searchRules": ["*"], "apiKeyUid": PARENT_UID}
    assert token_error(craft({"alg": "HS256"}, good, secret=sk.derive_key("other", PARENT_UID))) \
        == "Could not decode tenant token, InvalidSignature."
    assert token_error(craft({"alg": "RS256"}, good)) == \
        "Could not decode tenant token, InvalidAlgorithm."
    assert token_error(craft({"alg": "HS256"}, dict(good, exp=1000)), now=2000) == \
        "Tenant token expired. Was valid up to `1000` and we're now `2000`."
    assert sk.verify_tenant_token(craft({"alg": "HS256"}, dict(good, exp=2000)), PARENT,
                                  now=2000)["exp"] == 2000
    missing = token_error(craft({"alg": "HS256"}, {"apiKeyUid": PARENT_UID}))
    assert missing.startswith("Could not decode tenant token, JSON error: missing field "
                              "`searchRules`")
    assert "missing field `apiKeyUid`" in token_error(craft({"alg": "HS256"},
                                                            {"searchRules": []}))
    assert "unknown variant `none`" in token_error(craft({"alg": "none"}, good))
    assert "SearchRules" in token_error(craft({"alg": "HS256"}, dict(good, searchRules=5)))
    assert "Base64 error" in token_error("a!.b.c")
    for not_a_jwt in (PARENT, "abc", "a.b"):
        with pytest.raises(sk.NotATenantToken):
            sk.verify_tenant_token(not_a_jwt, PARENT)


@pytest.mark.parametrize("text,message", [
    # the base64 crate (0.22) URL_SAFE_NO_PAD engine jsonwebtoken 10.4 decodes with
    ("a!", "Invalid symbol 33, offset 1."),
    ("a", "Invalid input length: 1"),
    ("abcde", "Invalid input length: 5"),
    ("YR", "Invalid last symbol 82, offset 1."),
    ("YWJ", "Invalid last symbol 74, offset 2."),
    ("YQ==", "Invalid padding"),
    ("a=bc", "Invalid symbol 61, offset 1."),
    ("ab=c", "Invalid symbol 61, offset 2."),
    ("abcd=", "Invalid symbol 61, offset 4."),
    ("YWJj\u00e9", "Invalid symbol 195, offset 4."),
])
def test_base64_errors_are_the_base64_crates(text, message):
    with pytest.raises(sk.TenantTokenError) as info:
        sk.b64url_decode(text)
    assert str(info.value) == "Base64 error: " + message


def test_base64_decodes_what_it_accepts():
    for data in (b"", b"a", b"ab", b"abc", bytes(range(256))):
        assert sk.b64url_decode(sk.b64url_encode(data)) == data


def test_token_refusals_follow_jsonwebtoken_10():
    good = {"searchRules": ["*"], "apiKeyUid": PARENT_UID}
    token = craft({"alg": "HS256"}, good)
    signed, _, signature = token.rpartition(".")
    # the signature is base64-decoded before it is compared (and upstream's message ends in
    # a second full stop after the base64 crate's own)
    assert token_error(signed + "." + signature[:-1] + "!") == \
        "Could not decode tenant token, Base64 error: Invalid symbol 33, offset %d.." \
        % (len(signature) - 1)
    assert token_error(signed + ".") == "Could not decode tenant token, InvalidSignature."
    # no audience is configured: any readable `aud` refuses a well-signed token
    for aud in ("searchers", ["a", "b"], []):
        assert token_error(craft({"alg": "HS256"}, dict(good, aud=aud))) == \
            "Could not decode tenant token, InvalidAudience."
    for aud in (None, 5, [1]):  # unreadable: ignored
        assert sk.verify_tenant_token(craft({"alg": "HS256"}, dict(good, aud=aud)), PARENT)
    assert token_error(craft({"alg": "HS256"}, dict(good, aud="x"),
                             secret=sk.derive_key("other", PARENT_UID))) == \
        "Could not decode tenant token, InvalidSignature."  # the signature comes first
    # claims are read in the order they come, as serde does
    # ... and placed where serde_json stands when it reports each error
    uid = '"apiKeyUid": "%s"' % PARENT_UID
    for header, payload, shown in (
            ('{"alg": "HS256"}', '{"apiKeyUid": 5, "searchRules": 7}',
             "invalid type: integer `5`, expected a formatted UUID string at line 1 column 15"),
            ('{"alg": "HS256"}', '{"apiKeyUid": [1], "searchRules": 7}',
             "invalid type: sequence, expected a formatted UUID string at line 1 column 14"),
            ('{"alg": "HS256"}', '{"apiKeyUid": "x"}',
             "UUID parsing failed: invalid character: found `x` at 0 at line 1 column 17"),
            ('{"alg": "HS256"}', '{"searchRules": [], "searchRules": [], %s}' % uid,
             "duplicate field `searchRules` at line 1 column 33"),
            ('{"alg": "HS256"}', '{%s}' % uid, "missing field `searchRules` at line 1 column 53"),
            ('{"alg": "HS256"}', '{%s, "searchRules": 5 }' % uid,
             "data did not match any variant of untagged enum SearchRules at line 1 column 72"),
            ('{"alg": "HS256"}', '{"searchRules": 5 , %s}' % uid,
             "data did not match any variant of untagged enum SearchRules at line 1 column 18"),
            ('{"alg": "HS256"}', '{"searchRules": [],\n "exp": "1", %s}' % uid,
             'invalid type: string "1", expected i64 at line 2 column 11'),
            ('{"alg": "none"}', '{}', "unknown variant `none`, expected one of `HS256`, `HS384`, "
             "`HS512`, `ES256`, `ES384`, `RS256`, `RS384`, `RS512`, `PS256`, `PS384`, `PS512`, "
             "`EdDSA` at line 1 column 14"),
            ('{"alg": null}', '{}', "expected value at line 1 column 9"),
            ('{"typ": "JWT"}', '{}', "missing field `alg` at line 1 column 14"),
            ('{"alg": "HS256", "typ": 5}', '{}',
             "invalid type: integer `5`, expected a string at line 1 column 25"),
            ('{"alg": "HS256", "x5c": ["a", 7]}', '{}',
             "invalid type: integer `7`, expected a string at line 1 column 31")):
        assert token_error(craft_raw(header, payload)) == \
            "Could not decode tenant token, JSON error: %s." % shown
    for exp, shown in ((1.5, "invalid type: floating point `1.5`, expected i64"),
                       (1e20, "invalid type: floating point `100000000000000000000.0`, "
                              "expected i64"),
                       (2 ** 63, "invalid value: integer `9223372036854775808`, expected i64"),
                       (True, "invalid type: boolean `true`, expected i64")):
        assert token_error(craft({"alg": "HS256"}, dict(good, exp=exp))).startswith(
            "Could not decode tenant token, JSON error: %s at line 1 column " % shown)


def test_search_rules_read_as_meilisearch_reads_them():
    good = {"searchRules": {"movies": ["genre = a"], "shows": None}, "apiKeyUid": PARENT_UID}
    claims = sk.verify_tenant_token(craft({"alg": "HS256"}, good), PARENT)
    assert claims["searchRules"] == {"movies": {"filter": "genre = a"}, "shows": None}
    for rules in ({"movies": []}, {"movies": ["a", "b"]}, {"movies": 5}, [5], "movies"):
        assert token_error(craft({"alg": "HS256"}, dict(good, searchRules=rules))).startswith(
            "Could not decode tenant token, JSON error: data did not match any variant of "
            "untagged enum SearchRules at line 1 column ")


def test_refusals_list_indexes_as_meilisearch_does():
    """A HashSet of patterns, sorted, printed with Rust's {:?}."""
    parent = FakeKey(["search"], ["b", "a", "b"])
    assert sk.authorize(parent, "search", "z", 0).message == \
        'The API key cannot acces the index `z`, authorized indexes are ["a", "b"].'
    rules = ["x\"y", "x\"y", "t\u00e9\n\u0301"]
    assert sk.authorize(FakeKey(["search"], ["*"]), "search", "z", 0, tenant_rules=rules).message \
        == 'The provided tenant token cannot acces the index `z`, allowed indexes are ' \
           '["t\u00e9\\n\\u{301}", "x\\"y"].'


def craft_raw(header, payload, secret=PARENT):
    signed = sk.b64url_encode(header.encode()) + "." + sk.b64url_encode(payload.encode())
    return signed + "." + sk._jwt_signature("HS256", secret, signed)


def test_guard_accepts_tenant_tokens_on_search_and_document_reading_routes_only():
    store = sk.KeyStore("kefir")
    parent = store.create({"uid": PARENT_UID, "actions": ["search", "documents.*"],
                           "indexes": ["movies*"], "expiresAt": None})
    guard = sk.Guard(store, "kefir")
    token = sk.sign_tenant_token(parent.value, PARENT_UID, {"movies": {"filter": "x = 1"}})
    principal = guard.check("Bearer " + token, ("search",), "movies")
    assert principal.key is parent and principal.rules == {"movies": {"filter": "x = 1"}}
    assert guard.check("Bearer " + token, ("search",), None).rules is not None  # multi-search
    assert guard.check("Bearer " + token, ("documents.get",), "movies").rules is not None
    with pytest.raises(sk.ApiError) as info:
        guard.check("Bearer " + token, ("documents.delete",), "movies")
    assert info.value.message == INVALID
    with pytest.raises(sk.ApiError) as info:
        guard.check("Bearer " + token, ("search",), "movies2")
    assert "tenant token cannot acces the index `movies2`" in info.value.message
    stranger = sk.sign_tenant_token(sk.derive_key("kefir", sk.new_uid()), sk.new_uid(), ["*"])
    with pytest.raises(sk.ApiError) as info:
        guard.check("Bearer " + stranger, ("search",), "movies")
    assert info.value.message == "Could not decode tenant token, InvalidSignature."


def refusal(rule, principal, body, index=None):
    with pytest.raises(sk.ApiError) as info:
        rule(principal, index, body)
    return info.value.message


def test_handler_checks():
    scoped = sk.Principal(FakeKey(["search", "indexes.create", "indexes.swap"], ["movies*"]))
    assert sk.check_new_index_uid(scoped, None, {"uid": "movies2"}) == {"uid": "movies2"}
    assert refusal(sk.check_new_index_uid, scoped, {"uid": "books"}) == INVALID
    assert refusal(sk.scope_multi_search, scoped, {"queries": [
        {"indexUid": "movies"}, {"indexUid": "books"}]}) == \
        "Inside `.queries[1]`: The provided API key is invalid."
    assert refusal(sk.check_index_swap, scoped, [{"indexes": ["movies", "books"]}]) == INVALID
    assert sk.check_index_swap(scoped, None, [{"indexes": ["movies", "movies2"]}])
    token = sk.Principal(FakeKey(["search"], ["*"]), rules=["movies"])
    assert not token.unscoped and not token.may_use_index("books")
    assert sk.Principal().unscoped and sk.Principal(FakeKey(["search"], ["*"])).unscoped


def test_tenant_filters_are_added_to_searches():
    rules = {"*": {"filter": "public = true"}, "mov*": {"filter": "a = 1"},
             "movies": {"filter": ["b = 2", ["c = 3", "d = 4"]]}, "shows": None}
    assert sk.tenant_filter(rules, "movies") == ["b = 2", ["c = 3", "d = 4"]]  # exact wins
    assert sk.tenant_filter(rules, "movies2") == "a = 1"     # longer pattern wins
    assert sk.tenant_filter(rules, "books") == "public = true"
    assert sk.tenant_filter(rules, "shows") is None and sk.tenant_filter(["*"], "x") is None
    assert sk.with_tenant_filter({"q": "x"}, rules, "movies2") == {"q": "x", "filter": "a = 1"}
    assert sk.with_tenant_filter({"q": "x", "filter": "y > 1"}, rules, "movies2") == \
        {"q": "x", "filter": ["y > 1", "a = 1"]}
    assert sk.with_tenant_filter({"filter": None}, rules, "books") == {"filter": "public = true"}
    token = sk.Principal(FakeKey(["search"], ["*"]), rules=rules)
    body = sk.scope_multi_search(token, None, {"federation": {}, "queries": [
        {"indexUid": "movies2", "q": "a"}, {"indexUid": "shows", "filter": "z = 1"}]})
    assert body == {"federation": {}, "queries": [
        {"indexUid": "movies2", "q": "a", "filter": "a = 1"},
        {"indexUid": "shows", "filter": "z = 1"}]}
    assert sk.scope_search_value(token, "books", {"q": "a"}) == {"q": "a",
                                                                   "filter": "public = true"}
    query = scoped_query(token, "movies2", "q=a+b&filter=y+%3E+1&limit=3")
    assert sk.urllib.parse.parse_qsl(query) == [("q", "a b"), ("limit", "3"),
                                                ("filter", '["y > 1","a = 1"]')]
    assert scoped_query(token, "shows", "q=a") == "q=a"


def test_which_requests_need_the_handler_rules():
    def applies(principal, route, index):
        return sk.ROUTE_INDEX[route].scope_rule(principal, index) is not None
    everything = sk.Principal(FakeKey(["*"], ["*"]))
    scoped = sk.Principal(FakeKey(["*"], ["movies*"]))
    token = sk.Principal(FakeKey(["search"], ["*"]), rules={"movies": {"filter": "a = 1"},
                                                             "shows": None})
    search = ("POST", "/indexes/{index_uid}/search")
    assert not applies(sk.OPEN, ("POST", "/multi-search"), None)
    assert not applies(everything, ("GET", "/indexes"), None)
    for route in (("POST", "/multi-search"), ("GET", "/indexes"), ("GET", "/stats"),
                  ("DELETE", "/tasks"), ("GET", "/tasks/{task_id}"), ("POST", "/indexes"),
                  ("POST", "/render-template")):
        assert applies(scoped, route, None), route
    assert not applies(scoped, search, "movies")       # the index check was enough
    assert applies(token, search, "movies") and not applies(token, search, "shows")
    assert applies(token, ("GET", "/indexes/{index_uid}/similar"), "movies")
    assert "cannot enforce" in sk.scope_not_enforceable(sk.ROUTE_INDEX[search], "here").message


def test_list_answers_are_filtered_for_restricted_keys():
    scoped = sk.Principal(FakeKey(["indexes.get", "stats.get"], ["movies*", "shows"]))
    answer = {"results": [{"uid": u} for u in ("books", "movies", "movies2", "music", "shows")],
              "offset": 0, "limit": 1000000, "total": 5}
    assert sk.filter_index_list(scoped, answer, 1, 5) == {
        "results": [{"uid": "movies2"}, {"uid": "shows"}], "offset": 1, "limit": 5, "total": 3}
    stats = {"databaseSize": 1, "lastUpdate": "2026-01-01T00:00:00Z",
             "indexes": {"books": {}, "movies": {"n": 1}}}
    covered = [{"uid": "movies", "updatedAt": "2025-01-01T00:00:00.5Z"},
               {"uid": "movies2", "updatedAt": "2025-01-01T00:00:00Z"}]
    assert sk.filter_stats(scoped, stats, covered) == {
        "databaseSize": 1, "lastUpdate": "2025-01-01T00:00:00.5Z",
        "indexes": {"movies": {"n": 1}}}
    assert sk.filter_stats(scoped, stats, [])["lastUpdate"] is None


def test_task_routes_are_limited_to_the_keys_indexes():
    parse = sk.urllib.parse.parse_qsl
    allowed = ["movies", "movies2"]
    assert parse(sk.scope_task_query("limit=2", allowed)) == [
        ("limit", "2"), ("indexUids", "movies,movies2")]
    assert parse(sk.scope_task_query("indexUids=books,movies2", allowed)) == [
        ("indexUids", "movies2")]
    assert parse(sk.scope_task_query("indexUids=*", allowed)) == [
        ("indexUids", "movies,movies2")]
    nothing = dict(parse(sk.scope_task_query("indexUids=books", allowed)))["indexUids"]
    assert nothing.startswith("searchkeys-no-index-") and sk.is_valid_index_pattern(nothing)
    scoped = sk.Principal(FakeKey(["tasks.get"], ["movies*"]))
    assert sk.check_task_answer(scoped, "2", {"indexUid": "movies"}) == {"indexUid": "movies"}
    for task in ({"indexUid": "books"}, {"indexUid": None}, []):
        with pytest.raises(sk.ApiError) as info:
            sk.check_task_answer(scoped, "1", task)
        assert (info.value.status, info.value.message) == (404, "Task `1` not found.")
    with pytest.raises(sk.ApiError) as info:  # upstream shows the task uid it parsed
        sk.check_task_answer(scoped, "+007", {"indexUid": "books"})
    assert info.value.message == "Task `7` not found."
    one_index = {"documentAdditionOrUpdate": 2}
    for uids in ({"movies": 1}, {"movies": 1, "books": 1}):  # any covered index, as upstream
        assert sk.check_batch_answer(scoped, "3", {"stats": {"indexUids": uids,
                                                             "types": one_index}})
    for batch in ({"stats": {"indexUids": {"books": 1}, "types": one_index}},
                  {"stats": {"indexUids": {"movies": 1}, "types": {"indexSwap": 1}}},
                  {"stats": {"indexUids": {"movies": 1}}}, {"stats": {}}):
        with pytest.raises(sk.ApiError) as info:
            sk.check_batch_answer(scoped, "3", batch)
        assert (info.value.code, info.value.message) == ("batch_not_found", "Batch `3` not found.")


# ---------------------------------------------------------------------------------------------
# Key store and its file
# ---------------------------------------------------------------------------------------------

def new_fields(**extra):
    fields = {"actions": ["search"], "indexes": ["*"], "expiresAt": None}
    fields.update(extra)
    return fields


def test_memory_store_defaults_and_listing():
    store = sk.KeyStore(MASTER)
    names = [k.name for k in store.page(0, 20)[0]]
    assert names == ["Default Search API Key", "Default Admin API Key",
                     "Default Read-Only Admin API Key", "Default Chat API Key"]
    made = [store.create(new_fields(name=str(i))) for i in range(5)]
    page, total = store.page(1, 3)
    assert total == 9 and [k.name for k in page] == ["3", "2", "1"]
    assert store.page(100, 5) == ([], 9) and store.page(0, 2 ** 64 - 1)[1] == 9
    key = made[0]
    assert key.value == sk.derive_key(MASTER, key.uid)
    assert store.find(key.value.upper()) is key and store.find(key.uid.upper()) is key
    with pytest.raises(sk.ApiError) as info:
        store.find(MASTER)
    assert info.value.message == "API key `MASTER_KEY` not found."
    with pytest.raises(sk.ApiError) as info:
        store.create(new_fields(uid=key.uid))
    assert info.value.status == 409
    updated = store.update(key.uid, {"name": None})
    assert updated.name is None and updated.updated_ns > updated.created_ns
    assert updated.to_json()["createdAt"] == key.to_json()["createdAt"]
    store.delete(key.value)
    assert store.by_value(key.value) is None and store.by_uid(key.uid) is None
    assert list(updated.to_json()) == ["name", "description", "key", "uid", "actions", "indexes",
                                       "expiresAt", "createdAt", "updatedAt"]


def store_document(path):
    """The store as `jq` would read it: one JSON document."""
    return json.loads(path.read_text())


def test_file_store_survives_reopen_and_holds_no_secrets(tmp_path):
    path = tmp_path / "keys.json"
    store = sk.KeyStore(MASTER, str(path))
    kept = store.create(new_fields(name="kept", expiresAt=sk.parse_expires_at(
        "2099-01-01T00:00:00.5+02:00")))
    gone = store.create(new_fields(name="gone"))
    assert len(store_document(path)["keys"]) == 6  # each change is in the document at once
    store.update(kept.uid, {"description": "d"})
    store.delete(gone.uid)
    document = store_document(path)
    assert [r["uid"] for r in document["keys"]][-1] == kept.uid
    assert document["keys"][-1]["description"] == "d" and len(document["keys"]) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "keys.json", "keys.json.history", "keys.json.lock"]
    store.close()
    for file in tmp_path.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
        data = file.read_text()
        assert MASTER not in data and kept.value not in data
    again = sk.KeyStore(MASTER, str(path))
    assert again.by_uid(kept.uid).to_json() == store.by_uid(kept.uid).to_json()
    assert again.by_uid(kept.uid).to_json()["expiresAt"] == "2099-01-01T00:00:00.5+02:00"
    assert again.by_uid(gone.uid) is None and len(again) == 5
    other = sk.KeyStore(MASTER, str(path))  # another process's: the store is shared (issue 32)
    assert other.by_uid(kept.uid).to_json() == again.by_uid(kept.uid).to_json()
    other.close()
    again.close()
    with pytest.raises(sk.StoreError) as info:  # every key value would change
        sk.KeyStore("another-master", str(path))
    assert "another master key" in str(info.value)
    assert sk.KeyStore("another-master", str(path), master_key_changed=True) \
        .by_uid(kept.uid).value == sk.derive_key("another-master", kept.uid)


def test_loose_store_mode_is_tightened_at_start(tmp_path):
    path = tmp_path / "keys.json"
    sk.KeyStore(MASTER, str(path)).close()
    path.chmod(0o644)
    logged = []
    sk.KeyStore(MASTER, str(path), logged.append).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert any("0644" in line and "0600" in line for line in logged), logged


def test_symlinked_store_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "data" / "keys.json"
    target.parent.mkdir()
    link = tmp_path / "keys.json"
    link.symlink_to(target)
    store = sk.KeyStore(MASTER, str(link))
    made = store.create(new_fields(name="through"))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert store_document(target)["keys"][-1]["uid"] == made.uid
    store.close()
    assert link.is_symlink()
    assert sk.KeyStore(MASTER, str(link)).by_uid(made.uid).name == "through"
    # the lock file sits beside the target: processes reaching the store by either name
    # take turns on one lock
    assert sorted(p.name for p in target.parent.iterdir()) == [
        "keys.json", "keys.json.history", "keys.json.lock"]
    assert not (tmp_path / "keys.json.lock").exists()


def test_a_journal_of_a_development_build_is_refused_in_one_sentence(tmp_path):
    """Only development builds (no release) kept FILE.journal beside the store: its changes
    are not read, so the start stops with one sentence naming it, both files untouched."""
    path = tmp_path / "keys.json"
    sk.KeyStore(MASTER, str(path)).close()
    journal = tmp_path / "keys.json.journal"
    journal.write_bytes(b'{"op": "delete", "uid": "x"}\n')
    before = (path.read_bytes(), journal.read_bytes())
    with pytest.raises(sk.StoreError) as info:
        sk.KeyStore(MASTER, str(path))
    assert str(journal) in str(info.value) and "development" in str(info.value)
    assert ". " not in str(info.value)
    assert (path.read_bytes(), journal.read_bytes()) == before


def test_damaged_document_refuses_and_is_left_untouched(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"format": "searchkeys-store", "version": 1, "keys": [')
    with pytest.raises(sk.StoreError) as info:
        sk.KeyStore(MASTER, str(path))
    assert str(path) in str(info.value)
    assert path.read_text().endswith("[")
    path.write_text('{"format": "searchkeys-store", "version": 1, "keys": [{"uid": "x"}]}')
    with pytest.raises(sk.StoreError):
        sk.KeyStore(MASTER, str(path))


def test_default_keys_are_written_together(tmp_path, monkeypatch):
    """A crash while a fresh store gets its four default keys leaves all or none of them."""
    real_fsync, calls = sk.os.fsync, []

    def fsync_then_crash(fd):
        calls.append(fd)
        if len(calls) > 2:  # the file and its folder, once
            raise OSError(5, "Input/output error")
        real_fsync(fd)
    monkeypatch.setattr(sk.os, "fsync", fsync_then_crash)
    store = sk.KeyStore(MASTER, str(tmp_path / "keys.json"))
    store.close()
    monkeypatch.undo()
    assert len(store_document(tmp_path / "keys.json")["keys"]) == 4


def test_a_failed_folder_sync_after_the_rename_still_applies_the_change(tmp_path, monkeypatch):
    """Once the new document is renamed into place the change is made: a folder fsync that
    fails then is logged, and memory agrees with the file (a deleted key stayed valid)."""
    path, logged = tmp_path / "keys.json", []
    store = sk.KeyStore(MASTER, str(path), logged.append)
    victim = store.page(0, 100)[0][0]
    real_fsync = sk.os.fsync

    def folder_sync_fails(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error")
        real_fsync(fd)
    monkeypatch.setattr(sk.os, "fsync", folder_sync_fails)
    store.delete(victim.uid)
    assert store.by_uid(victim.uid) is None and store.by_value(victim.value) is None
    assert victim.uid not in [r["uid"] for r in store_document(path)["keys"]]
    assert any("cannot sync folder" in line and "Input/output" in line for line in logged)
    store.close()


def test_failed_write_is_not_applied(tmp_path, monkeypatch):
    path = tmp_path / "keys.json"
    store = sk.KeyStore(MASTER, str(path))
    before = store.page(0, 100)
    document = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(sk.os, "fsync", disk_full)  # the temp file is written, its fsync fails
    with pytest.raises(sk.StoreWriteError) as info:
        store.create(new_fields(name="lost"))
    assert "No space left" in str(info.value)
    with pytest.raises(sk.StoreWriteError):
        store.delete(before[0][0].uid)
    assert store.page(0, 100) == before and path.read_bytes() == document
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "keys.json", "keys.json.history", "keys.json.lock"]
    # nor in the history: only the four default keys' creation is there
    assert len((tmp_path / "keys.json.history").read_text().splitlines()) == 4
    monkeypatch.undo()
    store.create(new_fields(name="works again"))
    store.close()
    assert len(sk.KeyStore(MASTER, str(path))) == 5


def test_logged_paths_hide_key_values():
    value = sk.derive_key(MASTER, PARENT_UID)
    for raw in ("/keys/" + value, "//keys/" + value + "/", "/%6Beys/" + value + "?x=" + value,
                "/indexes/" + value + "/search"):
        assert value not in sk.safe_path(raw) and "<hidden>" in sk.safe_path(raw)
    assert sk.safe_path("/keys/" + PARENT_UID) == "/keys/" + PARENT_UID
    assert sk.safe_path("/indexes/movies/search?q=secret") == "/indexes/movies/search"


def test_filters_are_fused_as_meilisearch_fuses_them():
    """meilisearch search/mod.rs fuse_filters: arrays spliced into one AND-list; an inner
    array (an OR) stays one element; None is no filter."""
    fuse = sk.fuse_filters
    assert fuse(None, None) is None
    assert fuse("a = 1", None) == "a = 1" and fuse(None, ["b = 2"]) == ["b = 2"]
    assert fuse("tenant = 2", ["tenant = 1", "deleted = false"]) == \
        ["tenant = 2", "tenant = 1", "deleted = false"]
    assert fuse(["a", ["b", "c"]], "d") == ["a", ["b", "c"], "d"]
    token = sk.Principal(FakeKey(["search"], ["*"]), rules={"m": {"filter": ["t = 1", "x"]}})
    assert sk.scope_search_value(token, "m", {"filter": "t = 2"}) == {
        "filter": ["t = 2", "t = 1", "x"]}
    query = scoped_query(token, "m", "filter=null")
    assert sk.urllib.parse.parse_qsl(query) == [("filter", '[null,"t = 1","x"]')]


def test_only_origin_form_targets_pass():
    assert sk.origin_form("/indexes/a/search?q=1") == "/indexes/a/search?q=1"
    for target in ("http://indexes/keys", "x/indexes", "*", "/a#/keys", "/a b", "/\u00e9", ""):
        with pytest.raises(sk.ApiError) as info:
            sk.origin_form(target)
        assert info.value.status == 400


def test_log_text_is_one_line():
    assert sk.printable("/a\nb\r\x1b\u2028") == "/a\\nb\\r\\x1b\\u2028"
    assert "\n" not in sk.safe_path("/indexes/a%0Aforged/search")


def test_authorize_errors_fit_in_one_header_nginx_can_read():
    """/authorize's refusal rides in X-Searchkeys-Error for nginx, whose header buffer is
    4 KiB: a key naming 100 long index patterns must not make nginx answer 502."""
    patterns = ["i%03d" % n + "x" * 390 for n in range(100)]
    message = sk.Principal(FakeKey(["search"], patterns)).index_refusal("other").message
    assert len(message) > 39000
    header = sk.error_header(sk.ApiError(403, "invalid_api_key", message, "auth"))
    assert len(header) <= 1024 and header.isascii()
    assert json.loads(header)["code"] == "invalid_api_key"
    assert json.loads(header)["message"].startswith("The API key cannot acces the index `other`")
    short = sk.ApiError(403, "unknown_route", "`GET /keys` is answered by searchkeys itself.")
    assert json.loads(sk.error_header(short)) == short.to_json()


def documents_decision(method, path, rules=None, forced=None):
    """decide() for a documents read by a token (`rules`) or a key with `forced` parameters."""
    key = FakeKey(["documents.get"], ["*"])
    key.restrictions = sk.Restrictions(forced=forced) if forced is not None else None
    route, index, _ = sk.match_route(method, sk.path_segments(path))
    return route, sk.decide(route, sk.Principal(key, rules), index)


def test_a_documents_read_is_held_only_under_a_filter():
    for rules, forced in ((None, None), (None, {"books": {"filter": "a = 1"}}),
                          (None, {"movies": {"facets": ["genre"]}})):
        route, decision = documents_decision("GET", "/indexes/movies/documents/7", rules, forced)
        assert not decision.fetches_document and not decision.checks_joins
        assert decision.carrier == sk.QUERY and decision.answer_filter is None
        decision.check_unchanged(route, sk.Principal(), {}, "fields=a")  # /authorize: as sent
    for rules, forced in (({"movies": {"filter": "t = 1"}}, None),
                          (None, {"movies*": {"attributesToRetrieve": ["a"]}})):
        route, decision = documents_decision("GET", "/indexes/movies/documents/7", rules, forced)
        assert decision.fetches_document and decision.checks_joins
        assert decision.carrier == sk.BODY and decision.answer_filter is sk.one_document_answer
        with pytest.raises(sk.ApiError):
            decision.check_unchanged(route, sk.Principal(), {}, "")


def test_a_tokens_documents_read_shows_what_its_searches_would():
    """Any token, filtered or not: fields cut to the index's displayedAttributes (a fact)."""
    for rules in (["movies"], {"movies": None}, {"movies": {"filter": "t = 1"}}):
        for path in ("/indexes/movies/documents", "/indexes/movies/documents/7"):
            route, decision = documents_decision("GET", path, rules)
            assert "displayed_attributes" in decision.facts
            assert decision.fact_steps == (sk.Step(sk.SCOPE, sk.show_displayed),)
            assert decision.fetches_document == path.endswith("/7")
            with pytest.raises(sk.ApiError):
                decision.check_unchanged(route, sk.Principal(), {}, "")
    assert not documents_decision("GET", "/indexes/movies/documents")[1].fact_steps  # a key
    show = sk.show_displayed
    facts = {"displayed_attributes": ("a", "b")}
    assert show({"fields": ["b", "secret"], "retrieveVectors": True}, facts) == {
        "fields": ["b"], "retrieveVectors": False}
    assert show({"fields": ["*"], "filter": "t = 1"}, facts) == {
        "fields": ["a", "b"], "filter": "t = 1"}
    assert show({"fields": "a", "retrieveVectors": True},
                {"displayed_attributes": ("a", "_vectors")}) == {
        "fields": ["a", "_vectors"], "retrieveVectors": True}
    for value in ({"fields": ["secret"], "retrieveVectors": True}, [1], None):
        assert show(value, {"displayed_attributes": ("*",)}) == value


def test_forced_parameters_on_documents_fuse_the_filter_and_cut_the_fields():
    forced = {"movies": {"filter": ["p = 1", ["q = 1", "r = 1"]],
                         "attributesToRetrieve": ["a", "b"], "facets": ["c"]}}
    force = functools.partial(sk.force_documents, sk.Restrictions(forced=forced), "movies")
    assert force({"filter": "x = 1 OR y = 1", "fields": ["b", "secret", "b"]}) == {
        "filter": ["x = 1 OR y = 1", "p = 1", ["q = 1", "r = 1"]], "fields": ["b", "b"]}
    assert force({"fields": ["*", "secret"], "retrieveVectors": True}) == {
        "filter": ["p = 1", ["q = 1", "r = 1"]], "fields": ["a", "b"], "retrieveVectors": False}
    assert force({"fields": "secret", "filter": None})["fields"] == ["a", "b"]
    assert force([{"filter": "x"}]) == [{"filter": "x"}]  # not an object: the backend refuses it
    shows_vectors = sk.Restrictions(forced={"*": {"attributesToRetrieve": ["a", "_vectors"]}})
    assert sk.force_documents(shows_vectors, "movies", {"retrieveVectors": True}) == {
        "fields": ["a", "_vectors"], "retrieveVectors": True}


@pytest.mark.parametrize("document_id, query, expected", [
    ("7", "", {"ids": ["7"], "limit": 1}),
    ("x-4_B", "fields=a,b&retrieveVectors=true", {"ids": ["x-4_B"], "limit": 1,
                                                   "fields": ["a", "b"], "retrieveVectors": True}),
    ("7", "fields=a&fields=*&retrieveVectors=false", {"ids": ["7"], "limit": 1}),
    ("a b", "", {"ids": [], "limit": 1}),  # no document can have it: the same 404
    ("x" * 512, "", {"ids": [], "limit": 1}),
    ("caf\u00e9", "", {"ids": [], "limit": 1}),
])
def test_one_document_is_asked_as_a_fetch_of_its_id(document_id, query, expected):
    assert sk.fetch_one_document(document_id, query) == expected


@pytest.mark.parametrize("query, code, message", [
    ("filter=a%20%3D%201", "bad_request",
     "Unknown parameter `filter`: expected one of `fields`, `retrieveVectors`"),
    ("retrieveVector=true", "bad_request", "Unknown parameter `retrieveVector`: did you mean "
     "`retrieveVectors`? expected one of `fields`, `retrieveVectors`"),
    ("retrieveVectors=yes", "invalid_document_retrieve_vectors", "Invalid value in parameter "
     "`retrieveVectors`: could not parse `yes` as a boolean, expected either `true` or `false`"),
])
def test_one_document_refuses_its_query_as_meilisearch_does(query, code, message):
    with pytest.raises(sk.ApiError) as info:
        sk.fetch_one_document("7", query)
    assert (info.value.status, info.value.code, info.value.message) == (400, code, message)


def test_the_fetch_answer_is_the_document_or_meilisearchs_404():
    context = sk.RuleContext(None, {"document_id": "x-4"}, "", {})
    assert sk.one_document_answer(context, {"results": [{"id": "x-4"}], "total": 1}) == {
        "id": "x-4"}
    with pytest.raises(sk.ApiError) as info:
        sk.one_document_answer(context, {"results": [], "total": 0})
    assert info.value.to_json() == {
        "message": "Document `x-4` not found.", "code": "document_not_found",
        "type": "invalid_request", "link": "https://docs.meilisearch.com/errors#document_not_found"}
    with pytest.raises(sk.ApiError) as info:
        sk.one_document_answer(context, {"hits": []})
    assert info.value.status == 502
