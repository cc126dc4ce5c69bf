"""Build the native CPU kernels (cpu_ops.cpp, quantized_linear.cpp, decode_layers.cpp) once per machine, cache the
library, load it as torch.ops.meshserve_cpu.

The library is compiled for the vector ISA torch itself runs with here (AVX512, with or without AVX512-BF16,
AVX2, or portable code), so it is built where it runs: by `make install`, by the images' build step, or by the
first worker that needs it.
A build runs under an flock (released if its process dies) in a private directory, and the finished library
is renamed into place, so concurrent workers never load a half-written file or wait on a stale lock.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import structlog
import torch

KERNEL_DIR = Path(__file__).parent
# The library's translation units, and the header they share (it keys the cache too).
SOURCES = (KERNEL_DIR / "cpu_ops.cpp", KERNEL_DIR / "quantized_linear.cpp", KERNEL_DIR / "decode_layers.cpp")
HEADERS = (KERNEL_DIR / "cpu_common.h",)
NAMESPACE = "meshserve_cpu"
LIBRARY_NAME = "meshserve_cpu_ops"
CACHE_DIR_ENV = "MESHSERVE_KERNEL_CACHE_DIR"

# Build macros and compiler flags per torch CPU capability, as torch's inductor uses them for at::vec.
_X86_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
# On an AVX512 CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later EPYCs) the
# prefill attention takes its bf16 dot products (vdpbf16ps); the build is its own ISA, cached apart. Every such
# CPU has AVX512-VNNI too, which the int8 tile kernel's integer products take (vpdpwssd).
_AVX512_BF16_FLAGS = ["-mavx512bf16", "-mavx512vnni"]
# With AMX tiles too (Sapphire Rapids and later Xeons) the prefill attention multiplies on the tiles.
_AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]
_BASE_FLAGS = ["-O3", "-fopenmp"]

log = structlog.get_logger()


class KernelBuildError(RuntimeError):
    """The native kernels could not be built or loaded; the message says why."""


def default_cache_dir() -> Path:
    """$MESHSERVE_KERNEL_CACHE_DIR, else ~/.cache/meshserve/kernels."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshserve" / "kernels"


# The builds whose half_linear has the vdpbf16ps path (the AMX build has the tile path besides).
BF16_DOT_BUILDS = ("avx512_bf16", "avx512_amx")


def isa() -> tuple[str, list[str]]:
    """(name, compiler flags) of the vector ISA to build for: torch's own capability on x86, portable elsewhere."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability not in _X86_ISA_FLAGS:
        return "portable", []
    if capability == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        if torch.cpu._is_amx_tile_supported() and _compiler_accepts(tuple(_AMX_FLAGS)):
            return "avx512_amx", _X86_ISA_FLAGS[capability] + _AVX512_BF16_FLAGS + _AMX_FLAGS
        return "avx512_bf16", _X86_ISA_FLAGS[capability] + _AVX512_BF16_FLAGS
    return capability.lower(), _X86_ISA_FLAGS[capability]


@functools.cache
def _compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler torch builds with takes these flags: GCC before 11 and clang before 12 know no
    -mamx-tile, and an AMX host with one of them still gets the avx512_bf16 build rather than none."""
    from torch.utils import cpp_extension

    try:
        probe = subprocess.run(
            [cpp_extension.get_cxx_compiler(), *flags, "-x", "c++", "-fsyntax-only", "-"],
            input=b"int main() { return 0; }\n",
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def library_path(cache_dir: Path | None = None) -> Path:
    """Where the library for this source, torch version and ISA lives in the cache."""
    name, flags = isa()
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + " ".join(_BASE_FLAGS + flags).encode()).hexdigest()[:12]
    key = f"torch{torch.__version__}-{platform.machine()}-{name}-{digest}"
    return (cache_dir or default_cache_dir()) / key / f"{LIBRARY_NAME}.so"


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library into the cache unless it is there; returns its path."""
    target = library_path(cache_dir)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():  # else another process built it while this one waited
                _compile_into(target)
    except OSError as error:
        raise KernelBuildError(
            f"cannot build into the kernel cache {target.parent}: {error}; point {CACHE_DIR_ENV} at a writable "
            "directory"
        ) from error
    return target


def _compile_into(target: Path) -> None:
    from torch.utils import cpp_extension

    _, flags = isa()
    _put_ninja_on_path()
    log.info("cpu_kernels_build", sources=[p.name for p in SOURCES], target=str(target), flags=" ".join(flags))
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as scratch:
        try:
            cpp_extension.load(
                name=LIBRARY_NAME,
                sources=[str(path) for path in SOURCES],
                extra_cflags=_BASE_FLAGS + flags,
                extra_ldflags=["-fopenmp"],
                build_directory=scratch,
                is_python_module=False,
                verbose=False,
            )
        except Exception as error:  # compiler missing, ninja missing, or a compile error
            names = ", ".join(path.name for path in SOURCES)
            raise KernelBuildError(f"building {names} failed: {error}") from error
        os.replace(Path(scratch) / f"{LIBRARY_NAME}.so", target)


def _put_ninja_on_path() -> None:
    """torch's build calls `ninja` from PATH; the venv's (from the `ninja` package) is not on it unless activated."""
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def load(cache_dir: Path | None = None) -> Path:
    """Build if needed and load the library once per process; raises KernelBuildError when that fails."""
    path = build(cache_dir)
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        raise KernelBuildError(f"loading {path} failed: {error}") from error
    return path


def main() -> int:
    """Build the kernels for this machine (`python -m services.worker.kernels.loader`)."""
    try:
        print(build())
    except KernelBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
