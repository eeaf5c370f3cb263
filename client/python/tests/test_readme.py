"""The README's one-minute tour, run as written against a daemon of this build: its Python
session through doctest (every printed value as the README shows it), and each kvtierctl
command, whose header row must be the README's."""
import doctest
import re
import subprocess
from pathlib import Path

from conftest import BIN, ROOT

TOUR_SOCKET = "unix:/tmp/kvtier.sock"


def tour() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## A one-minute tour")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_tour_runs_as_written(daemon):
    section = tour()
    # The Python session: its >>> lines and what they print, in the daemon's address.
    python = section[section.index(">>> "):]
    python = python[:python.index("```")]
    assert TOUR_SOCKET in python
    python = python.replace(TOUR_SOCKET, daemon.address)
    python = python.replace('sys.path.insert(0, "client/python")',
                            f'sys.path.insert(0, "{ROOT / "client" / "python"}")')
    test = doctest.DocTestParser().get_doctest(python, {}, "README tour", "README.md", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=lambda s: print(s, end=""))
    assert result.attempted >= 8 and result.failed == 0
    # Each kvtierctl command of the tour answers, with the README's header row.
    commands = re.findall(r"^\$ build/bin/kvtierctl (.+)\n((?:(?!\$ |```).*\n)*)", section,
                          re.M)
    assert len(commands) >= 4
    sessions = subprocess.run([str(BIN / "kvtierctl"), "--addr", daemon.address, "-o", "json",
                               "sessions"], capture_output=True, text=True, check=True).stdout
    sid = re.search(r'"session_id": "([^"]+)"', sessions).group(1)
    for args, shown in commands:
        argv = re.sub(r"s-1-[0-9a-f]+", sid, args).split()
        out = subprocess.run([str(BIN / "kvtierctl"), "--addr", daemon.address, *argv],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (args, out.stderr)
        if shown.strip() and not argv[0].startswith("-o"):
            assert out.stdout.splitlines()[0].split() == shown.splitlines()[0].split(), \
                (args, out.stdout)
