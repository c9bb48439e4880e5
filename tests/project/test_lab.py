"""`make lab LAB_ARGS=--no-browser` really serves the course (JupyterLab, chapter 00 reachable)."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpucourse import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "jupyter").exists(), reason="needs the make-built .venv")
def test_make_lab_serves_chapter_00():
    port, token = free_port(), "gpucourse-test-token"
    args = f"--no-browser --port={port} --IdentityProvider.token={token}"
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/contents/notebooks/00_setup.ipynb?content=0"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=5) as resp:
                    model = json.load(resp)
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "JupyterLab did not come up within 90 s"
                time.sleep(0.5)
        assert model["name"] == "00_setup.ipynb" and model["type"] == "notebook"
        # the file browser is rooted at the course, so exercises/ is reachable too
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/exercises?content=1",
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            names = [c["name"] for c in json.load(resp)["content"]]
        assert "00_setup_exercises.ipynb" in names
        # and the lab opens on chapter 00
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?token={token}", timeout=10) as resp:
            assert resp.status == 200 and b"JupyterLab" in resp.read()
            assert "/lab/tree/notebooks/00_setup.ipynb" in resp.url
        # the course's lab settings are in force: no news pop-up ("Would you like to receive
        # official Jupyter news?"), no update check (lab/settings/overrides.json changes the defaults)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification",
            headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            props = json.load(resp)["schema"]["properties"]
        assert props["fetchNews"]["default"] == "false"
        assert props["checkForUpdates"]["default"] is False
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
