"""Builds the optional CPU kernel (specjax/quant/cpu/qmatmul.cc, a jax.ffi custom call); everything else is in
pyproject.toml. The kernel is compiled for the machine that installs it (-march=native); where it can't be built the
install goes on and specjax.quant.cpu_kernel.available() is False, with the reason."""

import importlib.util
import pathlib

from setuptools import Extension, setup


def ffi_include() -> list[str]:
  """jaxlib's XLA FFI headers (what jax.ffi.include_dir() returns), found without importing jax."""
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    return []
  return [str(pathlib.Path(next(iter(spec.submodule_search_locations))) / 'include')]


setup(
    ext_modules=[
        Extension(
            'specjax.quant._qmatmul_cpu',
            sources=['specjax/quant/cpu/qmatmul.cc'],
            include_dirs=ffi_include(),
            language='c++',
            extra_compile_args=['-std=c++17', '-O3', '-march=native', '-fno-math-errno', '-ffp-contract=off', '-w'],
            optional=True,
        )
    ]
)
