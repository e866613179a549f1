"""Build torch_autobatch and its C++ extension ``torch_autobatch._C``.

Install without build isolation so the extension compiles against the torch
already installed (a build-isolated install would fetch a multi-GB CUDA torch)::

    pip install torch==2.13.0
    pip install --no-build-isolation -e .

The C++ standard and the other flags torch's headers need come from
``torch.utils.cpp_extension`` (C++20 for torch 2.13 and later), never from here.
The build records the torch it compiled against in
``torch_autobatch/_build_info.py``; importing the package with any other torch
refuses to load the extension (NOTE [Supported torch window]).
"""

import os
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from setuptools import find_packages, setup
from torch.torch_version import TorchVersion
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
VERSION = runpy.run_path(str(ROOT / "torch_autobatch" / "_version.py"))
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
# DEBUG=1 pip install --no-build-isolation -e .  builds for a debugger or valgrind:
# no optimisation, full debug info, assertions on (the last -O and -U win over
# Python's own -O3 -DNDEBUG).
DEBUG = os.environ.get("DEBUG", "0") not in ("", "0")
# NOTE [No debug info by default]
# Python's own compile flags (sysconfig's CFLAGS, which setuptools puts first)
# carry -g: debug info for torch's template-heavy headers took ~35% of each
# translation unit's compile time and 96% of its object's size (26 s against
# 16 s, 12 MB against 0.5 MB for grad_node.cpp on 2 cores). A release build
# drops it (-g0, after Python's -g, wins); DEBUG=1 keeps it.
CXX_FLAGS = ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O2", "-g0"]
CXX_FLAGS += ["-fvisibility=hidden", "-Wno-unused-parameter"]
# ASAN=1: AddressSanitizer in our extension (tools/test_with_asan.sh runs the
# suite with it; torch's own libraries stay uninstrumented).
ASAN = os.environ.get("ASAN", "0") not in ("", "0")
SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer"] if ASAN else []
BUILD_INFO = ROOT / "torch_autobatch" / "_build_info.py"
# NOTE [A persistent build directory]
# pip builds an editable install in a fresh temporary directory each time, so
# every `pip install --no-build-isolation -e .` compiled all of csrc/ again
# (minutes on 2 cores), also when nothing changed. The objects (and torch's
# build.ninja) go instead to BUILD_DIR, a fixed directory under the project
# root (ignored by git), one per Python, torch and build type, so that the
# objects of one torch or of DEBUG=1 are never linked with another's. ninja
# then recompiles only the objects whose inputs changed (the source, a header
# it includes, the compile command), and the link runs only when an object is
# newer than the library. For an in-place build (editable install, build_ext
# --inplace) the linked library is kept there too, then copied into the
# package only when it differs, by rename, so a process that has the old one
# loaded keeps it intact; a regular wheel build keeps setuptools' build_lib,
# which its install step reads. `rm -rf build` starts from scratch.
BUILD_TYPE = ("debug" if DEBUG else "release") + ("-asan" if ASAN else "")
BUILD_DIR = ROOT / "build" / f"{sys.implementation.cache_tag}-torch-{torch.__version__}-{BUILD_TYPE}"

torch_version = TorchVersion(torch.__version__)
if not VERSION["TORCH_MIN"] <= torch_version < VERSION["TORCH_END"]:
    warnings.warn(
        f"torch_autobatch: building against torch {torch_version}, outside the tested "
        f"window {VERSION['TORCH_REQUIREMENT']}. The build may fail, and the package "
        f"will refuse to import unless TORCH_AUTOBATCH_ALLOW_UNTESTED_TORCH=1.",
        stacklevel=1,
    )
print(f"torch_autobatch: building {SOURCES} against torch {torch_version} with {CXX_FLAGS}")


class BuildWithInfo(BuildExtension):
    """Builds the extension in BUILD_DIR and records which torch it was compiled against."""

    def finalize_options(self) -> None:
        # Before build's own (temporary, for an editable install) directories
        # are taken: NOTE [A persistent build directory].
        self.build_temp = str(BUILD_DIR / "temp")
        if self.editable_mode or self.inplace:
            self.build_lib = str(BUILD_DIR / "lib")
        super().finalize_options()

    def build_extensions(self) -> None:
        # torch forces every step so that ninja decides what to compile; the
        # link needs no forcing: it runs when an object is newer than the library.
        self.compiler.force = False
        super().build_extensions()

    def copy_file(self, infile: str, outfile: str, *args: Any, **kwargs: Any) -> tuple[str, bool]:
        """Copies the built library into the package: not if unchanged, else by rename."""
        if self.dry_run:
            return super().copy_file(infile, outfile, *args, **kwargs)
        try:
            src, dst = os.stat(infile), os.stat(outfile)
            if (src.st_size, int(src.st_mtime)) == (dst.st_size, int(dst.st_mtime)):
                return outfile, False  # the copy keeps the library's mtime (preserve_times)
        except OSError:
            pass  # no library there yet
        partial = f"{outfile}.{os.getpid()}.tmp"
        _, copied = super().copy_file(infile, partial, *args, **kwargs)
        os.replace(partial, outfile)
        return outfile, copied

    def run(self) -> None:
        super().run()
        text = (
            '"""Written by setup.py when the C++ extension is built; do not edit."""\n\n'
            f"TORCH_VERSION = {str(torch.__version__)!r}\n"
        )
        for target in {BUILD_INFO, Path(self.build_lib) / "torch_autobatch" / "_build_info.py"}:
            if target.parent.is_dir():
                target.write_text(text)


setup(
    name="torch_autobatch",
    version=VERSION["__version__"],
    description="Python custom operators that work under every torch.func transform",
    packages=find_packages(include=["torch_autobatch", "torch_autobatch.*"]),
    package_data={"torch_autobatch": ["py.typed", "_C.pyi"]},
    ext_modules=[
        CppExtension(
            "torch_autobatch._C",
            SOURCES,
            include_dirs=[str(ROOT / "csrc"), str(ROOT / "csrc" / "shim")],
            extra_compile_args={"cxx": CXX_FLAGS + SANITIZE},
            extra_link_args=SANITIZE,
        )
    ],
    cmdclass={"build_ext": BuildWithInfo},
    install_requires=[VERSION["TORCH_REQUIREMENT"]],
    python_requires=">=3.11",  # the Python CI runs
)
