"""The C++ kernels' build lock: held across processes, released by the operating system when its holder dies
(however it dies), and clearing the lock file torch leaves behind when a build is killed, on which every later
build would otherwise wait forever."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvcompress import kernels
from kvcompress.kernels.__main__ import main as build_main

HOLD = """
import sys, time
from pathlib import Path
from kvcompress.kernels import build_lock
with build_lock(Path(sys.argv[1]), "test"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_file_left_by_a_killed_torch_build_is_cleared(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with kernels.build_lock(tmp_path, "test", wait_s=1):
        assert not (tmp_path / "lock").exists()


def test_a_live_holder_makes_others_wait_and_a_killed_one_releases_at_once(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = r"another process has held the build of k .* for 0 s"
        with pytest.raises(TimeoutError, match=held), kernels.build_lock(tmp_path, "k", wait_s=0.3):
            pass
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    with kernels.build_lock(tmp_path, "k", wait_s=5):
        assert time.monotonic() - start < 2  # the dead holder's lock went with it


def test_the_build_command_refuses_an_unknown_build_by_name(capsys):
    assert build_main(["avx2"]) == 2
    assert "unknown build ['avx2']; allowed: ['native', 'portable']" in capsys.readouterr().err
