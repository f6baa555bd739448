# Sourced by tests/kernels/run.sh and tests/arm/run.sh, from the repository root: the flags and
# torch-free sources of the real build, read from cpu_adam/_build.py, the one place they live
# (less OpenMP: the kernels have no parallel code, and the drivers run on one thread).
# Sets the arrays `flags` and `sources`.
{
  read -r -a flags
  read -r -a sources
} < <(python3 - << 'PY'
import importlib.util
spec = importlib.util.spec_from_file_location("build", "cpu_adam/_build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
print(" ".join(f for f in build.CXX_FLAGS if f != "-fopenmp"))
print(" ".join("csrc/" + s for s in build.SOURCES if s not in ("ops.cpp", "checks.cpp", "norms.cpp")))  # these need torch
PY
)
