"""A second ``pip install -e .`` reuses the first's build (issue 33, item 11).

NOTE [A persistent build directory] (setup.py): pip hands an editable build a
fresh temporary build directory each time, so every install compiled csrc/
again. The checks run setup.py's ``build_ext`` command the way pip's editable
build configures it (``build``'s directories set to temporary ones, editable
mode on), in a fresh process, without compiling anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = Path(__file__).resolve().parent.parent

# Loads setup.py with setuptools.setup() captured, then finalizes its build_ext
# as setuptools' editable_wheel does; SNIPPET then runs with ``cmd`` in scope.
_SCRIPT = """
import json, os, runpy, sys, tempfile
import setuptools
captured = {}
setuptools.setup = lambda **kwargs: captured.update(kwargs)
runpy.run_path("setup.py", run_name="setup")
dist = setuptools.Distribution(captured)
build = dist.get_command_obj("build")
build.build_temp, build.build_lib = tempfile.mkdtemp(), tempfile.mkdtemp()  # as pip's editable build
cmd = dist.get_command_obj("build_ext")
cmd.editable_mode = True
cmd.ensure_finalized()
result = {"build_temp": os.path.abspath(cmd.build_temp), "build_lib": os.path.abspath(cmd.build_lib)}
SNIPPET
print(json.dumps(result))
"""


def _run_setup(snippet: str = "", **env: str) -> dict[str, Any]:
    script = _SCRIPT.replace("SNIPPET", textwrap.dedent(snippet))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


class TestPersistentBuild(TestCase):
    def test_editable_build_directories_are_fixed_under_the_project(self):
        release = _run_setup(DEBUG="0")
        self.assertEqual(_run_setup(DEBUG="0"), release)  # the same directories on every install
        debug = _run_setup(DEBUG="1")
        for dirs in (release, debug):
            for path in dirs.values():
                self.assertTrue(Path(path).is_relative_to(ROOT / "build"), path)
        # A debug build never links a release build's objects, nor the reverse.
        self.assertNotEqual(debug["build_temp"], release["build_temp"])
        if shutil.which("git") and (ROOT / ".git").exists():
            ignored = subprocess.run(["git", "check-ignore", "-q", release["build_temp"]], cwd=ROOT)
            self.assertEqual(ignored.returncode, 0, "build/ is not ignored by git")

    def test_an_unchanged_library_is_not_copied_and_a_new_one_is_renamed_in(self):
        snippet = """
            d = tempfile.mkdtemp()
            built, installed = os.path.join(d, "built.so"), os.path.join(d, "installed.so")
            open(built, "wb").write(b"one")
            first = cmd.copy_file(built, installed)[1]
            inode = os.stat(installed).st_ino
            second = cmd.copy_file(built, installed)[1]
            open(built, "wb").write(b"two!")
            os.utime(built, (os.stat(built).st_atime, os.stat(installed).st_mtime + 5))
            third = cmd.copy_file(built, installed)[1]
            result["copied"] = [first, second, third]
            result["renamed"] = os.stat(installed).st_ino != inode
            result["content"] = open(installed, "rb").read().decode()
            result["left"] = sorted(os.listdir(d))
        """
        result = _run_setup(snippet)
        self.assertEqual(result["copied"], [True, False, True])
        self.assertTrue(result["renamed"])  # a process that loaded the old library keeps it
        self.assertEqual(result["content"], "two!")
        self.assertEqual(result["left"], ["built.so", "installed.so"])


if __name__ == "__main__":
    run_tests()
