"""The official `meilisearch` Python client (PyPI, 0.43) as a real peer of
`searchkeys.py serve`: it must manage keys on our server exactly as on Meilisearch,
and tenant tokens it generates must be accepted (MK = meilisearch-keys.md).
"""
import datetime
import hashlib
import hmac

import pytest

meilisearch = pytest.importorskip("meilisearch", reason="needs the meilisearch client: run python3 tests/run.py, which installs requirements-dev.txt")
from meilisearch.errors import MeilisearchApiError  # noqa: E402

from support import SEARCHKEYS, Daemon, free_port, python_cmd  # noqa: E402

MASTER = "client-master-key-0123456789"


def derive(uid):
    return hmac.new(MASTER.encode(), uid.encode(), hashlib.sha256).hexdigest()


@pytest.fixture(scope="module")
def url():
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER)
    with Daemon(argv, port, timeout=15.0):
        yield "http://127.0.0.1:%d" % port


@pytest.fixture(scope="module")
def client(url):
    return meilisearch.Client(url, MASTER, timeout=10)


def api_error(fn, *args):
    with pytest.raises(MeilisearchApiError) as info:
        fn(*args)
    return info.value


def test_default_keys_through_the_client(client):
    keys = client.get_keys()
    assert keys.total == 4 and keys.offset == 0 and keys.limit == 20  # MK §6
    assert [k.name for k in keys.results] == [
        "Default Search API Key", "Default Admin API Key", "Default Read-Only Admin API Key",
        "Default Chat API Key"]
    for k in keys.results:
        assert k.key == derive(k.uid) and k.expires_at is None and k.indexes == ["*"]
        assert isinstance(k.created_at, datetime.datetime)


def test_key_lifecycle(client):
    uid = "9a77a636-e4e2-4f1a-93ac-978c368fd596"
    created = client.create_key({"uid": uid, "name": "front", "description": "d",
                                 "actions": ["search", "documents.get"], "indexes": ["movies"],
                                 "expiresAt": "2050-11-13T00:00:00.5Z"})
    assert created.uid == uid and created.key == derive(uid)
    assert created.name == "front" and created.description == "d"
    assert created.actions == ["search", "documents.get"] and created.indexes == ["movies"]
    assert created.expires_at == datetime.datetime(2050, 11, 13, 0, 0, 0, 500000)
    assert created.updated_at == created.created_at

    for ref in (uid, created.key):
        got = client.get_key(ref)
        assert got.model_dump() == created.model_dump()

    listed = client.get_keys({"offset": 0, "limit": 1})
    assert listed.limit == 1 and len(listed.results) == 1 and listed.results[0].uid == uid
    assert listed.total >= 5

    updated = client.update_key(uid, {"name": "renamed", "description": None})
    assert updated.name == "renamed" and updated.description is None
    assert updated.created_at == created.created_at and updated.updated_at > created.updated_at
    assert client.get_key(created.key).name == "renamed"

    assert client.delete_key(uid) == 204
    err = api_error(client.get_key, uid)
    assert err.status_code == 404 and err.code == "api_key_not_found"
    assert err.message == "API key `%s` not found." % uid
    assert err.type == "invalid_request"
    assert err.link == "https://docs.meilisearch.com/errors#api_key_not_found"


def test_client_sees_upstream_errors(client, url):
    err = api_error(client.create_key, {"actions": ["search"], "indexes": ["*"]})
    assert err.status_code == 400 and err.code == "missing_api_key_expires_at"
    assert err.message == "Missing field `expiresAt`"
    err = api_error(client.update_key, derive("00000000-0000-0000-0000-000000000000"),
                    {"actions": ["*"]})
    assert err.code == "immutable_api_key_actions"
    err = api_error(meilisearch.Client(url, "wrong", timeout=10).get_keys)
    assert err.status_code == 403 and err.code == "invalid_api_key"


def test_generated_tenant_token_is_accepted(client, url):
    parent = client.create_key({"actions": ["search"], "indexes": ["movies", "books"],
                                "expiresAt": None})
    tomorrow = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    for kwargs in ({}, {"expires_at": tomorrow}):
        token = client.generate_tenant_token(parent.uid, ["movies"], api_key=parent.key, **kwargs)
        searcher = meilisearch.Client(url, token, timeout=10)
        err = api_error(searcher.index("movies").search, "hello")
        # allowed by the key service; no backend configured → 501 no_upstream (SK "Server")
        assert err.status_code == 501 and err.code == "no_upstream"
        err = api_error(searcher.index("books").search, "hello")
        assert err.status_code == 403 and err.code == "invalid_api_key"
        # the SDK appends its own version hint to errors of search calls
        assert err.message.startswith('The provided tenant token cannot acces the index `books`, '
                                      'allowed indexes are ["movies"].')
    forged = client.generate_tenant_token(parent.uid, ["*"], api_key="0" * 64)
    err = api_error(meilisearch.Client(url, forged, timeout=10).index("movies").search, "x")
    assert err.status_code == 403
    assert err.message.startswith("Could not decode tenant token, InvalidSignature.")
