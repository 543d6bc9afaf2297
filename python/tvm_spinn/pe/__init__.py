"""Code for the PEs: the layers of a spinn program as Cortex-M4F machine code, and an
instruction-set simulator that runs it.

- :mod:`.kernels`: the per-role kernels as TIR, lowered by TVM's LLVM (``thumbv7em``, FPv4-SP,
  hard float) to objects;
- :mod:`.runtime`, :mod:`.link`: the PE runtime (start-up, job loop, MAC array driver) and the
  link into one ELF image per role with the ``ziglang`` wheel's ``ld.lld``;
- :mod:`.roles`, :mod:`.images`: which kernel each layer runs, the images of a program;
- :mod:`.iss`, :mod:`.execute`: ``unicorn`` running the images with the MAC array as a modelled
  peripheral (:func:`run_program_iss`);
- :mod:`.firmware`, :mod:`.jobs`: the images, a manifest and every PE's job table (data
  placement, DMA descriptors, argument words, schedule) written to a directory
  (:func:`export_firmware`), read back and checked (:func:`load_firmware`);
- :mod:`.loader`: a reference host loader that runs a firmware directory alone in the ISS
  (:func:`run_firmware`);
- :mod:`.noc`, :mod:`.multi`: the runtime's NoC driver and barrier, and a region's PEs run
  concurrently with the jobs' dependencies carried by NoC packets (:func:`run_firmware_concurrent`);
- :mod:`.cycles`: executed instructions priced by the Cortex-M4 TRM's cycle tables;
- :mod:`.memory_map`, :mod:`.view`, :mod:`.errors`: addresses, the program accessors, errors.
"""

from .errors import IssFault, NocDeadlock, PeCodegenError
from .firmware import Firmware, FirmwareError, export_firmware, load_firmware
from .images import PeImage, ProgramImages, build_images
from .loader import run_firmware
from .multi import ConcurrentRun, NocFabric, run_barrier, run_firmware_concurrent

__all__ = ["Firmware", "FirmwareError", "export_firmware", "load_firmware", "IssFault", "PeCodegenError", "TileRun",
           "run_program_iss", "run_firmware", "run_firmware_concurrent", "run_barrier", "NocFabric",
           "ConcurrentRun", "NocDeadlock", "PeImage", "ProgramImages", "build_images"]


def __getattr__(name: str):
    # the iss execution (:mod:`.execute`) is imported when first used, so a host loader
    # (:mod:`.loader`) runs a firmware directory without it
    if name in ("TileRun", "run_program_iss"):
        from . import execute
        return getattr(execute, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
