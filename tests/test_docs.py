"""The documentation as a newcomer uses it: every block marked ```sh runnable in README.md,
docs/webhookd.md and docs/searchkeys.md runs as written, in that order, in one bash shell, in a
copy of this clone, on free ports in place of the documented ones; the README's first screen
works; the reference pages cover every flag."""
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import support
from support import ROOT, SEARCHKEYS, WEBHOOKD, free_port, scratch_dir

DOCS = ("README.md", "docs/webhookd.md", "docs/searchkeys.md")
# The ports the documented commands use. The test runs them on free ports instead (a busy 9000
# on the test machine must neither fail nor skip it), so every server a block starts names its
# port, and the keys commands, which default to 7700, get searchkeys' URL from MEILI_URL.
DOC_PORTS = (9000, 7700, 7701)
DOC_PORT = re.compile(r"(?<![0-9])(%s)(?![0-9])" % "|".join(map(str, DOC_PORTS)))
STARTS_A_SERVER = re.compile(r"python3 (?:webhookd\.py|searchkeys\.py serve|bench/stub_server\.py)"
                             r".*&[ \t]*(?:#.*)?$", re.M)  # in the background
RUNNABLE = re.compile(r"^```sh runnable\n(.*?)^```", re.M | re.S)
# Left out of the copy: what a clone does not have, and what the blocks make themselves.
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "*.deb",
                                    "keys.json", "keys.json.lock", "results")


def runnable_blocks(name):
    """[(line number of the block's first command, its text)] of one document."""
    text = (ROOT / name).read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in RUNNABLE.finditer(text)]


def on_ports(block, ports):
    """The block with each documented port replaced by its stand-in of `ports`."""
    return DOC_PORT.sub(lambda match: str(ports[int(match.group(1))]), block)


def shell_script(copy, ports):
    """All runnable blocks as one bash script, on `ports` (documented port -> free port), that
    stops at the first failing command and says on stderr which block it was in."""
    lines = ["set -euo pipefail", "cd %s" % shlex_quote(copy)]
    for name in DOCS:
        for line, block in runnable_blocks(name):
            lines += ["echo '>>> %s:%d' >&2" % (name, line), on_ports(block, ports)]
    lines.append("echo '>>> all blocks ran' >&2")
    return "\n".join(lines) + "\n"


def shlex_quote(path):
    return "'" + str(path).replace("'", "'\\''") + "'"


def test_every_document_marks_runnable_blocks():
    counts = {name: len(runnable_blocks(name)) for name in DOCS}
    assert all(counts.values()), counts


def test_every_server_a_runnable_block_starts_names_its_port():
    """What lets the blocks run on other ports: a server left on its default port would be
    out of the test's reach (and collide with whatever listens there)."""
    servers = [command for name in DOCS for _, block in runnable_blocks(name)
               for command in STARTS_A_SERVER.findall(block)]
    assert len(servers) >= 4, servers
    unnamed = [command for command in servers
               if not re.search(r" --?port [0-9]+| -socket ", command)]
    assert not unnamed, unnamed


@pytest.mark.skipif(not all(map(shutil.which, ("bash", "curl", "dpkg-deb"))),
                    reason="needs bash, curl and dpkg-deb (the README builds a .deb): "
                           "apt-get install bash curl dpkg")
def test_every_runnable_block_runs_as_written():
    ports = {port: free_port() for port in DOC_PORTS}
    with scratch_dir("webhookd-docs-") as scratch:
        copy = scratch / "clone"
        shutil.copytree(ROOT, copy, ignore=NOT_COPIED)
        (scratch / "run.sh").write_text(shell_script(copy, ports))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEILI_", "SEARCHKEYS_"))}
        env["MEILI_URL"] = "http://127.0.0.1:%d" % ports[7700]  # the keys commands' default
        env["HOME"] = str(scratch)
        log = scratch / "log"
        with open(log, "wb") as out:
            # Output to a file, not a pipe: the servers the blocks start keep it open.
            shell = subprocess.Popen(["bash", str(scratch / "run.sh")], cwd=copy, env=env,
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            try:
                status = shell.wait(180)  # a hang detector: the blocks take seconds
            except subprocess.TimeoutExpired:
                status = "hung for 180 s"
            finally:
                try:  # the servers the blocks started in the background
                    os.killpg(shell.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        output = log.read_text(errors="replace")
        assert status == 0, output[-6000:]
        assert ">>> all blocks ran" in output and "Traceback" not in output, output[-6000:]


def first_block():
    readme = (ROOT / "README.md").read_text()
    return re.search(r"```sh\n(.*?)```", readme, re.S).group(1)


def first_commands():
    return [line.split("#")[0].strip() for line in first_block().splitlines()
            if line.strip() and not line.startswith("#")]


def test_readme_first_screen_holds_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:40])
    assert first_block() in first_screen
    assert first_commands() == [
        "python3 webhookd.py -hooks webhook.conf.example -ip 127.0.0.1 -verbose",
        "python3 tests/run.py -q"]
    assert "apt install python3-venv" in first_screen


def test_readme_first_command_serves_the_example_hooks():
    """As written, with the port (9000 by default) moved to a free one."""
    argv = first_commands()[0].split()
    assert argv[:2] == ["python3", "webhookd.py"]
    port = free_port()
    with support.Daemon([sys.executable] + argv[1:] + ["-port", str(port)], port, cwd=ROOT) as daemon:
        assert daemon.request("GET", "/hooks/ping")[::2] == (200, b"pong\n")


def test_ci_runs_the_readme_test_command_as_written():
    test_command = first_commands()[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci


def test_readme_stays_a_first_read():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for link in ("docs/webhookd.md", "docs/searchkeys.md", "LICENSE"):
        assert "(%s)" % link in readme, link


@pytest.mark.parametrize("name", DOCS[1:])
def test_reference_pages_have_the_sections_other_work_is_folded_into(name):
    headings = re.findall(r"^## (.+)$", (ROOT / name).read_text(), re.M)
    for section in ("Security", "Connection handling"):
        assert section in headings, headings
    wanted = {"docs/webhookd.md": ("Run history", "Command line", "Differences from webhook 2.8.0"),
              "docs/searchkeys.md": ("Restrictions", "Store", "Command line", "Behind nginx")}[name]
    for section in wanted:
        assert any(heading.startswith(section) for heading in headings), (section, headings)


def relative_links(name):
    text = (ROOT / name).read_text()
    return [target for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in target]


@pytest.mark.parametrize("name", DOCS)
def test_relative_links_point_at_files_of_the_clone(name):
    base = (ROOT / name).parent
    missing = [target for target in relative_links(name) if not (base / target).exists()]
    assert not missing, missing


def anchors(path):
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("name", DOCS + ("docs/development.md",))
def test_links_to_sections_point_at_headings(name):
    path = ROOT / name
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", path.read_text()):
        linked = (path.parent / target) if target else path
        if linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target + "#" + anchor)
    assert not broken, broken


def test_every_webhookd_flag_is_in_the_reference():
    text = (ROOT / "docs" / "webhookd.md").read_text()
    help_text = subprocess.run([sys.executable, str(WEBHOOKD), "-help"], capture_output=True,
                               text=True, timeout=30)
    flags = re.findall(r"^  -(\S+)", help_text.stdout + help_text.stderr, re.M)
    assert "status-path" in flags
    missing = [flag for flag in flags if not re.search(r"`-%s[ `]" % re.escape(flag), text)]
    assert not missing, missing


def serve_help():
    return subprocess.run([sys.executable, str(SEARCHKEYS), "serve", "--help"], capture_output=True,
                          text=True, timeout=30).stdout


def test_every_searchkeys_serve_option_is_in_the_reference():
    text = (ROOT / "docs" / "searchkeys.md").read_text()
    options = set(re.findall(r"(--[a-z][a-z-]+)", serve_help())) - {"--help"}
    assert "--trusted-proxy" in options
    missing = [option for option in sorted(options) if "`%s" % option not in text]
    assert not missing, missing


def test_rate_counter_memory_in_the_docs_is_what_serve_help_says():
    figure = re.search(r"(?:about |~)(\d+) MiB", " ".join(serve_help().split())).group(1)
    text = " ".join((ROOT / "docs" / "searchkeys.md").read_text().split())
    said = set(re.findall(r"about (\d+) MiB", text))
    assert said == {figure}, (said, figure)


def test_nginx_recipe_in_the_docs_trusts_nginx_as_the_proxy():
    """Behind nginx every request comes from nginx: without --trusted-proxy, one client's
    per-IP limit is everyone's."""
    text = (ROOT / "docs" / "searchkeys.md").read_text()
    section = text[text.index("## Behind nginx"):]
    section = section[:section.index("\n## ", 1)]
    serves = re.findall(r"python3 searchkeys\.py serve [^`\n]*", section)
    assert serves and all("--trusted-proxy 127.0.0.1" in command for command in serves), serves
    assert "--trusted-proxy 127.0.0.1" in (ROOT / "searchkeys-nginx.conf.example").read_text()


# ---------------------------------------------------------------- what a clone holds

def git_mode(name):
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s", name], capture_output=True,
                            text=True).stdout.split()
    if not listed:
        pytest.skip("needs a git clone of this repository (git ls-files lists nothing here)")
    return listed[0]


@pytest.mark.parametrize("tool", [WEBHOOKD, SEARCHKEYS])
def test_tools_are_executable_from_a_clone(tool):
    assert git_mode(tool.name) == "100755"
    assert tool.read_text().split("\n", 1)[0] == "#!/usr/bin/env python3"
    run = subprocess.run(["./" + tool.name, "--help" if tool == SEARCHKEYS else "-version"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr


def test_the_readme_try_out_leaves_nothing_for_git_to_report():
    names = ["keys.json", "keys.json.lock", ".venv/", "webhookd_3.0.0_all.deb"]
    checked = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *names],
                             capture_output=True, text=True)
    if checked.returncode == 128:
        pytest.skip("needs a git clone of this repository")
    assert checked.stdout.split() == names


def test_license_is_mit_and_the_readme_says_so():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License\n")
    assert "Copyright (c) 2026 The webhookd and searchkeys authors" in license_text
    assert "MIT" in (ROOT / "README.md").read_text().split("## License", 1)[1]


SKIP_REASON = re.compile(r"""(?:pytest\.skip\(|reason=)\s*f?(["'])(.*?)\1""")


def test_every_skip_reason_says_what_to_do():
    """A newcomer reading "SKIPPED" learns what to install or provide to run the test."""
    vague = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for _, reason in SKIP_REASON.findall(path.read_text()):
            # ("known broken": the reference program is wrong there; nothing to provide.)
            if not re.search(r"needs |apt-get install|run the suite|run python3|unset|stop what|known broken",
                             reason):
                vague.append("%s: %s" % (path.name, reason))
    assert not vague, vague
