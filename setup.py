"""Builds meshd's one C extension, the GGUF block matmuls (meshd/shard/_blocks.c, one unit that
includes its parts: the header and the `_blocks_*.c` files beside it).

The extension is optional: where it cannot be compiled, meshd installs without it and the native
lane runs torch's int4 kernel instead (a different recipe layout, so such peers never share a route).
"""

import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "meshd.shard._blocks", ["meshd/shard/_blocks.c"], depends=sorted(glob.glob("meshd/shard/_blocks*.[ch]")),
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"],
    extra_link_args=["-pthread"], optional=True)])
