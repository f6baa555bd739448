"""Ships csrc/ for the first-use (JIT) build; builds cpu_adam._C when CPU_ADAM_BUILD=1."""

import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def build_description():
    spec = importlib.util.spec_from_file_location("cpu_adam_build", ROOT / "cpu_adam" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ahead_of_time_build() -> dict:
    if os.environ.get("CPU_ADAM_BUILD") != "1":
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    build = build_description()
    sources = [str(p.relative_to(ROOT)) for p in build.source_paths(ROOT / "csrc")]
    extension = CppExtension(
        "cpu_adam._C", sources, extra_compile_args=list(build.CXX_FLAGS), extra_link_args=list(build.LINK_FLAGS)
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(
    # Every subpackage (offload, plan), found rather than listed, so that a new one cannot be left out of the wheel.
    packages=[*find_packages(include=["cpu_adam", "cpu_adam.*"]), "cpu_adam.csrc"],
    package_dir={"cpu_adam.csrc": "csrc"},
    package_data={"cpu_adam.csrc": ["*.cpp", "*.h", "kernels/*.cpp", "kernels/*.h"]},
    **ahead_of_time_build(),
)
