"""Builds meshd's one C extension, the GGUF block matmuls (meshd/shard/_blocks.c).

The extension is optional: where it cannot be compiled, meshd installs without it and the native
lane runs torch's int4 kernel instead (a different recipe layout, so such peers never share a route).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "meshd.shard._blocks", ["meshd/shard/_blocks.c"], depends=["meshd/shard/_blocks_avx512.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"],
    extra_link_args=["-pthread"], optional=True)])
