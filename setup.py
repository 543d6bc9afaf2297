"""Build glue: compiles the C++ runtime (CMake) into python/tvm_spinn/lib/libtvm_spinn.so.

Package metadata lives in pyproject.toml; this file only adds the CMake-driven build_ext.

The library is always written into the source tree (python/tvm_spinn/lib), so editable
installs (`pip install -e .`) import it directly, and copied into build_lib for wheels.

Environment knobs:
  TVM_SPINN_BUILD_TYPE   CMake build type (default Release)
  TVM_SPINN_VERBOSE=1    stream CMake/compiler output instead of showing it only on failure
  TVM_SPINN_CMAKE_ARGS   extra arguments for the CMake configure step (shell-split)
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_NAME = "libtvm_spinn.so"
LIB_SOURCE_DIR = ROOT / "python" / "tvm_spinn" / "lib"


class CMakeExtension(Extension):
    """A shared library produced by the top-level CMake project (not a CPython extension)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _tool(name: str, module: str) -> str | None:
    """Path of `name`, from PATH or from its PyPI wrapper package (cmake / ninja wheels)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        mod = __import__(module)
        bin_dir = getattr(mod, "BIN_DIR", None) or getattr(mod, "CMAKE_BIN_DIR", None)
        candidate = Path(bin_dir, name) if bin_dir else None
        return str(candidate) if candidate and candidate.exists() else None
    except ImportError:
        return None


def _tvm_ffi_cmake_dir() -> str:
    try:
        from tvm_ffi import libinfo  # build requirement (pyproject.toml)

        return str(libinfo.find_cmake_path())
    except Exception:  # fall back to the console script of the same package
        config = shutil.which("tvm-ffi-config")
        if not config:
            raise RuntimeError(
                "apache-tvm-ffi is required to build tvm-spinn: "
                "pip install apache-tvm-ffi==0.1.14.post1"
            ) from None
        return subprocess.check_output([config, "--cmakedir"], text=True).strip()


def _run(cmd: list[str], cwd: Path, verbose: bool) -> None:
    if verbose:
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, cwd=cwd, check=True)
        return
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}\n")
        raise subprocess.CalledProcessError(proc.returncode, cmd)


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # Plain "libtvm_spinn.so", without the CPython ABI suffix. setuptools asks both with the
        # dotted full name and with its last component only (get_ext_fullpath).
        for ext in self.extensions:
            if isinstance(ext, CMakeExtension) and fullname in (ext.name, ext.name.split(".")[-1]):
                return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        verbose = os.environ.get("TVM_SPINN_VERBOSE", "0") not in ("", "0") or self.verbose > 1
        build_type = os.environ.get("TVM_SPINN_BUILD_TYPE", "Release")
        cmake = _tool("cmake", "cmake")
        if cmake is None:
            raise RuntimeError("cmake not found: pip install cmake")
        ninja = _tool("ninja", "ninja")
        tvm_ffi_dir = _tvm_ffi_cmake_dir()

        # Persistent build tree (fast rebuilds) that is wiped when the toolchain changes, e.g.
        # between pip's isolated build environments, whose paths the CMake cache would keep.
        tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        build_dir = ROOT / "build" / f"cmake.{tag}"
        fingerprint = json.dumps(
            {
                "python": sys.executable,
                "tvm_ffi_dir": tvm_ffi_dir,
                "cmake": cmake,
                "ninja": ninja,
                "build_type": build_type,
                "extra": os.environ.get("TVM_SPINN_CMAKE_ARGS", ""),
            },
            sort_keys=True,
        )
        stamp = build_dir / "tvm_spinn_fingerprint.json"
        if build_dir.exists() and (not stamp.exists() or stamp.read_text() != fingerprint):
            shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)

        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dtvm_ffi_DIR={tvm_ffi_dir}",
            f"-DTVM_SPINN_LIB_OUTPUT_DIR={LIB_SOURCE_DIR}",
        ]
        if ninja:
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        configure += shlex.split(os.environ.get("TVM_SPINN_CMAKE_ARGS", ""))
        jobs = str(self.parallel or os.cpu_count() or 1)

        print(f"tvm-spinn: building {LIB_NAME} ({build_type}) in {build_dir}", flush=True)
        _run(configure, ROOT, verbose)  # re-running it is cheap and picks up CMakeLists edits
        stamp.write_text(fingerprint)
        _run([cmake, "--build", str(build_dir), "--parallel", jobs], ROOT, verbose)

        built = LIB_SOURCE_DIR / LIB_NAME
        if not built.is_file():
            raise RuntimeError(f"CMake finished but {built} was not produced")
        dest = Path(self.get_ext_fullpath(ext.name))
        if dest.resolve() != built.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, dest)
        print(f"tvm-spinn: built {built}", flush=True)


setup(
    ext_modules=[CMakeExtension("tvm_spinn.lib.libtvm_spinn")],
    cmdclass={"build_ext": CMakeBuild},
)
