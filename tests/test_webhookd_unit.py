"""Unit tests of webhookd.py's pure parts: flags, hooks-file loading and validation, parameter
sources, payload parsing (JSON, form, multipart, XML), rules, and the small HTTP helpers."""
import hashlib
import hmac
import json
import os
import threading
import time

import pytest

import webhookd as w


# ---------------------------------------------------------------------------------------------
# Go-style flags
# ---------------------------------------------------------------------------------------------

def test_flag_forms_and_defaults():
    opts = w.parse_flags([])
    assert (opts.ip, opts.port, opts.urlprefix, opts.hooks) == ("0.0.0.0", 9000, "hooks",
                                                                  ["hooks.json"])
    assert opts.max_body_bytes == 25 * 1024 * 1024 and opts.read_header_timeout == 10
    assert opts.shutdown_timeout == 60 and opts.status_path == ""
    opts = w.parse_flags(["--port=8000", "-hooks", "a.json", "--hooks", "b.json", "-verbose",
                          "-nopanic=false", "-header", "X-A=b=c", "-max-workers", "0x10"])
    assert opts.port == 8000 and opts.hooks == ["a.json", "b.json"]
    assert opts.verbose and not opts.nopanic and opts.header == [("X-A", "b=c")]
    assert opts.max_workers == 16


def test_flags_stop_at_the_first_non_flag_argument():
    opts = w.parse_flags(["-verbose", "false", "-port", "1234"])
    assert opts.verbose and opts.port == 9000
    assert w.parse_flags(["--", "-bogus"]).port == 9000


@pytest.mark.parametrize("argv,message", [
    (["-bogus"], "flag provided but not defined: -bogus"),
    (["-port", "abc"], 'invalid value "abc" for flag -port: parse error'),
    (["-port"], "flag needs an argument: -port"),
    (["-verbose=maybe"], 'invalid boolean value "maybe" for -verbose'),
    (["-header", "novalue"], "header flag must be in name=value format"),
    (["---x"], "bad flag syntax: ---x"),
    (["-port", "08"], "parse error"),
])
def test_bad_flags_are_usage_errors(argv, message):
    with pytest.raises(w.UsageError) as info:
        w.parse_flags(argv)
    assert message in str(info.value)


@pytest.mark.parametrize("flag", ["-h", "-help", "--help"])
def test_help_flags(flag):
    with pytest.raises(w.HelpRequested):
        w.parse_flags([flag])


def test_usage_text_lists_flags_like_go():
    text = w.usage_text("webhook")
    assert text.startswith("Usage of webhook:\n  -cert string\n    \tpath to the HTTPS")
    assert '  -ip string\n    \tip the webhook should serve hooks on (default "0.0.0.0")' in text
    assert "  -port int\n    \tport the webhook should serve hooks on (default 9000)" in text
    assert "  -verbose\n    \tshow verbose output\n" in text
    names = [line.split()[0] for line in text.splitlines()[1:] if line.startswith("  -")]
    assert names == sorted(names)


def test_main_version_and_exit_codes(capsys):
    assert w.main(["webhookd.py", "-version"]) == 0
    assert capsys.readouterr().out == "webhookd version %s (webhook 2.8.0 compatible)\n" % w.__version__
    assert w.main(["webhookd.py", "-nosuch"]) == 2
    assert "flag provided but not defined" in capsys.readouterr().err
    assert w.main(["webhookd.py", "-setuid", "1"]) == 1


# ---------------------------------------------------------------------------------------------
# Hooks files: parsing, typos, validation, templates
# ---------------------------------------------------------------------------------------------

def load(hooks):
    return w.parse_hooks(json.dumps(hooks), "h.json")


def test_hook_fields_are_parsed_case_insensitively_and_scalars_become_strings():
    hooks, problems = load([{"ID": "a", "Execute-Command": "/bin/true",
                             "http-methods": [" post "], "max-concurrency": 2,
                             "command-timeout": 1.5, "trigger-rule": {"match": {
                                 "type": "value", "value": 1,
                                 "parameter": {"source": "url", "name": "n"}}}}])
    hook = hooks[0]
    assert hook.id == "a" and hook.execute_command == "/bin/true"
    assert hook.allowed_methods == ("POST",) and hook.max_concurrency == 2
    assert hook.command_timeout == 1.5 and hook.trigger_rule[1].value == "1"
    assert problems.items == []


@pytest.mark.parametrize("hook,message", [
    ({"id": "a", "pass-arguments-to-command": "x"}, "expected an array"),
    ({"id": "a", "include-command-output-in-response": "true"}, "expected a boolean"),
    ({"id": "a", "success-http-response-code": "201"}, "expected an integer"),
    ({"id": "a", "max-concurrency": 0}, "at least 1"),
    ({"id": "a", "command-timeout": -1}, "above 0"),
    ({"id": "a", "trigger-rule": []}, "expected an object"),
])
def test_wrong_types_are_load_errors(hook, message):
    with pytest.raises(w.HooksFileError) as info:
        load([hook])
    assert message in str(info.value) and "h.json" in str(info.value)


def test_json_errors_carry_line_and_column():
    with pytest.raises(w.HooksFileError) as info:
        w.parse_hooks('[\n {"id": "a",\n  "x" 1}\n]', "f.json")
    assert str(info.value).startswith("f.json:3:7: did not find expected ',' or '}'")
    with pytest.raises(w.HooksFileError, match="empty"):
        w.parse_hooks("  \n", "f.json")
    with pytest.raises(w.HooksFileError, match="expected an array"):
        w.parse_hooks('{"id": "a"}', "f.json")


def test_unknown_fields_and_bad_rules_are_problems_with_suggestions():
    _, problems = load([{"id": "a", "execute-comand": "/bin/true", "trigger-rule": {"match": {
        "type": "regex", "regex": "(", "parameter": {"source": "urll", "name": "x"}}}},
        {"id": "a", "execute-command": "/bin/true"}])
    text = "\n".join(message for _, message in problems.items)
    assert "unknown field 'execute-comand' (did you mean 'execute-command'?)" in text
    assert "unknown source 'urll' (did you mean 'url'?)" in text
    assert "error parsing regexp" in text and "duplicate id 'a'" in text


def test_validate_files_checks_commands_directories_and_duplicates(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps([{"id": "a", "execute-command": "true"}]))
    two.write_text(json.dumps([
        {"id": "a", "execute-command": "/bin/true"},
        {"id": "b", "execute-command": "run.sh", "command-working-directory": str(tmp_path)},
        {"id": "c", "execute-command": "/bin/true", "command-working-directory": "/nonexistent"},
        {"id": "d", "execute-command": "/bin/true", "trigger-rule": {"match": {
            "type": "ip-whitelist", "ip-range": "1.2.3.4 300.0.0.1/8"}}},
        {"id": "e", "execute-command": "/bin/true", "trigger-rule": {"match": {
            "type": "payload-hmac-sha256", "secret": "",
            "parameter": {"source": "header", "name": "X-Sig"}}}},
    ]))
    found = w.validate_files([str(one), str(two), str(tmp_path / "missing.json")])
    errors = "\n".join(message for severity, message in found if severity == "error")
    assert "duplicate id, already defined in" in errors
    assert "run.sh" in errors and "/nonexistent" in errors
    assert "invalid ip range '300.0.0.1/8'" in errors and "empty secret" in errors
    assert "missing.json: no such file or directory" in errors  # Go's words: open X: ...
    assert w.validate_files([str(one)]) == []


def test_template_expansion():
    env = {"A": 'x"y<z\n', "CREDENTIALS_DIRECTORY": "/nonexistent"}
    assert w.expand_template('{{ getenv "A" }}|{{getenv "A" | js}}', "t", env) == \
        'x"y<z\n|x\\"y\\u003Cz\\u000A'
    assert w.expand_template("a  {{- getenv `NOPE` -}}  b", "t", env) == "ab"
    assert w.js_escape("it's") == "it\\u0027s"
    for bad, message in [('{{ .Env }}', "unsupported template action"),
                         ('x\n {{ getenv "A"', "t:2:2: unclosed template action")]:
        with pytest.raises(w.HooksFileError, match=message):
            w.expand_template(bad, "t", env)


def test_template_cat_and_credential_as_upstream_master(tmp_path, caplog):
    """cat: one trailing newline trimmed, "" when unreadable; credential: the file in
    $CREDENTIALS_DIRECTORY (no fallback once it is set), else the environment variable."""
    (tmp_path / "two").write_bytes(b"line\n\n")
    (tmp_path / "token").write_bytes(b"s3cret\n")
    (tmp_path / "folder").mkdir()
    creds = {"CREDENTIALS_DIRECTORY": str(tmp_path), "token": "from-env", "other": "env"}
    expand = w.expand_template
    assert expand('{{ cat "%s/two" }}|' % tmp_path, "t", {}) == "line\n|"
    assert expand('[{{ cat "%s/missing" }}]' % tmp_path, "t", {}) == "[]"
    assert expand('[{{ cat "%s/folder" }}]' % tmp_path, "t", {}) == "[]"
    assert "folder" in caplog.text  # a folder is not "missing": it is logged
    assert expand('{{ credential "token" }}|{{ credential "other" }}|', "t", creds) == "s3cret||"
    assert expand('{{ credential "token" }}', "t", {"token": "from-env"}) == "from-env"
    assert expand('[{{ credential "token" }}]', "t", {}) == "[]"
    for name in ("../two", "a/b", "..", ""):  # never a path out of the folder
        with pytest.raises(w.HooksFileError, match="not a plain credential name"):
            expand('{{ credential "%s" }}' % name, "t", creds)


def test_look_path(tmp_path):
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    assert w.look_path("true", "") in ("/bin/true", "/usr/bin/true")
    with pytest.raises(OSError):
        w.look_path("tool", str(tmp_path))  # not executable
    tool.chmod(0o755)
    assert w.look_path("tool", str(tmp_path)) == str(tool)
    assert w.look_path("tool", "", str(tmp_path)) == str(tool)
    with pytest.raises(OSError):
        w.look_path("echo", str(tmp_path))  # a working dir makes a bare name relative to it
    with pytest.raises(OSError):
        w.look_path(str(tmp_path), "")  # a directory


# ---------------------------------------------------------------------------------------------
# Parameter sources and rendering
# ---------------------------------------------------------------------------------------------

def request(payload=None, headers=None, query=None, body=b"", method="POST",
            remote="127.0.0.1:5555"):
    req = w.HookRequest("id", method, remote, headers or {}, query or {}, body, "")
    req.payload = payload
    return req


def test_get_parameter_dot_paths_and_literal_keys():
    payload = {"a": {"b": [{"c": "deep"}]}, "x.y": "literal", "x": {"y": "nested"}}
    assert w.get_parameter("a.b.0.c", payload) == ("deep", None)
    assert w.get_parameter("x.y", payload)[0] == "literal"
    assert isinstance(w.get_parameter("a.b.1.c", payload)[1], w.ParameterNodeError)
    assert isinstance(w.get_parameter("a.b.x", payload)[1], w.ParameterNodeError)
    assert isinstance(w.get_parameter("n.q", {"n": None})[1], w.RuleError)  # Go: no parameters


def test_sources():
    payload = w.parse_json_payload(b'{"n": 1.50, "big": 12345678901234567890, "t": true, '
                                   b'"o": {"z": "<&>", "a": null}, "nil": null}')
    req = request(payload, {"X-Token": "tok", "Content-Length": "3"}, {"q": "a b"}, b"raw")
    get = lambda source, name="": w.get_argument(w.Argument(source, name), req)  # noqa: E731
    assert get("header", "x-token") == ("tok", None)
    assert get("url", "q") == get("query", "q") == ("a b", None)
    assert get("payload", "n") == ("1.50", None)
    assert get("payload", "big") == ("12345678901234567890", None)
    assert get("payload", "t") == ("true", None) and get("payload", "nil") == ("<nil>", None)
    assert get("payload", "o") == ('{"a":null,"z":"\\u003c\\u0026\\u003e"}', None)
    assert get("string", "lit") == ("lit", None) and get("raw-request-body") == ("raw", None)
    assert get("request", "METHOD") == ("POST", None)
    assert get("request", "remote-addr") == ("127.0.0.1:5555", None)
    assert isinstance(get("request", "other")[1], w.RuleError)
    assert isinstance(get("bogus", "x")[1], w.RuleError)
    assert json.loads(get("entire-payload")[0])["n"] == 1.5
    assert get("entire-headers")[0] == '{"Content-Length":"3","X-Token":"tok"}'
    assert get("entire-query")[0] == '{"q":"a b"}'
    assert w.get_argument(w.Argument("entire-payload", ""), request())[0] == "null"
    assert isinstance(w.get_argument(w.Argument("payload", "x"), request())[1],
                      w.ParameterNodeError)


def test_canonical_header_and_query_parsing():
    assert w.canonical_header("x-hub-SIGNATURE-256") == "X-Hub-Signature-256"
    assert w.canonical_header("bad header") == "bad header"
    assert w.parse_query("a=1&a=2&b=%41+c&&d") == ({"a": "1", "b": "A c", "d": ""}, True)
    assert w.parse_query("a=1;b=2&c=%zz&x=3") == ({"x": "3"}, False)
    assert w.go_unescape("a+b%2F", False) == "a+b/" and w.go_unescape("%g0", True) is None


def test_apply_json_parameters_decodes_in_place():
    hooks, _ = load([{"id": "a", "parse-parameters-as-json": [
        {"source": "payload", "name": "payload"}, {"source": "header", "name": "x-data"},
        {"source": "payload", "name": "missing"}]}])
    req = request({"payload": '{"repo": {"name": "r"}}'}, {"X-Data": '{"k": 2}'})
    messages = w.apply_json_parameters(hooks[0], req)
    assert req.payload["payload"]["repo"]["name"] == "r" and req.headers["X-Data"] == {"k": 2}
    assert len(messages) == 1 and "missing" in messages[0]


# ---------------------------------------------------------------------------------------------
# Payload parsing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,expected", [
    (b'{"x": 1} trailing', {"x": 1}),
    (b'  [1, {"a": 2}]', {"root": [1, {"a": 2}]}),
    # kept as written where a Python number would read back otherwise (Go's json.Number)
    (b'[-0, 1.50, 1e3, 123456789012345678901]', {"root": ["-0", "1.50", "1e3",
                                                          "123456789012345678901"]}),
    (b"null", None),
])
def test_json_payload(body, expected):
    assert w.parse_json_payload(body) == expected


@pytest.mark.parametrize("body", [b"", b'"s"', b"42", b"{bad", b'{"x": NaN}', b"[" * 100000])
def test_json_payload_errors(body):
    with pytest.raises(w.PayloadError):
        w.parse_json_payload(body)


def test_form_payload():
    assert w.parse_form_payload(b"a=1&b=x+y&a=2") == {"a": "1", "b": "x y"}
    with pytest.raises(w.PayloadError):
        w.parse_form_payload(b"a=%zz")


def multipart_body(parts, boundary="BOUND"):
    chunks = []
    for name, filename, ctype, data in parts:
        disposition = 'form-data; name="%s"' % name
        if filename is not None:
            disposition += '; filename="%s"' % filename
        head = "Content-Disposition: %s\r\n" % disposition
        if ctype:
            head += "Content-Type: %s\r\n" % ctype
        chunks.append(b"--" + boundary.encode() + b"\r\n" + head.encode() + b"\r\n" + data)
    return b"\r\n".join(chunks) + b"\r\n--" + boundary.encode() + b"--\r\n"


def test_multipart_payload():
    ctype = "multipart/form-data; boundary=BOUND"
    body = multipart_body([("f", None, None, b"one"), ("f", None, None, b"two"),
                           ("j", "a.json", "application/json", b'{"k": 1.0}'),
                           ("p", "p.bin", None, b'{"k": 2}'),
                           ("bin", "b.bin", "application/octet-stream", b"\x00")])
    assert w.parse_multipart(body, ctype, {"p"}) == {"f": "one", "j": {"k": "1.0"},
                                                     "p": {"k": 2}}
    bad_json = multipart_body([("j", "a.json", "application/json", b"[1]")])
    value = w.parse_multipart(bad_json, ctype, set())["j"]
    assert isinstance(value, w.NilMap) and w.go_format(value) == "null"
    assert w.parse_multipart(b"--BOUND--\r\n", ctype, set()) is None
    lf = b'--BOUND\nContent-Disposition: form-data; name="x"\n\nlf\n--BOUND--\n'
    assert w.parse_multipart(lf, ctype, set()) == {"x": "lf"}
    for broken, ctype_used in [(b"", ctype), (b"--BOUND\r\nno end", ctype),
                               (body, "multipart/form-data")]:
        with pytest.raises(w.MultipartError):
            w.parse_multipart(broken, ctype_used, set())


def test_xml_payload():
    assert w.parse_xml_payload(b'<r a="1"><x>1</x><x>2</x><y>t<z/>u</y></r>') == \
        {"r": {"-a": "1", "x": ["1", "2"], "y": "t"}}  # text first: children dropped
    assert w.parse_xml_payload(b"<r>\n  text\n  <a>1</a>\n</r>") == {"r": "text"}  # mxj
    assert w.parse_xml_payload(b'<!DOCTYPE r SYSTEM "file:///etc/hostname"><r>a</r>') == \
        {"r": "a"}
    for bad in (b"<r>", b"<!DOCTYPE r [<!ENTITY e 'x'>]><r>&e;</r>", b"<r>&undefined;</r>",
                b'<?xml version="1.0" encoding="ISO-8859-1"?><r/>', b"<a>" * 2000):
        with pytest.raises(w.PayloadError):
            w.parse_xml_payload(bad)


def test_parse_payload_dispatch_on_content_type():
    hook = load([{"id": "a"}])[0][0]
    for ctype, body, expected in [("application/json", b'{"a": "1"}', {"a": "1"}),
                                  ("text/vnd.json", b'{"a": "1"}', {"a": "1"}),
                                  ("application/x-www-form-urlencoded", b"a=1", {"a": "1"}),
                                  ("text/xml", b"<a>1</a>", {"a": "1"}),
                                  ("APPLICATION/JSON", b'{"a": "1"}', None),
                                  ("", b'{"a": "1"}', None)]:
        req = request(body=body)
        req.content_type = ctype
        w.parse_payload(req, hook, ctype)
        assert req.payload == expected, ctype


def test_go_json_rendering():
    value = {"b": [w.GoNumber("1.50"), True, None], "a": "\u2028<x>&\x01\"\\"}
    assert w.go_json(value) == \
        '{"a":"\\u2028\\u003cx\\u003e\\u0026\\u0001\\"\\\\","b":[1.50,true,null]}'


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------

def rule(obj):
    return w.parse_rule(obj, "rule", w.Problems("t"))


def value(name, expected):
    return {"match": {"type": "value", "value": expected,
                      "parameter": {"source": "url", "name": name}}}


@pytest.mark.parametrize("tree,fires", [
    (value("a", "2"), True),
    ({"not": value("c", "x")}, True),                        # missing under not: fires
    ({"and": [value("a", "2"), {"not": value("c", "x")}]}, False),
    ({"or": [value("a", "1"), {"not": value("c", "x")}]}, True),
    ({"not": {"not": value("c", "x")}}, False),
    ({"not": {"and": [value("a", "2"), value("c", "x")]}}, True),
    ({"or": [value("c", "x"), value("a", "2")]}, True),
    ({"and": []}, True),
    ({"or": []}, False),
    ({}, False),
    ({"and": [value("a", "1")], "or": [value("a", "2")]}, False),  # and wins
])
def test_composite_rules_follow_upstream(tree, fires):
    req = request(query={"a": "2"})
    ok, err = w.evaluate(rule(tree), req)
    assert ok is fires
    assert err is None or isinstance(err, w.ParameterNodeError)


def test_regex_is_re2():
    match = lambda rx, text: w.compile_re2(rx).search(text) is not None  # noqa: E731
    assert match(r"^v1\z", "v1") and not match(r"^v1\z", "v1\n")
    assert not match("^main$", "main\n") and match("(?m)^main$", "a\nmain\n")
    assert match("[$]", "$") and not match(r"\d", "\u0663")
    for bad in ("v(?=1)", "(?<!x)y", r"(v)\1", "(?P=n)", r"a\Z", "("):
        with pytest.raises(w.re.error):
            w.compile_re2(bad)
    regex_rule = rule({"match": {"type": "regex", "regex": "(?=x)",
                                 "parameter": {"source": "url", "name": "a"}}})
    assert isinstance(w.evaluate(regex_rule, request(query={"a": "x"}))[1], w.RuleError)


def sign(secret, body, algorithm):
    return hmac.new(secret.encode(), body, algorithm).hexdigest()


@pytest.mark.parametrize("kind,algorithm,prefix", [
    ("payload-hmac-sha1", "sha1", "sha1="), ("payload-hmac-sha256", "sha256", "sha256="),
    ("payload-hmac-sha512", "sha512", "sha512="), ("payload-hash-sha256", "sha256", "sha256=")])
def test_hmac_rules(kind, algorithm, prefix):
    body = b'{"ref": "refs/heads/main"}'
    good = sign("s3cret", body, algorithm)
    tree = rule({"match": {"type": kind, "secret": "s3cret",
                           "parameter": {"source": "header", "name": "X-Sig"}}})
    for header, expected in [(prefix + good, (True, None)), (good, (True, None)),
                             ("%s00,%s%s" % (prefix, prefix, good), (True, None))]:
        assert w.evaluate(tree, request(headers={"X-Sig": header}, body=body)) == expected
    ok, err = w.evaluate(tree, request(headers={"X-Sig": prefix + good.upper()}, body=body))
    assert not ok and isinstance(err, w.SignatureError) and good.upper() not in str(err)
    ok, err = w.evaluate(tree, request(body=body))
    assert not ok and isinstance(err, w.ParameterNodeError)
    soft = rule({"or": [{"match": {"type": kind, "secret": "s3cret", "parameter": {
        "source": "header", "name": "X-Sig"}}}, value("a", "1")]})
    req = request(headers={"X-Sig": "bad"}, query={"a": "1"}, body=body)
    assert isinstance(w.evaluate(soft, req)[1], w.SignatureError)
    req.allow_signature_errors = True
    assert w.evaluate(soft, req) == (True, None)


def test_empty_secret_is_an_error():
    assert isinstance(w.check_payload_signature(b"", "", "x", "sha1", "sha1="), w.RuleError)


@pytest.mark.parametrize("remote,ranges,expected", [
    ("127.0.0.1:5000", "127.0.0.1", True),
    ("127.0.0.1:5000", "10.0.0.0/8 127.0.0.5/8", True),
    ("10.1.1.1:5000", "127.0.0.0/8", False),
    ("[::1]:5000", "::1", True),
    ("[::ffff:127.0.0.1]:80", "127.0.0.0/8", True),
])
def test_ip_whitelist(remote, ranges, expected):
    assert w.check_ip_whitelist(remote, ranges) == (expected, None)


def test_ip_whitelist_errors():
    assert isinstance(w.check_ip_whitelist("127.0.0.1:1", "127.0.0.1/33")[1], w.RuleError)
    assert isinstance(w.check_ip_whitelist("@", "127.0.0.1")[1], w.RuleError)


def test_scalr_signature():
    now = 1_700_000_000
    date = time.strftime("%a %d %b %Y %H:%M:%S UTC", time.gmtime(now))
    body = b"payload"
    signature = hmac.new(b"key", body + date.encode(), hashlib.sha1).hexdigest()
    req = request(headers={"X-Signature": signature, "Date": date}, body=body)
    assert w.check_scalr_signature(req, "key", now + 10) == (True, None)
    assert isinstance(w.check_scalr_signature(req, "key", now + 400)[1], w.SignatureError)
    assert isinstance(w.check_scalr_signature(req, "other", now)[1], w.SignatureError)
    assert w.check_scalr_signature(request(), "key", now) == (False, None)


# ---------------------------------------------------------------------------------------------
# Command building, gates, HTTP helpers
# ---------------------------------------------------------------------------------------------

def test_build_invocation(tmp_path):
    hooks, _ = load([{"id": "a", "execute-command": "/bin/echo",
                      "pass-arguments-to-command": [{"source": "url", "name": "b"},
                                                    {"source": "url", "name": "missing"}],
                      "pass-environment-to-command": [{"source": "payload", "name": "x.y"},
                                                      {"source": "url", "name": "b",
                                                       "envname": "BRANCH"},
                                                      {"source": "url", "name": "nope"}],
                      "pass-file-to-command": [{"source": "payload", "name": "f",
                                                "base64decode": True}]}])
    req = request({"x": {"y": "\ud800"}, "f": "aGk="}, query={"b": "main"})
    inv = w.build_invocation(hooks[0], req)
    assert inv.argv == [b"/bin/echo", b"main", b""]
    assert inv.env_pairs == [("HOOK_x.y", "\ufffd".encode()), ("BRANCH", b"main")]
    assert inv.file_pairs == [("HOOK_F", b"hi")] and len(inv.messages) == 2
    written = w.write_temp_files(inv, "rid")
    try:
        (envname, path), = written
        assert envname == "HOOK_F" and os.path.isabs(path) and path[-9:].isdigit()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    finally:
        w.remove_files(written)
    assert not os.path.exists(path)


def invocation(argv, env_pairs=(), file_pairs=(), cwd=None):
    argv = [a.encode() for a in argv]
    return w.Invocation(argv[0].decode(), argv, list(env_pairs), list(file_pairs), cwd, [])


def collected(running):
    """Run a Running to its end: its result, with the whole output in it."""
    output = b"".join(running.output())
    running.result.output = output
    return running.result


def test_runner_collects_streams_and_times_out(tmp_path):
    runner = w.Runner()
    result = collected(runner.start(
        invocation(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]), "r"))
    assert (result.started, result.returncode, result.output) == (True, 3, b"out\nerr\n")
    running = runner.start(invocation(["/bin/sh", "-c", "printf a; sleep 0.1; printf b"]), "r")
    assert b"".join(running.output()) == b"ab" and running.result.ok  # as it comes
    started = time.monotonic()
    result = collected(runner.start(invocation(["/bin/sh", "-c", "echo begun; sleep 30"]), "r",
                                    timeout=0.3))
    assert result.timed_out and result.output == b"begun\n" and time.monotonic() - started < 5
    result = collected(runner.start(invocation(["/bin/sleep", "30"]), "r", timeout=0.2,
                                    capture=False))
    assert (result.timed_out, result.returncode) == (True, -15)
    assert not runner.processes and not runner.active
    missing = runner.start(invocation([str(tmp_path / "nothing")]), "r")
    assert not missing.result.started and missing.result.error is not None  # before any output
    assert list(missing.output()) == [] and not runner.active


def test_runner_environment_last_definition_wins_in_its_position(tmp_path):
    # defect 5: as Go's exec, a name set twice keeps the last value, in the last position
    pairs = [("HOOK_A", b"first"), ("HOOK_B", b"b"), ("HOOK_A", b"second")]
    result = collected(w.Runner().start(invocation(["/usr/bin/env"], env_pairs=pairs), "r"))
    names = [line.split(b"=")[0] for line in result.output.splitlines()]
    assert b"HOOK_A=second" in result.output.splitlines()
    assert b"HOOK_A=first" not in result.output.splitlines()
    assert names.index(b"HOOK_A") > names.index(b"HOOK_B") and names.count(b"HOOK_A") == 1


def test_runner_removes_temp_files_and_passes_their_paths(tmp_path):
    inv = invocation(["/bin/sh", "-c", 'cat "$PAYLOAD"; echo; echo "$PAYLOAD"'],
                     file_pairs=[("PAYLOAD", b"secret body")], cwd=str(tmp_path))
    result = collected(w.Runner().start(inv, "r"))
    body, path = result.output.decode().splitlines()
    assert body == "secret body" and os.path.dirname(path) == str(tmp_path)
    assert not os.listdir(tmp_path)


def test_go_base64_decode():
    assert w.go_base64_decode(b"aGk=\n") == (b"hi", None)
    data, error = w.go_base64_decode(b"aGVsbG8")  # unpadded: the complete group is kept
    assert data == b"hel" and error is not None
    assert w.go_base64_decode(b"!!notb64")[0] == b""


def test_hook_gate_is_fifo_and_bounded():
    gate = w.HookGate(2)
    granted = []
    for n in range(6):
        gate.enter(lambda n=n: granted.append(n))
    assert granted == [0, 1] and len(gate.waiting) == 4
    gate.leave()
    assert granted == [0, 1, 2] and gate.running == 2
    gate.set_limit(3)  # a reload raising the limit lets the next one in at once
    assert granted == [0, 1, 2, 3] and gate.running == 3
    for _ in range(3):
        gate.leave()
    assert granted == list(range(6)) and gate.running == 2 and not gate.waiting

    blocked = threading.Thread(target=gate.wait_turn)
    gate.set_limit(2)
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # both slots are still taken
    gate.leave()
    blocked.join(10)
    assert not blocked.is_alive() and gate.running == 2


def test_http_helpers():
    assert w.clean_path("/hooks/a//b/../c/") == "/hooks/a/c/" and w.clean_path("") == "/"
    assert w.head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody") == 24
    assert w.head_end(b"GET / HTTP/1.1\nA: b\n\nbody") == 21 and w.head_end(b"GET /") == -1
    head = w.parse_head(b"\r\nPOST /x?y HTTP/1.0\r\nx-a: 1\r\nX-A: 2\r\nConnection: keep-alive"
                        b"\r\n\r\n")
    assert (head.method, head.target, head.headers["X-A"]) == ("POST", "/x?y", ["1", "2"])
    assert head.keep_alive()
    folded = w.parse_head(b"GET / HTTP/1.2\r\nHost: h\r\nX-A: one\r\n  two\r\n\r\n")
    assert folded.version == "HTTP/1.1" and folded.headers["X-A"] == ["one two"]
    for bad, public in [(b"GET /\r\n\r\n", "400 Bad Request"),
                        (b"GET / HTTP/2.0\r\n\r\n",
                         "505 HTTP Version Not Supported: unsupported protocol version"),
                        (b"GET / HTTP/1.1\r\n\r\n",
                         "400 Bad Request: missing required Host header"),
                        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "400 Bad Request"),
                        (b"GET / HTTP/1.1\r\n folded\r\n\r\n", "400 Bad Request"),
                        (b"GET / HTTP/1.1\r\nbad header: x\r\n\r\n",
                         "400 Bad Request: invalid header name"),
                        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
                         "400 Bad Request: invalid header value")]:
        with pytest.raises(w.BadRequest) as info:
            w.parse_head(bad)
        assert info.value.public == public
        answer = info.value.response()  # sent bare, as Go: no Date, no length, then closed
        assert (answer.status, answer.body, answer.bare, answer.close) == (
            int(public[:3]), public.encode(), True, True)
    assert w.sniff_content_type(b"  <html><body>") == "text/html; charset=utf-8"
    assert w.sniff_content_type(b"{}") == "text/plain; charset=utf-8"
    assert w.sniff_content_type(b"\x00\x01") == "application/octet-stream"
    assert w.redact_target("/h/a?token=s3&b=1", {"token"}) == "/h/a?token=<redacted>&b=1"
