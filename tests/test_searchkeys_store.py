"""The key store's file (issue 30, store items): written from its records whatever the file's
line layout, a rotation's grace by the wall clock, the lock file never followed through a link,
and `serve` on a busy port leaves no store behind. Each test fails on the code before issue 30.
"""
import json
import os
import socket
import stat
import time

import pytest

import searchkeys as sk
from support import free_port
from test_searchkeys_startup import MASTER, refused, start, stored_uids

FIELDS = {"actions": ["search"], "indexes": ["*"], "expiresAt": None}


def test_a_hand_edited_store_with_the_same_line_count_loses_nothing_on_a_delete(tmp_path):
    """The review's case: record 1 split over two lines, records 2 and 3 joined on one: still
    valid JSON, same records, same line count. The writer reused line i as record i's text,
    so deleting key 3 also dropped key 2 from disk."""
    path = tmp_path / "keys.json"
    store = sk.KeyStore(MASTER, str(path))
    store.create(dict(FIELDS, name="mine"))
    store.close()
    lines = path.read_text().split("\n")
    records = lines[1:5]  # the header, five records (four defaults and mine), the tail
    assert all(line.startswith('{"uid":') for line in records)
    first = records[0].rstrip(",")
    cut = first.index(',"name"')
    edited = [lines[0], first[:cut] + ",", first[cut + 1:] + ",", records[1] + " " + records[2]]
    edited += lines[4:]
    path.write_text("\n".join(edited))
    assert len(edited) == len(lines)
    document = json.loads(path.read_text())
    uids = [record["uid"] for record in document["keys"]]
    assert len(uids) == 5
    store = sk.KeyStore(MASTER, str(path))
    store.delete(uids[2])
    store.close()
    assert stored_uids(path) == uids[:2] + uids[3:]
    again = sk.KeyStore(MASTER, str(path))
    assert [key.uid for key in again.page(0, 10)[0]] == list(reversed(uids[:2] + uids[3:]))
    again.close()


def test_a_rotation_grace_runs_on_the_wall_clock_not_a_future_created_at(tmp_path):
    """S5: the grace deadline came from the store's clock, which runs past every stored
    createdAt: a key dated 2100 kept the rotated key valid until 2100 plus the grace."""
    path = tmp_path / "keys.json"
    store = sk.KeyStore(MASTER, str(path))
    store.close()
    document = json.loads(path.read_text())
    future = 4102444800 * 10 ** 9  # 2100-01-01
    document["keys"][0]["createdAt"] = document["keys"][0]["updatedAt"] = future
    path.write_text(json.dumps(document))
    store = sk.KeyStore(MASTER, str(path))
    old = store.by_uid(document["keys"][1]["uid"])
    started = time.time_ns()
    store.rotate(old.uid, 2)
    retiring = store.by_uid(old.uid)
    assert started + 2 * 10 ** 9 <= retiring.retirement.at_ns <= time.time_ns() + 2 * 10 ** 9
    assert not retiring.is_expired() and retiring.is_expired(time.time_ns() + 3 * 10 ** 9)
    store.close()


@pytest.mark.parametrize("dangling", [False, True])
def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_left_alone(tmp_path,
                                                                            dangling):
    """S7: keys.json.lock was opened following links, then chmod'ed 0600: a planted link made
    its target 0600 (or created the file a dangling link names)."""
    path = tmp_path / "keys.json"
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir()
    if not dangling:
        target.write_text("someone else's\n")
        target.chmod(0o644)
    (tmp_path / "keys.json.lock").symlink_to(target)
    with pytest.raises(sk.StoreError) as info:
        sk.KeyStore(MASTER, str(path))
    assert "keys.json.lock" in str(info.value) and "symbolic link" in str(info.value)
    if dangling:
        assert not target.exists()
    else:
        assert stat.S_IMODE(target.stat().st_mode) == 0o644
        assert target.read_text() == "someone else's\n"
    assert not path.exists()


def test_the_lock_file_is_created_0600(tmp_path):
    old = os.umask(0o022)
    try:
        sk.KeyStore(MASTER, str(tmp_path / "keys.json")).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "keys.json.lock").stat().st_mode) == 0o600


def test_a_lock_file_planted_as_a_symlink_stops_serve_in_one_sentence(tmp_path):
    target = tmp_path / "victim"
    target.write_text("x")
    target.chmod(0o644)
    (tmp_path / "keys.json.lock").symlink_to(target)
    code, message = refused("--master-key", MASTER, "--store", str(tmp_path / "keys.json"))
    assert code == 1 and "keys.json.lock" in message and "symbolic link" in message, message
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_serve_on_a_busy_port_leaves_no_store_and_the_right_key_starts_next(tmp_path):
    """A serve that failed on a busy port had already made the store with the master key it
    was given, so the next start with the right master key was refused."""
    store = tmp_path / "keys.json"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, message = refused("--master-key", "a-mistyped-master-key-0123", "--store",
                                str(store), port=port)
        assert code == 1 and str(port) in message, message
    assert not store.exists() and not (tmp_path / "keys.json.lock").exists()
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as server:
        status, _, _ = server.request("GET", "/keys", headers={"Authorization": "Bearer " + MASTER})
        assert status == 200


def test_a_process_takes_in_another_processes_usage_saves_and_key_changes(tmp_path):
    """refresh() after a save of usage counts alone reads only that section (the keys'
    bytes are the same); any other change, even in the writer's own layout, loads the keys."""
    path = tmp_path / "keys.json"
    a, b = sk.KeyStore(MASTER, str(path)), sk.KeyStore(MASTER, str(path))
    key = a.create(dict(FIELDS, name="k"))
    b.refresh()
    assert b.by_uid(key.uid).name == "k"
    for _ in range(3):
        a.usage.count(key.uid, None, time.time_ns())
    a.flush_usage()
    b.refresh()
    assert b.usage.to_json(key.uid)["allowed"] == 3 and b.usage.unsaved(key.uid)["allowed"] == 0
    text = path.read_text()
    assert text.endswith("}}\n") and '\n],\n"usage": ' in text  # the writer's layout
    path.write_text(text.replace('"name":"k"', '"name":"renamed"', 1))  # keys changed, tail not
    b.refresh()
    assert b.by_uid(key.uid).name == "renamed" and b.usage.to_json(key.uid)["allowed"] == 3
    path.write_text(path.read_text().replace('"usage": {', '"usage": [', 1))  # not JSON now
    b.refresh()
    assert b.by_uid(key.uid).name == "renamed"  # the keys it had
    a.close()
    b.close()
