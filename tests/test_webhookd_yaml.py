"""YAML hooks files: the reader's edge cases (unit), loading through parse_hooks, and
differential tests against Debian's webhook 2.8.0 (the same files, the same requests).

Scalar expectations were checked against /usr/bin/webhook first (a hook that passes the scalar
as a `string` argument to printf shows the string webhook ends up with); the differential tests
at the bottom keep checking them.
"""
import hashlib
import hmac
import json
import math
import re
import signal
import subprocess
import sys
import time

import pytest

import support
import webhookd as w

def load(text):
    return w.load_yaml(text, lines=True)[0]  # the YAML reader itself, never the JSON path


def error_of(text):
    with pytest.raises(w.YamlError) as info:
        load(text)
    return info.value


# ----------------------------------------------------------------------------
# Scalars: YAML 1.1 resolution as go-yaml v2 does it
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("yes", True), ("Yes", True), ("YES", True), ("y", True), ("Y", True), ("on", True),
    ("On", True), ("true", True), ("True", True), ("no", False), ("N", False), ("off", False),
    ("OFF", False), ("false", False), ("yEs", "yEs"), ("ture", "ture"),
    ("~", None), ("null", None), ("Null", None), ("NULL", None), ("", None), ("nUll", "nUll"),
    ("0", 0), ("-0", 0), ("+12", 12), ("1_000", 1000), ("0777", 511), ("0o17", 15),
    ("0x1F", 31), ("0X1f", 31), ("-0x10", -16), ("0b101", 5), ("-0b11", -3),
    ("9223372036854775807", 2 ** 63 - 1), ("18446744073709551615", 2 ** 64 - 1),
    ("08", 8.0), ("1.5", 1.5), (".5", 0.5), ("-.5", -0.5), ("1e+3", 1000.0), ("1E-2", 0.01),
    ("1e3", "1e3"), ("1.0e3", "1.0e3"), ("99999999999999999999", 1e20),
    ("+18446744073709551615", 1.8446744073709552e19),
    (".inf", math.inf), ("-.Inf", -math.inf), ("+.INF", math.inf),
    ("1e+999", "1e+999"), ("0x", "0x"), ("-", "-"), ("1.2.3", "1.2.3"), ("_1", "_1"),
    ("2024-01-02", "2024-01-02"), ("12:30", "12:30"), ("<<x", "<<x"),
])
def test_plain_scalars_resolve_as_go_yaml_v2(text, value):
    got = w.resolve_plain(text)
    assert got == value and type(got) is type(value)


def test_nan_resolves_to_a_float_nan():
    assert math.isnan(w.resolve_plain(".nan")) and w.resolve_plain(".Nan") == ".Nan"


@pytest.mark.parametrize("value, text", [
    (1.5, "1.5"), (0.1, "0.1"), (1.10, "1.1"), (3.14159265358979, "3.1415927"),
    (1e10, "1e+10"), (123456.0, "123456"), (1234567.0, "1.234567e+06"), (0.0001, "0.0001"),
    (0.00001, "1e-05"), (16777217.0, "1.6777216e+07"), (1e20, "1e+20"), (-2.5, "-2.5"),
    (0.0, "0"), (-0.0, "-0"), (math.inf, "+Inf"), (-math.inf, "-Inf"), (math.nan, "NaN"),
    (1e300, "+Inf"), (100.0, "100"),
])
def test_floats_become_strings_in_go_float32_form(value, text):
    assert w.go_float32_text(value) == text


def test_quoted_and_block_scalars_are_never_resolved():
    assert load("a: 'yes'\nb: \"1\"\nc: |\n  on\nd: >-\n  12\n") == \
        {"a": "yes", "b": "1", "c": "on\n", "d": "12"}


def test_keys_become_strings_as_upstream_writes_them():
    assert load("1: a\ntrue: b\nyes: c\n1.5: d\n0x10: e\n") == \
        {"1": "a", "true": "c", "1.5": "d", "16": "e"}
    assert "unsupported map key null" in str(error_of("~: x\n"))


# ----------------------------------------------------------------------------
# Block structure
# ----------------------------------------------------------------------------

def test_nested_mappings_and_sequences_by_indentation():
    text = ("- id: a\n"
            "  trigger-rule:\n"
            "    and:\n"
            "      - match: {type: value, value: x}\n"
            "      -   match:\n"
            "            type: regex\n"
            "- - nested\n"
            "  - list\n"
            "-\n"
            "- id: b   # comment\n")
    assert load(text) == [
        {"id": "a", "trigger-rule": {"and": [{"match": {"type": "value", "value": "x"}},
                                             {"match": {"type": "regex"}}]}},
        ["nested", "list"], None, {"id": "b"}]


def test_sequences_not_indented_under_their_key():
    assert load("a:\n- 1\n- 2\nb:\n  - 3\nc:\n") == {"a": [1, 2], "b": [3], "c": None}


def test_multi_line_plain_scalars_fold():
    assert load("a: one\n  two\n\n  three\n   four # c\nb: x\n") == \
        {"a": "one two\nthree four", "b": "x"}
    assert load("- a\n  b\n- c\n") == ["a b", "c"]


def test_comments_blank_lines_and_a_byte_order_mark():
    assert load("\ufeff# top\n\n- a # one\n#x\n\n- 'b' #two\n") == ["a", "b"]
    assert load("a: b#c\nd: '#'\n") == {"a": "b#c", "d": "#"}


def test_document_markers_for_one_document():
    assert load("%YAML 1.1\n---\n- a\n...\n# done\n") == ["a"]
    assert load("--- |\n  text\n") == "text\n"
    assert load("--- [a, b]\n") == ["a", "b"]
    assert load("# nothing\n") is None
    assert load("- a\n---\n# empty\n") == ["a"]


def test_windows_line_ends():
    assert load("- a: |\r\n    x\r\n  b: 'y\r\n    z'\r\n") == [{"a": "x\n", "b": "y z"}]
    assert error_of("- a\r\n- b: c: d\r\n").line == 2


def test_lines_of_keys_and_items_are_kept():
    data = load("# c\n- id: a\n  x:\n    - 1\n\n    - 2\n- id: b\n")
    assert data.lines == [2, 7]
    assert data[0].lines == {"id": 2, "x": 3} and data[0]["x"].lines == [4, 6]


# ----------------------------------------------------------------------------
# Flow collections
# ----------------------------------------------------------------------------

def test_flow_collections_with_trailing_commas_comments_and_lines():
    text = ('[ {"id": "a", "n": [1, 2, ],}, # trailing commas\n'
            '  {id: b, tags: [x, "y z"], empty: {}, e2: []},\n'
            '  {"k":1, "m" : null},\n'
            ']\n')
    assert load(text) == [{"id": "a", "n": [1, 2]},
                          {"id": "b", "tags": ["x", "y z"], "empty": {}, "e2": []},
                          {"k": 1, "m": None}]


def test_flow_odd_entries():
    assert load("[a: b, c]") == [{"a": "b"}, "c"]
    assert load("{a, b: , c: d}") == {"a": None, "b": None, "c": "d"}
    assert load("[one\n  two, three]") == ["one two", "three"]


def test_flow_scalars_end_before_blanks_as_go_yaml():
    # checked against /usr/bin/webhook: `response-message: hi   ,` in a flow mapping is "hi"
    assert load("a: [b  , c\t]\nd: {e   : f  , g: y  }\n") == \
        {"a": ["b", "c"], "d": {"e": "f", "g": True}}


def test_json_is_read_like_json():
    doc = {"a": [1, -2, 3.5, True, False, None, "x\u00e9\n\"\\"], "b": {"c": {}}}
    assert load(json.dumps(doc)) == doc
    assert load(json.dumps(doc, indent="\t")) == doc


# ----------------------------------------------------------------------------
# Quoted scalars
# ----------------------------------------------------------------------------

def test_single_quotes():
    assert load("a: 'it''s # not a comment'\nb: ''\n") == {"a": "it's # not a comment", "b": ""}
    assert load("a: 'one\n  two\n\n  three '\n") == {"a": "one two\nthree "}


def test_double_quote_escapes():
    text = r'a: "\t|\n|\\|\"|\x41|\u00e9|\U0001F600|\0|\e|\ |\_"'
    assert load(text + "\n") == {"a": "\t|\n|\\|\"|A|\u00e9|\U0001F600|\0|\x1b| |\xa0"}


def test_double_quote_line_folding_and_escaped_breaks():
    assert load('a: "one\n  two\n\n  three\\\n  four\\ \n  five"\n') == \
        {"a": "one two\nthreefour  five"}


@pytest.mark.parametrize("text, message", [
    ('a: "\\/"\n', "found unknown escape character"),      # JSON's \/ is not YAML 1.1
    ('a: "\\q"\n', "found unknown escape character"),
    ('a: "\\ud83d\\ude00"\n', "found invalid Unicode character escape code"),
    ('a: "\\x4"\n', "did not find expected hexdecimal number"),
    ('a: "open\n', "found unexpected end of stream"),
])
def test_bad_double_quoted_scalars(text, message):
    assert message in str(error_of(text))


# ----------------------------------------------------------------------------
# Block scalars
# ----------------------------------------------------------------------------

def test_literal_block_scalars_with_chomping():
    text = ("clip: |\n  a\n   b\n\n  c\n\n\n"
            "strip: |-\n  a\n\n"
            "keep: |+\n  a\n\n\n"
            "empty: |\n"
            "last: |\n  end")
    assert load(text) == {"clip": "a\n b\n\nc\n", "strip": "a", "keep": "a\n\n\n",
                          "empty": "", "last": "end"}


def test_folded_block_scalars():
    text = ("f: >\n  one\n  two\n\n  three\n    indented\n  four\n"
            "g: >-  # comment\n  x\n  y\n")
    assert load(text) == {"f": "one two\nthree\n  indented\nfour\n", "g": "x y"}


def test_indentation_indicators():
    assert load("a: |2\n    kept\n  b\n") == {"a": "  kept\nb\n"}
    assert load("- |1-\n   x\n") == ["  x"]
    assert load("a: >+2\n   x\n\n") == {"a": " x\n\n"}
    assert "indentation indicator equal to 0" in str(error_of("a: |0\n  x\n"))


def test_block_scalar_ends_at_a_less_indented_line():
    assert load("a: |\n    x\n    y\nb: >\n z\n") == {"a": "x\ny\n", "b": "z\n"}


# ----------------------------------------------------------------------------
# Anchors, aliases, merge keys
# ----------------------------------------------------------------------------

def test_anchors_and_aliases_share_a_rule():
    text = ("- id: a\n"
            "  trigger-rule: &rule\n"
            "    match: {type: value, value: &v secret}\n"
            "- id: b\n"
            "  trigger-rule: *rule\n"
            "  response-message: *v\n"
            "- &item [1, 2]\n"
            "- *item\n")
    data = load(text)
    assert data[1]["trigger-rule"] == {"match": {"type": "value", "value": "secret"}}
    assert data[1]["response-message"] == "secret" and data[3] == [1, 2]
    assert "unknown anchor 'nope'" in str(error_of("a: *nope\n"))


def test_merge_keys_apply_in_order_as_go_yaml_v2():
    text = ("base: &base {a: 1, b: 2}\n"
            "more: &more {b: 3, c: 4}\n"
            "one:\n  a: 0\n  <<: *base\n  c: 9\n"
            "two:\n  <<: [*base, *more]\n")
    data = load(text)
    assert data["one"] == {"a": 1, "b": 2, "c": 9}
    assert data["two"] == {"a": 1, "b": 2, "c": 4}
    assert load("a: {'<<': x}\n") == {"a": {"<<": "x"}}


def alias_bomb(levels=9):
    """A "billion laughs" hooks file: each level an anchored list of nine aliases of the last
    (9**9 values from about 600 bytes)."""
    lines = ["- id: bomb", "  execute-command: /bin/true",
             "  x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels + 1):
        lines.append("  x%d: &a%d [%s]" % (level, level, ", ".join(["*a%d" % (level - 1)] * 9)))
    return "\n".join(lines) + "\n"


def test_aliases_that_expand_too_far_are_refused_at_their_line():
    exc = error_of(alias_bomb())
    assert "excessive aliasing" in exc.message and exc.line == 8, str(exc)
    assert load(alias_bomb(4))[0]["x4"][8][8][8][8][8] == "lol"  # 9**5 values: read as usual
    many = "- &r {match: {type: value, value: x}}\n" + "- *r\n" * 5000
    assert len(load(many)) == 5001


# ----------------------------------------------------------------------------
# Errors name the line and column of the mistake; unsupported YAML is refused
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, line, column, message", [
    ("a: !!str x\n", 1, 4, "tags are not supported"),
    ("- !custom x\n", 1, 3, "tags are not supported"),
    ("- a\n---\n- b\n", 2, 1, "several YAML documents"),
    ("? a\n: b\n", 1, 1, "complex mapping keys"),
    ("[a]: b\n", 1, 1, "complex mapping keys"),
    ("- {a: 1}: b\n", 1, 3, "complex mapping keys"),
    ("a: b: c\n", 1, 5, "mapping values are not allowed"),
    ("a: 1\n  b: 2\n", 2, 4, "mapping values are not allowed"),
    ("a:\n\t- b\n", 2, 2, "tab character"),
    ("{a:1}\n", 1, 3, "found unexpected ':'"),
    ("- [a, b\n- c\n", 1, 3, "did not find expected ',' or ']'"),
    ('[{"id": "a" "x": 1}]\n', 1, 13, "did not find expected ',' or '}'"),
    ("a:\n  - b\n c: d\n", 3, 2, "bad indentation"),
    ("- a\n b\n- c\n  d: e\n", 4, 4, "mapping values are not allowed"),
    ("%TAG ! tag:x,2000:\n---\na\n", 1, 1, "directives"),
    ("a: b\n- c\n", 2, 1, "did not find expected key"),
    ('a: "x" y\n', 1, 8, "did not find expected key"),
    ("a: [x,, y]\n", 1, 7, "did not find expected node content"),
    ("a: |x\n", 1, 4, "did not find expected comment or line break"),
    ("x: @y\n", 1, 4, "cannot start any token"),
    ("- a\n- b\nc\n", 3, 1, "did not find expected <document start>"),
])
def test_errors_point_at_the_mistake(text, line, column, message):
    exc = error_of(text)
    assert (exc.line, exc.column) == (line, column) and message in exc.message, str(exc)


# ----------------------------------------------------------------------------
# Loading hooks files (parse_hooks): JSON fast path, YAML, messages with lines
# ----------------------------------------------------------------------------

HOOKS_YAML = """\
# deploy hooks
- id: deploy
  execute-command: /bin/true
  http-methods: [post]
  trigger-rule:
    match: &secret
      type: value
      value: 12
      parameter: {source: header, name: X-Token}
  pass-arguments-to-command:
  - source: string
    name: on
- id: y
  execute-command: /bin/true
  trigger-rule: {match: *secret}
  success-http-response-code: 201.0
"""


def test_yaml_hooks_load_with_values_as_upstream_sees_them():
    hooks, problems = w.parse_hooks(HOOKS_YAML, "h.yaml")
    assert problems.items == []
    deploy, second = hooks
    assert deploy.allowed_methods == ("POST",)
    assert deploy.trigger_rule[1].value == "12" and deploy.pass_arguments[0].name == "true"
    assert second.id == "true"  # YAML 1.1: `y` is a boolean, written back as "true"
    assert second.trigger_rule[1].parameter.name == "X-Token"
    assert second.success_status == 201


def test_unknown_fields_and_bad_values_are_reported_with_their_line():
    text = HOOKS_YAML.replace("  http-methods:", "  execute-comand: x\n  http-methods:")
    text = text.replace("source: header", "source: headr")
    _, problems = w.parse_hooks(text, "h.yaml")
    messages = [m for _, m in problems.items]
    assert "h.yaml:4: hook 0 (\"deploy\"): unknown field 'execute-comand'" in messages[0]
    assert any(m.startswith("h.yaml:10: hook 0 (\"deploy\").trigger-rule.match.parameter: "
                            "unknown source 'headr'") for m in messages), messages
    bad = HOOKS_YAML.replace("201.0", "'201'")
    with pytest.raises(w.HooksFileError) as info:
        w.parse_hooks(bad, "h.yaml")
    assert str(info.value).startswith("h.yaml:16: hook 1.success-http-response-code: "
                                      "expected an integer, got string")
    with pytest.raises(w.HooksFileError, match="h.yaml:16: .*expected an integer"):
        w.parse_hooks(HOOKS_YAML.replace("201.0", "201.5"), "h.yaml")
    with pytest.raises(w.HooksFileError, match=r"h.yaml:11: .*\[0\]: expected an object, got array"):
        w.parse_hooks(HOOKS_YAML.replace("  - source: string\n", "  - [x]\n  - source: string\n"),
                      "h.yaml")


def test_json_problems_get_lines_too():
    text = '[\n  {"id": "a",\n   "execute-comand": "x"}\n]\n'
    _, problems = w.parse_hooks(text, "h.json")
    assert problems.items[0][1].startswith("h.json:3: hook 0 (\"a\"): unknown field")
    with pytest.raises(w.HooksFileError, match=r'^h.json:2: hook 0 \("a"\).http-methods: '):
        w.parse_hooks('[{"id": "a",\n "http-methods": "POST"}]', "h.json")


def test_json_keeps_upstream_scalars():
    hooks, _ = w.parse_hooks(
        '[{"id": "a", "execute-command": "/bin/true", "response-message": 1e5,'
        ' "trigger-rule": {"match": {"type": "value", "value": 1.10,'
        ' "parameter": {"source": "string", "name": 10}}}}]', "h.json")
    assert hooks[0].response_message == "1e5"  # go-yaml: no sign after e, not a float
    assert hooks[0].trigger_rule[1].value == "1.1"
    assert hooks[0].trigger_rule[1].parameter.name == "10"


def test_lenient_json_and_broken_files():
    hooks, _ = w.parse_hooks('[ # hooks\n {"id": "a",},\n]', "h.json")
    assert [h.id for h in hooks] == ["a"]
    with pytest.raises(w.HooksFileError, match=r"^h.json:1:16: found unknown escape character"):
        w.parse_hooks('[{"id": "a", "x\\/": 1}]', "h.json")
    with pytest.raises(w.HooksFileError, match=r"^h.yaml:3:14: mapping values are not allowed"):
        w.parse_hooks("- id: a\n  execute-command: /bin/true\n  response: a: b\n", "h.yaml")
    with pytest.raises(w.HooksFileError, match="h.yaml: expected an array"):
        w.parse_hooks("id: a\n", "h.yaml")


def test_values_upstream_cannot_write_as_json_are_refused():
    with pytest.raises(w.HooksFileError, match=r'h.yaml:3: hook 0 \("a"\).x: \+Inf is no JSON'):
        w.parse_hooks("- id: a\n  execute-command: /bin/true\n  x: [1, .inf]\n", "h.yaml")
    hooks, _ = w.parse_hooks("- id: a\n  response-message: .inf\n", "h.yaml")
    assert hooks[0].response_message == "+Inf"


# ----------------------------------------------------------------------------
# Through the daemon: reload, SIGHUP, several -hooks, -template, -validate
# ----------------------------------------------------------------------------

ECHO_SCRIPT = """\
import os, sys
args = sys.argv[1:]
if args:
    print("arg: " + " ".join(args))
env = sorted("%s=%s" % kv for kv in os.environ.items() if kv[0].startswith("HOOK_")
             or kv[0] == "PUSHER")
if env:
    print("env: " + " ".join(env))
code = [a[5:] for a in args if a.startswith("exit=")]
sys.exit(int(code[0]) if code else 0)
"""


def echo_command(folder):
    """An executable that prints its argv and hook environment (like upstream's hookecho)."""
    script = folder / "hookecho"
    script.write_text("#!%s\n%s" % (sys.executable, ECHO_SCRIPT))
    script.chmod(0o755)
    return str(script)


def webhookd(*args, port=None):
    port = port or support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, *map(str, args), "-ip", "127.0.0.1",
                              "-port", str(port))
    return support.Daemon(argv, port, timeout=20.0)


def wait_for(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def yaml_hook(hook_id, message):
    return ("- id: %s\n  execute-command: /bin/true\n  response-message: >-\n    %s\n"
            % (hook_id, message))


def test_yaml_files_reload_keep_old_hooks_when_broken_and_load_with_json(tmp_path):
    one, two = tmp_path / "one.yaml", tmp_path / "two.json"
    one.write_text(yaml_hook("first", "one\n    line"))
    two.write_text('[{"id": "second", "execute-command": "/bin/true",'
                   ' "response-message": "json", }, # lenient\n]')
    with webhookd("-hooks", one, "-hooks", two, "-hotreload", "-verbose") as d:
        assert d.request("GET", "/hooks/first")[::2] == (200, b"one line")
        assert d.request("GET", "/hooks/second")[::2] == (200, b"json")
        one.write_text(yaml_hook("third", "three"))
        assert wait_for(lambda: d.request("GET", "/hooks/third")[0] == 200)
        assert d.request("GET", "/hooks/first")[0] == 404
        one.write_text(yaml_hook("fourth", "four") + "  bad: [\n")
        assert wait_for(lambda: "one.yaml:5:8: did not find expected ',' or ']'" in d.log())
        assert d.request("GET", "/hooks/third")[::2] == (200, b"three")
        d.proc.send_signal(signal.SIGSTOP)  # edit unseen by the poller, then ask by SIGHUP
        try:
            one.write_text(yaml_hook("fifth", "five"))
        finally:
            d.proc.send_signal(signal.SIGCONT)
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: d.request("GET", "/hooks/fifth")[0] == 200)


def test_alias_bomb_fails_validate_and_a_reload_and_the_daemon_still_stops(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(alias_bomb())
    out = subprocess.run(support.python_cmd(support.WEBHOOKD, "-validate", "-hooks", hooks),
                         capture_output=True, text=True, timeout=30)  # it hung before
    assert out.returncode == 1 and "%s:8:" % hooks in out.stdout, out.stdout
    assert "excessive aliasing" in out.stdout
    hooks.write_text(yaml_hook("kept", "kept"))
    with webhookd("-hooks", hooks, "-hotreload", "-verbose") as d:
        hooks.write_text(alias_bomb())
        assert wait_for(lambda: "excessive aliasing" in d.log()), d.log()[-2000:]
        assert d.request("GET", "/hooks/kept")[::2] == (200, b"kept")
        d.signal(signal.SIGTERM)
        assert d.proc.wait(timeout=10) == 0


def test_a_reload_that_drops_a_trigger_rule_is_warned(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    guarded = ("- id: deploy\n  execute-command: /bin/true\n  trigger-rule:\n    match:\n"
               "      {type: value, value: s3cret, parameter: {source: url, name: token}}\n")
    hooks.write_text(guarded)
    with webhookd("-hooks", hooks, "-hotreload", "-verbose") as d:
        hooks.write_text(yaml_hook("deploy", "open"))
        assert wait_for(lambda: d.request("GET", "/hooks/deploy")[2] == b"open")
        assert "hook deploy in %s lost its trigger-rule" % hooks in d.log()
        hooks.write_text(yaml_hook("deploy", "still open"))  # no rule before: no warning
        assert wait_for(lambda: d.request("GET", "/hooks/deploy")[2] == b"still open")
        assert d.log().count("lost its trigger-rule") == 1


def test_a_file_being_written_is_reloaded_once_it_stays_the_same(tmp_path):
    """Half a YAML file is often valid YAML (a hook without its trigger-rule): the poller
    loads a change only when two polls in a row saw the file the same."""
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(yaml_hook("a", "one"))
    registry = w.Registry([str(hooks)], False)
    assert registry.load(startup=True) and registry.poll() == []
    with open(hooks, "a") as out:
        for index in range(3):
            out.write(yaml_hook("b%d" % index, "more"))
            out.flush()
            assert registry.poll() == []  # changed since the last poll: still being written
    assert registry.poll() == registry.files
    assert registry.load(registry.files) and registry.hook("b2") is not None
    assert registry.poll() == []


def test_template_is_expanded_before_the_yaml_is_read(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text("- id: t\n  execute-command: /bin/true\n"
                     "  response-message: \"{{ getenv \"GREETING\" | js }}\"\n"
                     "  trigger-rule:\n    match:\n      type: value\n"
                     "      value: {{ getenv \"TOKEN\" }}\n"
                     "      parameter: {source: url, name: token}\n")
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, "-template", "-hooks", hooks, "-ip",
                              "127.0.0.1", "-port", str(port))
    with support.Daemon(argv, port, env={"GREETING": 'say "hi"', "TOKEN": "0x1F"}) as d:
        assert d.request("GET", "/hooks/t?token=31")[::2] == (200, b'say "hi"')
        assert d.request("GET", "/hooks/t?token=0x1F")[::2] == \
            (200, b"Hook rules were not satisfied.")


def test_validate_names_lines_in_yaml_files(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text("- id: a\n  execute-command: /bin/true\n\n  trigger-rule:\n"
                     "    match: {type: value, value: x, parameter: {source: url, nme: t}}\n"
                     "  include-command-output: true\n")
    out = subprocess.run(support.python_cmd(support.WEBHOOKD, "-validate", "-hooks", hooks),
                         capture_output=True, text=True, timeout=30)
    assert "%s:5: hook 0 (\"a\").trigger-rule.match.parameter: unknown field 'nme'" % hooks \
        in out.stdout
    assert "%s:6: hook 0 (\"a\"): unknown field 'include-command-output' (did you mean " \
        "'include-command-output-in-response'?)" % hooks in out.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text("- id: a\n  execute-command: /bin/true\n  http-methods: [POST\n")
    out = subprocess.run(support.python_cmd(support.WEBHOOKD, "-validate", "-hooks", broken),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "error: %s:3:17: did not find expected ',' or ']'" % broken in out.stdout


# ----------------------------------------------------------------------------
# Differential: the same files and requests on Debian's webhook and webhookd.py
# ----------------------------------------------------------------------------


UPSTREAM = support.ROOT.parent / "shared" / "senders-fixtures" / "adnanh-webhook"
needs_webhook = pytest.mark.skipif(support.WEBHOOK_BIN is None, reason="needs Debian's webhook: apt-get install webhook")
needs_upstream = pytest.mark.skipif(not UPSTREAM.is_dir(), reason="needs ../shared/senders-fixtures/adnanh-webhook (the steering repository's shared folder beside this clone)")


def start_both(hooks_path):
    """Debian's webhook and webhookd.py, each serving `hooks_path`."""
    daemons = []
    for prefix in ([support.WEBHOOK_BIN], support.python_cmd(support.WEBHOOKD)):
        port = support.free_port()
        argv = prefix + ["-hooks", str(hooks_path), "-verbose", "-ip", "127.0.0.1",
                         "-port", str(port)]
        daemons.append(support.Daemon(argv, port, timeout=20.0))
    return daemons


def answers(daemon, requests):
    """(status, selected headers, body) of each request; a peer's port is not compared."""
    out = []
    for method, path, headers, body in requests:
        status, got_headers, data = daemon.request(method, path, body, headers)
        data = re.sub(rb"127\.0\.0\.1:\d+", b"127.0.0.1:PORT", data)
        out.append((path, status, got_headers.get("x-info"), data))
    return out


def same_answers(hooks_path, requests):
    go, py = start_both(hooks_path)
    with go, py:
        expected, got = answers(go, requests), answers(py, requests)
        for want, have in zip(expected, got):
            assert have == want, "webhookd differs from webhook (logs:\n%s\n%s)" % (
                go.log()[-2000:], py.log()[-2000:])
    return got


def signed(body, secret="mysecret"):
    return "sha1=" + hmac.new(secret.encode(), body, hashlib.sha1).hexdigest()


def upstream_requests():
    """Requests in the spirit of upstream's webhook_test.go, one or more per hook."""
    def body(name):
        return (UPSTREAM / name).read_bytes()
    github, gitlab = body("github-push.json"), body("gitlab-push.json")
    as_json = {"Content-Type": "application/json"}
    github_headers = dict(as_json, **{"X-Hub-Signature": signed(github)})
    requests = [
        ("POST", "/hooks/github", github_headers, github),
        ("POST", "/hooks/github", dict(as_json, **{"X-Hub-Signature": signed(github, "x")}),
         github),
        ("GET", "/hooks/github", github_headers, github),
        ("POST", "/hooks/github", as_json, b"{}"),
        ("POST", "/hooks/github-multi-sig", github_headers, github),
        ("POST", "/hooks/github-multi-sig-fail", github_headers, github),
        ("POST", "/hooks/bitbucket", {"Content-Type": "application/x-www-form-urlencoded"},
         body("bitbucket-form.txt")),
        ("POST", "/hooks/bitbucket", as_json, b"{}"),
        ("POST", "/hooks/gitlab", dict(as_json, **{"X-Gitlab-Event": "Push Hook"}), gitlab),
        ("POST", "/hooks/gitlab", as_json, b"{}"),
        ("POST", "/hooks/xml", {"Content-Type": "application/xml"}, body("app.xml")),
        ("POST", "/hooks/txt-raw", {"Content-Type": "text/plain"}, body("txt-raw.txt")),
        ("POST", "/hooks/sendgrid", as_json, body("sendgrid-processed.json")),
        ("POST", "/hooks/sendgrid/dir", as_json, body("sendgrid-it-worked.json")),
        ("POST", "/hooks/plex", {"Content-Type": "multipart/form-data; boundary=xxx"},
         body("plex-multipart.txt")),
        ("POST", "/hooks/issue-471", as_json, body("issue-471.json")),
        ("POST", "/hooks/issue-471-and", as_json, body("issue-471.json")),
        ("POST", "/hooks/empty-payload-signature", {"X-Hub-Signature": signed(b"")}, b""),
        ("POST", "/hooks/request-source", as_json, b"{}"),
        ("POST", "/hooks/nope", as_json, b"{}"),
    ]
    for hook_id in ("capture-command-output-on-success-not-by-default",
                    "capture-command-output-on-success-yes-with-flag",
                    "capture-command-output-on-error-not-by-default",
                    "capture-command-output-on-error-yes-with-extra-flag",
                    "static-params-ok", "warn-on-space"):
        requests.append(("POST", "/hooks/" + hook_id, as_json, b"{}"))
    return requests


@needs_webhook
@needs_upstream
@pytest.mark.parametrize("name", ["hooks.yaml.tmpl", "hooks.json.tmpl"])
def test_upstream_hooks_files_serve_the_same_answers(name, tmp_path):
    text = (UPSTREAM / name).read_text().replace("{{ .Hookecho }}", echo_command(tmp_path))
    hooks = tmp_path / name.replace(".tmpl", "")
    hooks.write_text(text)
    got = same_answers(hooks, upstream_requests())
    statuses = {path: status for path, status, _, _ in got}
    assert statuses["/hooks/nope"] == 404 and statuses["/hooks/warn-on-space"] == 500
    first = got[0]
    assert first[1] == 200 and first[3].startswith(b"arg: 1481a2de7b2a7d02428ad93446ab166be7793fbb")


DOCS_STYLE_YAML = """\
# Hooks the way the documentation writes them, plus YAML 1.1 corners.
- id: redeploy
  execute-command: {echo}
  command-working-directory: /
  include-command-output-in-response: true
  response-headers:
  - name: X-Info
    value: 3.10
  pass-arguments-to-command:
  - source: payload
    name: head_commit.id
  - {{source: string, name: yes}}
  - {{source: string, name: Off}}
  - {{source: string, name: 0777}}
  - {{source: string, name: 0x1F}}
  - {{source: string, name: 1_000}}
  - {{source: string, name: 1e3}}
  - {{source: string, name: 1e+3}}
  - {{source: string, name: 123456789.0}}
  - {{source: string, name: .5}}
  - {{source: string, name: ~}}
  - {{source: string, name: 18446744073709551615}}
  - {{source: string, name: "tab\\there \\u00e9"}}
  - {{source: string, name: 'it''s'}}
  pass-environment-to-command:
  - source: payload
    name: pusher.name
    envname: PUSHER
  trigger-rule: &token
    and:
    - match:
        type: value
        value: 42
        parameter:
          source: url
          name: token
    - not:
        match: {{type: regex, regex: '^refs/tags/', parameter: {{source: payload, name: ref}}}}

- id: notes
  execute-command: {echo}
  include-command-output-in-response: true
  pass-arguments-to-command:
  - source: string
    name: |
      literal
        block
  - source: string
    name: >-
      folded
      text

      kept
  - source: string
    name: plain
      continued
  trigger-rule: *token
- id: off
  execute-command: {echo}
  response-message: the id is false
  http-methods:
  - post
---
"""

LENIENT_JSON = """\
[
  # comments and trailing commas, as upstream's docs allow
  {{
    "id": "lenient",
    "execute-command": "{echo}",
    "include-command-output-in-response": true,
    "pass-arguments-to-command": [
      {{"source": "string", "name": 1.10}},
      {{"source": "string", "name": 1e5}},
      {{"source": "string", "name": 100.0}},
      {{"source": "payload", "name": "list.1"}},
    ],
    "trigger-rule": {{"match": {{"type": "value", "value": 7,
                     "parameter": {{"source": "payload", "name": "n"}}}}}},
  }},
]
"""


@needs_webhook
def test_docs_style_yaml_serves_the_same_answers(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(DOCS_STYLE_YAML.format(echo=echo_command(tmp_path)))
    push = json.dumps({"head_commit": {"id": "abc"}, "pusher": {"name": "ann"},
                       "ref": "refs/heads/main"})
    tag = push.replace("refs/heads/main", "refs/tags/v1")
    as_json = {"Content-Type": "application/json"}
    got = same_answers(hooks, [
        ("POST", "/hooks/redeploy?token=42", as_json, push),
        ("POST", "/hooks/redeploy?token=41", as_json, push),
        ("POST", "/hooks/redeploy?token=42", as_json, tag),
        ("POST", "/hooks/notes?token=42", as_json, push),
        ("POST", "/hooks/false", {}, ""),
        ("GET", "/hooks/false", {}, ""),
        ("POST", "/hooks/off", {}, ""),
    ])
    assert got[0][1:3] == (200, "3.1") and b"abc true false 511 31 1000 1e3 1000" in got[0][3]
    assert got[4][1:] == (200, None, b"the id is false")


@needs_webhook
def test_lenient_json_serves_the_same_answers(tmp_path):
    hooks = tmp_path / "hooks.json"
    hooks.write_text(LENIENT_JSON.format(echo=echo_command(tmp_path)))
    as_json = {"Content-Type": "application/json"}
    got = same_answers(hooks, [
        ("POST", "/hooks/lenient", as_json, '{"n": 7, "list": [1, 2.50]}'),
        ("POST", "/hooks/lenient", as_json, '{"n": 8}'),
    ])
    assert got[0][1:] == (200, None, b"arg: 1.1 1e5 100 2.50\n")


SCALAR_STYLES_YAML = """\
- id: p
  execute-command: /usr/bin/printf
  include-command-output-in-response: true
  pass-arguments-to-command:
  - {source: string, name: '[%s]'}
  - source: string
    name: |
      lit
        more

  - source: string
    name: >
      fold
      ed

      para
        indented
      back
  - source: string
    name: |+
      keep


  - source: string
    name: |-
      strip
  - source: string
    name: |2
        two
      one
  - source: string
    name: "dq \\
      joined  \\t
      next\\
      \\ lead

      x"
  - source: string
    name: 'sq
      fold

      end '
  - source: string
    name: plain
      multi

      line
  - {source: string, name: "flowok"}
  - <<: {source: string, name: merged}
  - source: env
    <<: {source: string, name: override}
  - &anc {source: string, name: anchored}
  - *anc
  - source: string
    name: >2-
        deep
      shallow
- id: after
  execute-command: /bin/true
"""


@needs_webhook
def test_scalar_styles_merges_and_anchors_give_the_same_strings(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(SCALAR_STYLES_YAML)
    got = same_answers(hooks, [("GET", "/hooks/p", {}, ""), ("GET", "/hooks/after", {}, "")])
    assert got[0][1] == 200 and got[0][3].startswith(b"[lit\n  more\n][fold ed\npara\n")
