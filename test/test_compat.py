"""The installed extension refuses a torch it was not built for, or an untested one."""

import os
import subprocess
import sys
import textwrap
import warnings

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch
from torch_autobatch import _compat
from torch_autobatch._version import TORCH_REQUIREMENT


class TestTorchVersionCheck(TestCase):
    def test_the_running_torch_is_the_one_built_against_and_in_the_window(self):
        from torch_autobatch._build_info import TORCH_VERSION

        self.assertEqual(TORCH_VERSION.split("+")[0], torch.__version__.split("+")[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _compat.check_torch_version(TORCH_VERSION, str(torch.__version__))

    def test_built_against_another_torch_is_an_import_error_naming_both(self):
        with self.assertRaisesRegex(
            ImportError,
            r"built against torch 2\.13\.0\+cpu, but torch 2\.14\.1\+cu130 is running\. .*"
            r"rebuilt against the running torch: pip install --no-build-isolation",
        ):
            _compat.check_torch_version("2.13.0+cpu", "2.14.1+cu130")
        # Even with the untested-torch opt-in: a mismatched build is never loaded.
        with self.assertRaisesRegex(ImportError, "built against torch 2.15.0"):
            _compat.check_torch_version("2.15.0", "2.13.0", allow_untested=True)

    def test_local_build_tags_share_one_release(self):
        _compat.check_torch_version("2.13.0", "2.13.0+cpu")

    def test_not_built_is_an_import_error_with_the_build_command(self):
        with self.assertRaisesRegex(ImportError, "has not been built.*--no-build-isolation"):
            _compat.check_torch_version(None, "2.13.0")

    def test_outside_the_window_is_an_import_error_unless_allowed(self):
        for version in ("2.12.1", "2.16.0", "3.0.0"):
            with self.assertRaisesRegex(
                ImportError,
                f"tested with {TORCH_REQUIREMENT}, but torch {version} is running.*"
                f"TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH=1",
            ):
                _compat.check_torch_version(version, version)
            with self.assertWarnsRegex(torch_autobatch.UntestedTorchWarning, f"but torch {version} is running"):
                _compat.check_torch_version(version, version, allow_untested=True)

    def _import_with_torch_version(
        self, version: str, allow: bool, built_for: bool = True
    ) -> subprocess.CompletedProcess:
        """Imports torch_autobatch in a fresh process whose torch claims ``version``.

        ``built_for``: the extension also claims to be built for it.
        """
        code = textwrap.dedent(f"""\
            import sys, types, warnings, torch
            torch.__version__ = {version!r}
            if {built_for!r}:
                info = types.ModuleType("torch_autobatch._build_info")
                info.TORCH_VERSION = {version!r}
                sys.modules[info.__name__] = info
            warnings.simplefilter("always")
            import torch_autobatch
            print("imported", torch_autobatch.custom_op.__name__)
        """)
        env = dict(os.environ)
        env.pop(_compat.ALLOW_UNTESTED_ENV, None)
        if allow:
            env[_compat.ALLOW_UNTESTED_ENV] = "1"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)

    def test_importing_with_another_torch_than_built_against(self):
        # A release inside the window that is no real build's.
        refused = self._import_with_torch_version("2.14.99", allow=True, built_for=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("but torch 2.14.99 is running", refused.stderr)
        self.assertIn("ImportError: torch_autobatch was built against torch", refused.stderr)

    def test_importing_on_an_untested_torch(self):
        refused = self._import_with_torch_version("2.99.0", allow=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("ImportError: torch_autobatch is tested with", refused.stderr)
        allowed = self._import_with_torch_version("2.99.0", allow=True)
        self.assertEqual(allowed.returncode, 0, allowed.stderr)
        self.assertIn("UntestedTorchWarning", allowed.stderr)
        self.assertIn("imported custom_op", allowed.stdout)


if __name__ == "__main__":
    run_tests()
