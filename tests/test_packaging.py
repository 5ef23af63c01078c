"""packaging/build-deb: the two .debs it builds (webhookd's and searchkeys'), read back with
dpkg-deb and installed with dpkg into a throwaway root (never the machine's own system: dpkg
gets --root, the maintainer scripts DPKG_ROOT, and systemctl/deb-systemd-invoke are stubs that
record any call); lintian, where installed, finds nothing to say."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import support
from support import ROOT, free_port, scratch_dir
import searchkeys
import webhookd

pytestmark = pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="needs dpkg-deb: apt-get install dpkg")

BUILD_DEB = ROOT / "packaging" / "build-deb"
UNIT = "lib/systemd/system/webhookd.service"
ENABLED_LINK = "etc/systemd/system/multi-user.target.wants/webhookd.service"
EXEC_START = ("ExecStart=/usr/bin/webhookd -nopanic -hooks /etc/webhook.conf -hotreload -verbose "
              "-port 9000")
# The project's, whoever builds (issue 31): not the last commit's author.
MAINTAINER_FIELD = ("webhookd and searchkeys maintainers "
                    "<maintainers@users.noreply.a-seed-3d0b72e0.example>")


def build(checkout_build_deb, out_dir, **env):
    return subprocess.run([sys.executable, str(checkout_build_deb), str(out_dir)],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))


def dpkg_deb(*args):
    return subprocess.run(["dpkg-deb", *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout


@pytest.fixture(scope="module")
def debs():
    """Both packages, built once: {"webhookd": path, "searchkeys": path}."""
    with scratch_dir("webhookd-deb-test-") as out:
        run = build(BUILD_DEB, out)
        assert run.returncode == 0, run.stderr
        built = {"webhookd": out / f"webhookd_{webhookd.__version__}_all.deb",
                 "searchkeys": out / f"searchkeys_{searchkeys.__version__}_all.deb"}
        assert run.stdout.split() == [str(path) for path in built.values()], run.stdout
        yield built


@pytest.fixture(scope="module")
def deb(debs):
    return debs["webhookd"]


@pytest.fixture(scope="module")
def extracted(deb):
    with scratch_dir("webhookd-deb-x-") as root:
        dpkg_deb("-x", str(deb), str(root))
        dpkg_deb("-e", str(deb), str(root / "DEBIAN"))
        yield root


# ---------------------------------------------------------------------------
# What the package says and holds
# ---------------------------------------------------------------------------

def test_control_fields(deb):
    assert deb.exists(), "the package is named webhookd_<webhookd.__version__>_all.deb"
    fields = dict(line.split(": ", 1) for line in
                  dpkg_deb("-f", str(deb), "Package", "Version", "Architecture", "Depends",
                           "Maintainer", "Section", "Priority").splitlines())
    assert fields["Package"] == "webhookd"
    assert fields["Version"] == webhookd.__version__
    assert fields["Architecture"] == "all"
    assert fields["Depends"] == "python3 (>= 3.9)"
    assert fields["Maintainer"] == MAINTAINER_FIELD
    assert fields["Section"] and fields["Priority"] == "optional"
    info = dpkg_deb("-I", str(deb))
    assert re.search(r"^ Description: \S.*\n(  \S.*\n)+", info, re.MULTILINE), info
    for script in ("postinst", "prerm", "postrm", "md5sums"):
        assert re.search(rf"^\s+\d+ bytes,\s+\d+ lines\s.*\b{script}\b", info, re.MULTILINE)


def contents(deb):
    """{path: (mode, owner)} of what the package installs."""
    entries = {}
    for line in dpkg_deb("-c", str(deb)).splitlines():
        mode, owner, _size, _date, _time, path = line.split(None, 5)
        entries[path] = (mode, owner)
    return entries


def test_contents_are_root_owned_with_right_modes_and_nothing_in_etc(deb):
    entries = contents(deb)
    assert {owner for _, owner in entries.values()} == {"root/root"}
    assert entries["./usr/bin/webhookd"][0] == "-rwxr-xr-x"
    assert entries["./usr/share/webhookd/webhookd.py"][0] == "-rwxr-xr-x"
    for path in ("./" + UNIT, "./usr/share/man/man1/webhookd.1.gz",
                 "./usr/share/doc/webhookd/README.md.gz",
                 "./usr/share/doc/webhookd/webhookd.md.gz",
                 "./usr/share/doc/webhookd/webhook.conf.example",
                 "./usr/share/doc/webhookd/copyright", "./usr/share/doc/webhookd/changelog.gz"):
        assert entries[path][0] == "-rw-r--r--", path
    assert all(mode == "drwxr-xr-x" for path, (mode, _) in entries.items() if path.endswith("/"))
    assert not [path for path in entries if path.startswith("./etc")], "the package owns nothing in /etc"


def test_installed_program_is_webhookd_py_with_debians_python(extracted):
    installed = (extracted / "usr/share/webhookd/webhookd.py").read_text()
    source = (ROOT / "webhookd.py").read_text()
    assert installed.startswith("#!/usr/bin/python3\n")
    assert installed.split("\n", 1)[1] == source.split("\n", 1)[1]
    if os.access("/usr/bin/python3", os.X_OK):
        run = subprocess.run([str(extracted / "usr/bin/webhookd"), "-version"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0 and "version" in run.stdout + run.stderr, run.stderr
    example = (extracted / "usr/share/doc/webhookd/webhook.conf.example").read_bytes()
    assert example == (ROOT / "webhook.conf.example").read_bytes()


def test_unit_runs_the_installed_program_and_is_otherwise_the_repositorys(extracted):
    unit = (extracted / UNIT).read_text().splitlines()
    assert [line for line in unit if line.startswith("ExecStart=")] == [EXEC_START]
    repo_unit = (ROOT / "webhookd.service").read_text().splitlines()
    # The module path the repository's unit sets is the launcher's business in the package.
    assert "Environment=PYTHONPATH=/usr/local/lib/webhookd" in repo_unit
    settings = [line for line in repo_unit if "=" in line
                and not line.startswith(("#", "ExecStart=", "Environment=PYTHONPATH="))]
    packaged = [line for line in unit if "=" in line and not line.startswith("#")]
    assert [line for line in packaged if line in settings] == settings
    assert "/usr/local/" not in "\n".join(unit) and "PYTHONPATH" not in "\n".join(unit)
    # The status page and run history it offers, commented out, run the installed program too.
    offered = [line for line in unit if line.startswith("#ExecStart=/")]
    assert offered == [EXEC_START.replace("ExecStart", "#ExecStart") + " -status-path /-/status "
                       "-status-token-file %d/status-token -runs-dir /var/lib/webhookd/runs"]
    assert "#LoadCredential=status-token:/etc/webhookd/status-token" in unit


def test_man_page_documents_every_flag_of_help(extracted):
    page = gzip.decompress((extracted / "usr/share/man/man1/webhookd.1.gz").read_bytes()).decode()
    assert page.startswith(f'.TH WEBHOOKD 1 ') and f'"webhookd {webhookd.__version__}"' in page
    help_text = subprocess.run([sys.executable, str(ROOT / "webhookd.py"), "-help"],
                               capture_output=True, text=True, timeout=30)
    flags = re.findall(r"^  -(\S+)", help_text.stdout + help_text.stderr, re.MULTILINE)
    assert "hotreload" in flags
    for flag in flags:
        assert "\\fB\\-" + flag.replace("-", "\\-") + "\\fR" in page, flag


def test_copyright_file_is_the_repositorys_mit_license(extracted):
    copyright_text = (extracted / "usr/share/doc/webhookd/copyright").read_text()
    license_text = (ROOT / "LICENSE").read_text()
    assert copyright_text.endswith(license_text) and "License: MIT" in copyright_text
    assert "Copyright (c) 2026 The webhookd and searchkeys authors" in copyright_text
    assert "states no license" not in copyright_text


def test_changelog_names_the_version(extracted):
    changelog = gzip.decompress(
        (extracted / "usr/share/doc/webhookd/changelog.gz").read_bytes()).decode()
    assert changelog.startswith(f"webhookd ({webhookd.__version__}) ")


def test_maintainer_scripts_parse(extracted):
    for name in ("postinst", "prerm", "postrm"):
        script = extracted / "DEBIAN" / name
        assert os.access(script, os.X_OK), name
        run = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        assert run.returncode == 0, (name, run.stderr)


# ---------------------------------------------------------------------------
# Built from whatever the checkout holds
# ---------------------------------------------------------------------------

@pytest.fixture
def checkout_copy():
    """The files build-deb reads, copied to a scratch folder that is not a git checkout."""
    with scratch_dir("webhookd-deb-src-") as src:
        (src / "docs").mkdir()
        for name in ("webhookd.py", "webhookd.service", "README.md", "webhook.conf.example", "LICENSE",
                     "docs/webhookd.md", "searchkeys.py", "docs/searchkeys.md",
                     "searchkeys-nginx.conf.example"):
            shutil.copy(ROOT / name, src / name)
        shutil.copytree(ROOT / "packaging", src / "packaging")
        yield src


# Who builds changes nothing in the packages: not git's author (this copy is no checkout),
# not Debian's variables for a maintainer.
MAINTAINER = {"DEBFULLNAME": "Test Builder", "DEBEMAIL": "builder@example.org"}


def test_build_follows_edits_of_the_unit_and_the_version(checkout_copy):
    src = checkout_copy
    unit = (src / "webhookd.service").read_text()
    unit = re.sub(r"-port 9000", "-port 9010 -urlprefix hooks", unit)
    (src / "webhookd.service").write_text(unit.replace("[Service]\n", "[Service]\nNice=5\n"))
    script = (src / "webhookd.py").read_text()
    (src / "webhookd.py").write_text(script.replace(
        f'__version__ = "{webhookd.__version__}"', '__version__ = "9.1~rc1"', 1))
    out = src / "out"
    run = build(src / "packaging" / "build-deb", out, **MAINTAINER)
    assert run.returncode == 0, run.stderr
    deb = out / "webhookd_9.1~rc1_all.deb"
    assert dpkg_deb("-f", str(deb), "Version").strip() == "9.1~rc1"
    assert dpkg_deb("-f", str(deb), "Maintainer").strip() == MAINTAINER_FIELD
    dpkg_deb("-x", str(deb), str(src / "root"))
    packaged = (src / "root" / UNIT).read_text().splitlines()
    assert "Nice=5" in packaged
    assert [line for line in packaged if line.startswith("ExecStart=")] == [
        "ExecStart=/usr/bin/webhookd -nopanic -hooks /etc/webhook.conf -hotreload -verbose "
        "-port 9010 -urlprefix hooks"]


@pytest.mark.parametrize("line", ['__version__ = "3.0 beta"', "__version__ = VERSION", ""])
def test_build_refuses_an_unreadable_version(checkout_copy, line):
    src = checkout_copy
    script = (src / "webhookd.py").read_text()
    (src / "webhookd.py").write_text(
        re.sub(r'^__version__ = "[^"]*"', line, script, count=1, flags=re.MULTILINE))
    run = build(src / "packaging" / "build-deb", src / "out", **MAINTAINER)
    assert run.returncode == 1
    assert run.stderr.startswith("build-deb: ") and "__version__" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) == 1
    assert not list(src.glob("out/*.deb"))


# ---------------------------------------------------------------------------
# Installed with dpkg into a throwaway root
# ---------------------------------------------------------------------------

needs_dpkg = pytest.mark.skipif(
    not (shutil.which("dpkg") and shutil.which("deb-systemd-helper")),
    reason="needs dpkg and deb-systemd-helper: apt-get install dpkg init-system-helpers")


class ThrowawayRoot:
    """An empty dpkg database under a scratch folder; systemctl and deb-systemd-invoke on
    PATH are stubs writing their arguments to calls.log (systemd must never be asked)."""

    def __init__(self, path):
        self.path = path
        for folder in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "stubs"):
            (path / folder).mkdir(parents=True)
        (path / "var/lib/dpkg/status").touch()
        self.calls = path / "calls.log"
        for stub in ("systemctl", "deb-systemd-invoke"):
            (path / "stubs" / stub).write_text(f'#!/bin/sh\necho "{stub} $*" >> "{self.calls}"\n')
            (path / "stubs" / stub).chmod(0o755)

    def dpkg(self, *args, **env):
        # dpkg wants ldconfig and start-stop-daemon, which a non-login PATH may lack
        env = dict(os.environ, PATH=f"{self.path / 'stubs'}:{os.environ['PATH']}:/usr/sbin:/sbin",
                   **env)
        run = subprocess.run(["dpkg", f"--root={self.path}", "--log=/dev/null", "--force-not-root",
                              "--force-script-chrootless", "--force-depends", *args],
                             capture_output=True, text=True, env=env, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout + run.stderr

    def systemd_calls(self):
        return self.calls.read_text() if self.calls.exists() else ""

    def enabled(self, unit="webhookd.service"):
        return os.path.lexists(self.path / "etc/systemd/system/multi-user.target.wants" / unit)

    def enable_debians_webhook(self):
        (self.path / "lib/systemd/system").mkdir(parents=True)
        (self.path / "lib/systemd/system/webhook.service").write_text(
            "[Service]\nExecStart=/usr/bin/webhook -nopanic -hooks /etc/webhook.conf\n"
            "[Install]\nWantedBy=multi-user.target\n")
        wants = self.path / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True)
        os.symlink("/lib/systemd/system/webhook.service", wants / "webhook.service")


@pytest.fixture
def throwaway_root():
    with scratch_dir("webhookd-deb-root-") as path:
        yield ThrowawayRoot(path)


@needs_dpkg
def test_fresh_install_with_nothing_to_take_over_is_enabled_and_purge_leaves_only_the_hooks_file(
        deb, throwaway_root):
    root = throwaway_root
    output = root.dpkg("-i", str(deb))
    assert "Setting up webhookd" in output
    assert root.enabled()
    assert os.readlink(root.path / ENABLED_LINK) == "/" + UNIT
    assert os.access(root.path / "usr/bin/webhookd", os.X_OK)
    # byte-compiled, so that /usr/bin/webhookd does not compile it at every start
    assert list((root.path / "usr/share/webhookd/__pycache__").glob("webhookd.cpython-*.pyc"))
    # One message: enabled, waiting for the hooks file, and how to make it.
    assert "webhookd.service is enabled; it runs once /etc/webhook.conf exists" in output
    assert "/usr/share/doc/webhookd/webhook.conf.example /etc/webhook.conf" in output
    assert "systemctl start webhookd" in output and "left disabled" not in output
    assert not (root.path / "etc/webhook.conf").exists()

    (root.path / "etc/webhook.conf").write_text("[]\n")  # the admin writes the hooks file
    output = root.dpkg("-i", str(deb))  # reinstall/upgrade: idempotent, nothing left to say
    assert root.enabled()
    assert "\nwebhookd: " not in output and not output.startswith("webhookd: ")

    root.dpkg("--purge", "webhookd")
    assert not root.enabled()
    assert not (root.path / "usr/bin/webhookd").exists()
    assert not (root.path / "usr/share/webhookd").exists(), "the cache is removed with the package"
    assert not (root.path / "var/lib/systemd/deb-systemd-helper-enabled/webhookd.service.dsh-also").exists()
    assert (root.path / "etc/webhook.conf").read_text() == "[]\n"
    assert root.systemd_calls() == "", "no systemd here: nothing may call systemctl"


@needs_dpkg
def test_fresh_install_over_an_existing_hooks_file_is_left_disabled_and_says_how_to_enable(
        deb, throwaway_root):
    """Hooks someone set up (for webhook, since removed, or by hand) start serving only when
    the admin says so."""
    root = throwaway_root
    (root.path / "etc").mkdir()
    (root.path / "etc/webhook.conf").write_text("[]\n")
    output = root.dpkg("-i", str(deb))
    assert not root.enabled()
    assert "left disabled and not started: /etc/webhook.conf already exists" in output
    assert "systemctl enable --now webhookd" in output
    assert "install -m 0600" not in output  # the file is there: no advice to create it
    root.dpkg("-i", str(deb))  # an upgrade keeps it disabled
    assert not root.enabled()


@needs_dpkg
def test_fresh_install_next_to_a_deliberately_disabled_webhook_is_left_disabled(deb, throwaway_root):
    root = throwaway_root
    root.enable_debians_webhook()
    os.unlink(root.path / "etc/systemd/system/multi-user.target.wants/webhook.service")  # disabled
    (root.path / "etc/webhook.conf").write_text("[]\n")
    output = root.dpkg("-i", str(deb))
    assert not root.enabled() and not root.enabled("webhook.service")
    assert "Debian's webhook is installed here" in output
    assert "systemctl disable --now webhook && systemctl enable --now webhookd" in output
    assert root.systemd_calls() == ""


@needs_dpkg
def test_next_to_webhook_without_a_hooks_file_one_consistent_message(deb, throwaway_root):
    root = throwaway_root
    root.enable_debians_webhook()
    output = root.dpkg("-i", str(deb))
    assert not root.enabled()
    said = output[output.index("webhookd: "):]
    assert said.count("\nwebhookd: ") == 0, said
    # Create the file, then switch: never "start webhookd" while webhook keeps the port.
    assert said.index("install -m 0600") < said.index("systemctl disable --now webhook &&")
    assert "systemctl start webhookd" not in said and "is enabled" not in said


@needs_dpkg
def test_upgrade_keeps_a_unit_the_admin_disabled_disabled(deb, throwaway_root):
    root = throwaway_root
    root.dpkg("-i", str(deb))
    os.unlink(root.path / ENABLED_LINK)  # what `systemctl disable webhookd` does
    root.dpkg("-i", str(deb))
    assert not root.enabled()


@needs_dpkg
def test_next_to_debians_webhook_the_unit_stays_disabled_until_the_admin_switches(deb, throwaway_root):
    root = throwaway_root
    root.enable_debians_webhook()
    output = root.dpkg("-i", str(deb))
    assert not root.enabled() and root.enabled("webhook.service")
    assert "systemctl disable --now webhook && systemctl enable --now webhookd" in output

    root.dpkg("-i", str(deb))  # an upgrade does not enable it behind the admin's back
    assert not root.enabled()

    # The admin switches (systemctl disable webhook; systemctl enable webhookd): upgrades keep it.
    os.unlink(root.path / "etc/systemd/system/multi-user.target.wants/webhook.service")
    os.symlink("/" + UNIT, root.path / ENABLED_LINK)
    output = root.dpkg("-i", str(deb))
    assert root.enabled() and "left disabled" not in output
    assert root.systemd_calls() == ""


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="checks the scripts where systemd is not PID 1: run the suite in a container to cover it")
def test_maintainer_scripts_without_systemd_only_record_the_enablement(extracted):
    """As in a container: no DPKG_ROOT, no systemd; deb-systemd-helper is a recording stub."""
    with scratch_dir("webhookd-deb-stubs-") as stubs:
        calls = stubs / "calls.log"
        for command in ("systemctl", "deb-systemd-invoke", "deb-systemd-helper"):
            # The helper answers "not enabled" for is-enabled (no webhook), "enabled" otherwise.
            (stubs / command).write_text(
                f'#!/bin/sh\necho "{command} $*" >> "{calls}"\n'
                'case "$*" in *is-enabled*|*debian-installed*) exit 1;; esac\nexit 0\n')
            (stubs / command).chmod(0o755)
        env = {"PATH": f"{stubs}:/usr/bin:/bin", "DPKG_MAINTSCRIPT_PACKAGE": "webhookd"}
        for script, args in (("postinst", ["configure", ""]), ("postinst", ["configure", "3.0.0"]),
                             ("prerm", ["remove"]), ("postrm", ["remove"]), ("postrm", ["purge"])):
            run = subprocess.run(["sh", str(extracted / "DEBIAN" / script), *args], env=env,
                                 capture_output=True, text=True, timeout=30)
            assert run.returncode == 0, (script, args, run.stderr)
        recorded = calls.read_text().splitlines()
    assert not [call for call in recorded if not call.startswith("deb-systemd-helper ")]
    # Enabled on each (seemingly fresh) configure, unless this machine has webhook or its file.
    webhook_here = any(os.path.exists(p) for p in (
        "/etc/webhook.conf", "/etc/systemd/system/webhook.service",
        "/lib/systemd/system/webhook.service", "/usr/lib/systemd/system/webhook.service"))
    assert recorded.count("deb-systemd-helper enable webhookd.service") == (0 if webhook_here else 2)
    assert recorded[-1] == "deb-systemd-helper purge webhookd.service"


# ---------------------------------------------------------------------------
# searchkeys_<version>_all.deb (issue 31)
# ---------------------------------------------------------------------------

SK_UNIT = "lib/systemd/system/searchkeys.service"
SK_EXEC = ("/usr/bin/searchkeys serve --store /var/lib/searchkeys/keys.json "
           "--upstream http://127.0.0.1:7701")


@pytest.fixture(scope="module")
def sk_extracted(debs):
    with scratch_dir("searchkeys-deb-x-") as root:
        dpkg_deb("-x", str(debs["searchkeys"]), str(root))
        dpkg_deb("-e", str(debs["searchkeys"]), str(root / "DEBIAN"))
        yield root


def unit_settings(text):
    """[(option, value)] of a unit's lines, comments left out."""
    return [tuple(line.split("=", 1)) for line in text.splitlines()
            if "=" in line and not line.startswith(("#", ";"))]


def test_searchkeys_control_fields_and_contents(debs):
    deb = debs["searchkeys"]
    fields = dict(line.split(": ", 1) for line in dpkg_deb(
        "-f", str(deb), "Package", "Version", "Architecture", "Depends", "Maintainer").splitlines())
    assert fields == {"Package": "searchkeys", "Version": searchkeys.__version__,
                      "Architecture": "all", "Maintainer": MAINTAINER_FIELD,
                      "Depends": "python3 (>= 3.9), systemd | systemd-standalone-sysusers | "
                                 "systemd-sysusers"}
    entries = contents(deb)
    assert {owner for _, owner in entries.values()} == {"root/root"}
    assert entries["./usr/bin/searchkeys"][0] == "-rwxr-xr-x"
    assert entries["./usr/share/searchkeys/searchkeys.py"][0] == "-rwxr-xr-x"
    for path in ("./" + SK_UNIT, "./usr/lib/sysusers.d/searchkeys.conf",
                 "./usr/share/man/man1/searchkeys.1.gz", "./usr/share/doc/searchkeys/README.md.gz",
                 "./usr/share/doc/searchkeys/searchkeys.md.gz",
                 "./usr/share/doc/searchkeys/searchkeys-nginx.conf.example",
                 "./usr/share/doc/searchkeys/copyright", "./usr/share/doc/searchkeys/changelog.gz"):
        assert entries[path][0] == "-rw-r--r--", path
    assert not [path for path in entries if path.startswith(("./etc", "./var"))], \
        "the keys in /etc/searchkeys and the store in /var/lib/searchkeys are not the package's"


def test_searchkeys_installed_program_runs_with_debians_python(sk_extracted):
    installed = (sk_extracted / "usr/share/searchkeys/searchkeys.py").read_text()
    assert installed.split("\n", 1)[1] == (ROOT / "searchkeys.py").read_text().split("\n", 1)[1]
    if os.access("/usr/bin/python3", os.X_OK):
        run = subprocess.run([str(sk_extracted / "usr/bin/searchkeys"), "--version"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0 and searchkeys.__version__ in run.stdout, run.stderr
    page = gzip.decompress((sk_extracted / "usr/share/man/man1/searchkeys.1.gz").read_bytes()).decode()
    assert f'"searchkeys {searchkeys.__version__}"' in page
    for option in ("--store", "--upstream", "--trusted-proxy", "--master-key-changed"):
        assert option.replace("-", "\\-") in page, option
    sysusers = (sk_extracted / "usr/lib/sysusers.d/searchkeys.conf").read_text()
    assert re.search(r"^u searchkeys - .* /var/lib/searchkeys$", sysusers, re.M), sysusers


def test_searchkeys_unit_has_its_own_user_state_directory_credentials_and_the_sandbox(sk_extracted):
    unit = (sk_extracted / SK_UNIT).read_text()
    settings = unit_settings(unit)
    for setting in (("User", "searchkeys"), ("Group", "searchkeys"), ("StateDirectory", "searchkeys"),
                    ("StateDirectoryMode", "0700"), ("UMask", "0077"),
                    ("LoadCredential", "master-key:/etc/searchkeys/master-key"),
                    ("LoadCredential", "upstream-key:/etc/searchkeys/upstream-key"),
                    ("ConditionPathExists", "/etc/searchkeys/master-key"),
                    ("ConditionPathExists", "/etc/searchkeys/upstream-key")):
        assert setting in settings, setting
    (execstart,) = [value for option, value in settings if option == "ExecStart"]
    assert execstart.endswith("' " + SK_EXEC), execstart
    assert "master-key" not in execstart.split("' ", 1)[1]  # no key on the command line
    # Every setting of the repository unit's sandbox, with a user of its own instead of a
    # dynamic one and credentials instead of an environment file.
    repo = unit_settings((ROOT / "searchkeys.service").read_text())
    # (WorkingDirectory: the repository unit finds its module there; the package's launcher
    # finds it next to itself.)
    left_out = {"DynamicUser", "EnvironmentFile", "ExecStart", "ConditionPathExists",
                "WorkingDirectory"}
    missing = [setting for setting in repo if setting[0] not in left_out and setting not in settings]
    assert not missing, missing
    assert ("DynamicUser", "yes") not in settings


def test_searchkeys_unit_command_line_serves_with_keys_from_its_credentials(sk_extracted):
    """The unit's ExecStart as systemd runs it ($$ is a $; $CREDENTIALS_DIRECTORY holds the two
    keys), with the extracted launcher, a scratch store and free ports."""
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3, the interpreter the launcher names: apt-get install python3")
    (execstart,) = [value for option, value in unit_settings((sk_extracted / SK_UNIT).read_text())
                    if option == "ExecStart"]
    script, _, arguments = execstart.replace("$$", "$").partition("' ")
    assert script.startswith("/bin/sh -c '")
    port = free_port()
    with scratch_dir("searchkeys-deb-run-") as folder:
        (folder / "credentials").mkdir()
        (folder / "credentials/master-key").write_text("packaged-master-key-0123456789\n")
        (folder / "credentials/upstream-key").write_text("backend-key\n")
        argv = ["/bin/sh", "-c", script[len("/bin/sh -c '"):]] + [
            str(sk_extracted) + arg if arg == "/usr/bin/searchkeys" else
            str(folder / "keys.json") if arg.startswith("/var/lib/") else arg
            for arg in arguments.split()] + ["--port", str(port)]
        env = {"CREDENTIALS_DIRECTORY": str(folder / "credentials")}
        with support.Daemon(argv, port, env=env) as daemon:
            assert daemon.request("GET", "/keys")[0] == 401
            status, _, body = daemon.request("GET", "/keys", headers={
                "Authorization": "Bearer packaged-master-key-0123456789"})
            assert status == 200 and json.loads(body)["total"] >= 1, body
        assert (folder / "keys.json").exists()


def test_launchers_find_their_module_with_pythonsafepath_and_through_a_link(extracted,
                                                                          sk_extracted):
    """PYTHONSAFEPATH=1 (or -P; Python 3.11+), which hardened systems set, keeps the script's
    folder out of sys.path: the launchers, which rewrote sys.path[0] into the module's folder,
    then died with a ModuleNotFoundError traceback."""
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3, the interpreter the launchers name: apt-get install python3")
    with scratch_dir("deb-launcher-link-") as links:
        for tree, name, flag in ((extracted, "webhookd", "-version"),
                                 (sk_extracted, "searchkeys", "--version")):
            os.symlink(tree / "usr/bin" / name, links / name)
            for program in (tree / "usr/bin" / name, links / name):
                for env in ({}, {"PYTHONSAFEPATH": "1"}):
                    run = subprocess.run([str(program), flag], capture_output=True, text=True,
                                         timeout=30, env=dict(os.environ, **env))
                    assert run.returncode == 0 and run.stdout.strip(), (program, env, run)


def root_user(root, name="searchkeys", database="passwd"):
    """The line of `name` in the throwaway root's /etc/passwd (or group), or None."""
    path = root.path / "etc" / database
    lines = path.read_text().splitlines() if path.exists() else []
    return next((line for line in lines if line.startswith(name + ":")), None)


needs_sysusers = pytest.mark.skipif(not shutil.which("systemd-sysusers"),
                                    reason="needs systemd-sysusers: apt-get install systemd")


@needs_dpkg
@needs_sysusers
def test_searchkeys_fresh_install_unconfigured_is_left_disabled_and_purge_keeps_the_store(
        debs, throwaway_root):
    root, deb = throwaway_root, debs["searchkeys"]
    (root.path / "etc").mkdir()  # where systemd-sysusers adds the user, as on any system
    output = root.dpkg("-i", str(deb))
    assert not root.enabled("searchkeys.service")
    assert "searchkeys.service is installed but left disabled and not started" in output
    assert "/etc/searchkeys/master-key" in output and "systemctl enable --now searchkeys" in output
    user = root_user(root)
    assert user and user.split(":")[5] == "/var/lib/searchkeys", user
    assert list((root.path / "usr/share/searchkeys/__pycache__").glob("searchkeys.cpython-*.pyc"))
    output = root.dpkg("-i", str(deb))  # reinstall: idempotent, nothing more to say
    assert not root.enabled("searchkeys.service") and "\nsearchkeys: " not in output
    assert root.systemd_calls() == "", "no systemd here: nothing may call systemctl"

    # The service ran: its store is there. A purge keeps it and its owner, and says so.
    (root.path / "var/lib/searchkeys").mkdir(parents=True)
    (root.path / "var/lib/searchkeys/keys.json").write_text("{}\n")
    output = root.dpkg("--purge", "searchkeys")
    assert "the keys stay in /var/lib/searchkeys" in output
    assert (root.path / "var/lib/searchkeys/keys.json").read_text() == "{}\n"
    assert root_user(root) is not None
    assert not (root.path / "usr/bin/searchkeys").exists()
    assert not (root.path / "usr/share/searchkeys").exists(), "the cache is removed with the package"
    assert not (root.path / "var/lib/systemd/deb-systemd-helper-enabled/searchkeys.service.dsh-also").exists()

    # Asked to, a purge removes the store and the user too.
    root.dpkg("-i", str(deb))
    root.dpkg("--purge", "searchkeys", SEARCHKEYS_PURGE_STORE="yes")
    assert not (root.path / "var/lib/searchkeys").exists() and root_user(root) is None
    assert root_user(root, database="group") is None


@needs_dpkg
@needs_sysusers
def test_searchkeys_fresh_install_with_its_keys_is_enabled_not_started_and_purge_leaves_the_keys(
        debs, throwaway_root):
    root, deb = throwaway_root, debs["searchkeys"]
    (root.path / "etc/searchkeys").mkdir(parents=True)
    for name in ("master-key", "upstream-key"):
        (root.path / "etc/searchkeys" / name).write_text("a-key\n")
    output = root.dpkg("-i", str(deb))
    assert root.enabled("searchkeys.service")
    assert os.readlink(root.path / "etc/systemd/system/multi-user.target.wants/searchkeys.service") \
        == "/" + SK_UNIT
    assert "is enabled" in output and "systemctl start searchkeys" in output
    os.unlink(root.path / "etc/systemd/system/multi-user.target.wants/searchkeys.service")
    root.dpkg("-i", str(deb))  # the admin disabled it: an upgrade keeps it so
    assert not root.enabled("searchkeys.service")
    root.dpkg("--purge", "searchkeys")
    assert root_user(root) is None, "no store: nothing keeps the user"
    assert root_user(root, database="group") is None
    assert sorted(p.name for p in (root.path / "etc/searchkeys").iterdir()) == [
        "master-key", "upstream-key"]
    assert root.systemd_calls() == ""


@needs_dpkg
@needs_sysusers
def test_searchkeys_purge_leaves_an_account_called_searchkeys_that_it_did_not_make(
        debs, throwaway_root):
    """An admin's own account named searchkeys, there before the package: systemd-sysusers
    leaves it as it is, so the purge must too (it deleted it, and its group, when no store
    was there)."""
    root, deb = throwaway_root, debs["searchkeys"]
    (root.path / "etc").mkdir()
    accounts = {"passwd": "searchkeys:x:1500:1500:Sam:/home/searchkeys:/bin/bash\n",
                "group": "searchkeys:x:1500:\n", "shadow": "searchkeys:!:19000::::::\n",
                "gshadow": "searchkeys:!::\n"}
    for database, line in accounts.items():
        (root.path / "etc" / database).write_text(line.replace("searchkeys", "root", 1)
                                                  .replace("1500", "0") + line)
    root.dpkg("-i", str(deb))
    root.dpkg("--purge", "searchkeys", SEARCHKEYS_PURGE_STORE="yes")
    assert root_user(root) == "searchkeys:x:1500:1500:Sam:/home/searchkeys:/bin/bash"
    assert root_user(root, database="group") == "searchkeys:x:1500:"


@pytest.mark.skipif(not shutil.which("lintian"), reason="needs lintian: apt-get install lintian")
def test_lintian_finds_nothing_to_say(debs):
    run = subprocess.run(["lintian", "--info", "--pedantic", *map(str, debs.values())],
                         capture_output=True, text=True, timeout=300)
    said = [line for line in (run.stdout + run.stderr).splitlines()
            if not line.startswith("running with root privileges")]
    assert run.returncode == 0 and said == [], said
