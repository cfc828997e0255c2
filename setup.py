"""Builds swapio._C from csrc/ with pybind11 only (no torch headers).

Per-ISA kernels (files named *_avx2.cpp / *_avx512.cpp) get their own -m flags, listed once in
csrc/isa_flags.txt, like ATen's per-capability builds: the rest of the module is built for baseline x86-64,
and the kernel to run is chosen at run time from CPUID, so one wheel runs on any x86-64.
"""
import glob
import hashlib
import os
import platform
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
# SWAPIO_SCALAR_ONLY=1 leaves the per-ISA kernels out (the scalar level serves): the sanitized test build
# uses it, since tests/native/run.sh --sanitize already runs every SIMD level under ASan and UBSan and those
# files take minutes to compile with both.
IS_X86 = platform.machine() in ("x86_64", "AMD64", "i686") and os.environ.get("SWAPIO_SCALAR_ONLY") != "1"
ISA_TABLE = "csrc/isa_flags.txt"  # suffix -> flags, shared with tests/native/run.sh


def read_isa_flags(path=ISA_TABLE):
    table = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), path)) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                table[words[0]] = words[1:]
    return table


ISA_FLAGS = read_isa_flags()


def isa_flags(source):
    for suffix, flags in ISA_FLAGS.items():
        if source.endswith(suffix):
            return flags
    return []


def native_sources():
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not IS_X86:  # per-ISA x86 kernels do not build elsewhere; the scalar path serves
        sources = [s for s in sources if not isa_flags(s)]
    return sources


def _mtime(path):
    return os.stat(path).st_mtime_ns


class BuildExt(build_ext):
    """Adds each source's ISA flags, and compiles incrementally: objects live in a persistent build/obj-<key>
    directory (key: interpreter and compiler flags), and a source is compiled again only when it, a header or
    the ISA table is newer than its object. So building again with nothing changed compiles nothing, also
    through `pip install -e .`, whose own build directory is a new temporary one each time."""

    def finalize_options(self):
        if self.build_temp is None:  # an explicit --build-temp (the sanitizer build) is kept
            key = repr((sys.implementation.cache_tag, platform.machine(), self.distribution.ext_modules[0]
                        .extra_compile_args, self.distribution.ext_modules[0].extra_link_args))
            self.build_temp = os.path.join(ROOT, "build", "obj-" + hashlib.sha256(key.encode()).hexdigest()[:12])
        super().finalize_options()

    def build_extensions(self):
        compile_one = self.compiler._compile
        newest_dependency = max(_mtime(d) for d in self.extensions[0].depends)

        def compile_changed(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if os.path.exists(obj) and _mtime(obj) >= max(_mtime(src), newest_dependency):
                return  # up to date
            compile_one(obj, src, ext, cc_args, list(extra_postargs) + isa_flags(src), pp_opts)

        self.compiler._compile = compile_changed
        super().build_extensions()


extra = os.environ.get("SWAPIO_EXTRA_CFLAGS", "").split()
ext = Pybind11Extension(
    "swapio._C",
    native_sources(),
    include_dirs=["csrc"],
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True)) + [ISA_TABLE],
    cxx_std=17,
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-DSWAPIO_HAVE_X86_KERNELS=%d" % IS_X86] + extra,
    extra_link_args=["-pthread"] + extra,
)

# The sources compile in parallel, one job per CPU (SWAPIO_BUILD_JOBS=N to change it). build_ext's own
# `parallel` option does not do this: it runs *extensions* in parallel, and there is only one. pybind11's
# ParallelCompile replaces CCompiler.compile with one that compiles an extension's sources on a thread pool,
# each through compiler._compile, so the incremental check above still decides per source. It applies to pip's
# isolated builds too, which pass no -j.
with ParallelCompile("SWAPIO_BUILD_JOBS", default=0):
    setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
