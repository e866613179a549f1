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
import warnings
from pathlib import Path

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
CXX_FLAGS = ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O2"]
CXX_FLAGS += ["-fvisibility=hidden", "-Wno-unused-parameter"]
BUILD_INFO = ROOT / "torch_autobatch" / "_build_info.py"

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
    """Builds the extension and records which torch it was compiled against."""

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
            extra_compile_args={"cxx": CXX_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildWithInfo},
    install_requires=[VERSION["TORCH_REQUIREMENT"]],
    python_requires=">=3.11",  # the Python CI runs
)
