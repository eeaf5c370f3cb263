"""The Python client as a user installs it: `pip install ./client/python` into a clean virtual
environment (the stubs generated at build time), then used from outside the source tree."""
import subprocess
import sys
import textwrap

from conftest import ROOT


def test_pip_install_in_a_clean_venv_imports_and_talks(daemon, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(ROOT / "client" / "python")],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-4000:]
    script = textwrap.dedent(f"""
        import pathlib, sys
        import kvtier, kvtier.v1.kvtier_pb2 as pb
        assert "site-packages" in kvtier.__file__, kvtier.__file__   # not the source tree
        pkg = pathlib.Path(kvtier.__file__).parent
        assert (pkg / "py.typed").exists() and (pkg / "v1" / "kvtier_pb2.pyi").exists()
        c = kvtier.Client({daemon.address!r})
        sid = c.create_session(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8).session_id
        print(sid, c.health())
    """)
    # Run from an empty directory, so that nothing of the repository is on sys.path.
    run = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    sid, serving = run.stdout.split()
    assert sid and serving == "True"
