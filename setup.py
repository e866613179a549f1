"""Build torch_autobatch and its C++ extension ``torch_autobatch._C``.

Install without build isolation so the extension compiles against the torch
already installed (a build-isolated install would fetch a multi-GB CUDA torch)::

    pip install torch==2.13.0
    pip install --no-build-isolation -e .
"""

from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
CXX_FLAGS = ["-O2", "-std=c++17", "-fvisibility=hidden", "-Wno-unused-parameter"]
print(f"torch_autobatch: building {SOURCES} with {CXX_FLAGS}")

setup(
    name="torch_autobatch",
    version="0.1.0",
    description="Python custom operators that work under every torch.func transform",
    packages=find_packages(include=["torch_autobatch", "torch_autobatch.*"]),
    ext_modules=[
        CppExtension(
            "torch_autobatch._C",
            SOURCES,
            include_dirs=[str(ROOT / "csrc"), str(ROOT / "csrc" / "shim")],
            extra_compile_args={"cxx": CXX_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    install_requires=["torch==2.13.0"],
    python_requires=">=3.10",
)
