"""Issue 23 item 5: the store records a fingerprint of the master key its keys were made with.
Another master key on a store with keys would silently change every key value (every key handed
out answered 403): `serve` refuses it in one sentence, unless `--master-key-changed` says the
change is intended. Older stores (no fingerprint) and empty ones start as before. Each test
runs the real script as a subprocess."""
import hashlib
import hmac
import json

from support import free_port
from test_searchkeys_startup import MASTER, refused, seeded_store, start

OTHER = "another-master-key-9876543210"


def derive(master, uid):
    return hmac.new(master.encode(), uid.encode(), hashlib.sha256).hexdigest()


def listed(server, master):
    status, _, body = server.request("GET", "/keys?limit=100",
                                     headers={"Authorization": "Bearer " + master})
    assert status == 200, body
    return json.loads(body)["results"]


def assert_never_holds_a_master_key(store):
    text = store.read_text()
    assert MASTER not in text and OTHER not in text


def test_another_master_key_on_a_store_with_keys_is_refused_in_one_sentence(tmp_path):
    store = seeded_store(tmp_path)
    before = store.read_bytes()
    code, message = refused("--master-key", OTHER, "--store", str(store))
    assert code == 1 and "another master key" in message and "every" in message, message
    assert "--master-key-changed" in message and str(store) in message, message
    assert message.count(". ") == 0, message  # one sentence
    assert store.read_bytes() == before
    assert_never_holds_a_master_key(store)
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as server:
        assert len(listed(server, MASTER)) == 5  # the right key still starts


def test_master_key_changed_starts_with_the_new_derivations_and_records_the_new_key(tmp_path):
    store = seeded_store(tmp_path)
    uids = sorted(record["uid"] for record in json.loads(store.read_text())["keys"])
    with start(free_port(), "--master-key", OTHER, "--store", str(store),
               "--master-key-changed") as server:
        keys = listed(server, OTHER)
        assert sorted(k["uid"] for k in keys) == uids
        assert all(k["key"] == derive(OTHER, k["uid"]) for k in keys)
        assert "warning" in server.log() and "--master-key-changed" in server.log()
    assert_never_holds_a_master_key(store)
    with start(free_port(), "--master-key", OTHER, "--store", str(store)) as server:
        assert "warning" not in server.log()  # recorded: no flag needed any more
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "another master key" in message, message


def test_a_store_without_a_fingerprint_starts_and_gets_one_at_the_next_change(tmp_path):
    store = seeded_store(tmp_path)
    document = json.loads(store.read_text())
    assert "masterKeyFingerprint" in document
    del document["masterKeyFingerprint"]  # as older versions wrote it
    store.write_text('{"format": "searchkeys-store", "version": 1, "keys": [\n%s\n]}\n'
                     % ",\n".join(json.dumps(record) for record in document["keys"]))
    with start(free_port(), "--master-key", OTHER, "--store", str(store)) as server:
        status, _, _ = server.request("PATCH", "/keys/" + document["keys"][0]["uid"],
                                      json.dumps({"name": "renamed"}),
                                      {"Authorization": "Bearer " + OTHER,
                                       "Content-Type": "application/json"})
        assert status == 200
    assert "masterKeyFingerprint" in json.loads(store.read_text())
    assert_never_holds_a_master_key(store)
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "another master key" in message, message


def test_a_store_without_keys_takes_any_master_key(tmp_path):
    store = seeded_store(tmp_path, extra_keys=0)
    document = json.loads(store.read_text())
    store.write_text('{"format": "searchkeys-store", "version": 1, "masterKeyFingerprint": '
                     '"%s", "keys": []}\n' % document["masterKeyFingerprint"])
    with start(free_port(), "--master-key", OTHER, "--store", str(store)) as server:
        keys = listed(server, OTHER)  # the four default keys, made with this master key
        assert len(keys) == 4 and all(k["key"] == derive(OTHER, k["uid"]) for k in keys)
    assert json.loads(store.read_text())["masterKeyFingerprint"] != \
        document["masterKeyFingerprint"]
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "another master key" in message, message


def test_a_bad_fingerprint_is_refused_and_the_file_left_alone(tmp_path):
    store = seeded_store(tmp_path)
    store.write_text(store.read_text().replace('"masterKeyFingerprint": "',
                                               '"masterKeyFingerprint": "zz', 1))
    before = store.read_bytes()
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "masterKeyFingerprint" in message and str(store) in message, message
    assert store.read_bytes() == before


def test_an_older_store_is_fingerprinted_at_its_first_start_even_without_a_change(tmp_path):
    # else a store that never changes takes another master key silently at every start
    store = seeded_store(tmp_path)
    document = json.loads(store.read_text())
    store.write_text('{"format": "searchkeys-store", "version": 1, "keys": [\n%s\n]}\n'
                     % ",\n".join(json.dumps(record) for record in document["keys"]))
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as server:
        assert len(listed(server, MASTER)) == 5
    assert json.loads(store.read_text())["keys"] == document["keys"]
    assert_never_holds_a_master_key(store)
    code, message = refused("--master-key", OTHER, "--store", str(store))
    assert code == 1 and "another master key" in message, message
