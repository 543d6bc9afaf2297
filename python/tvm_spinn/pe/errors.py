"""The errors of PE code generation and of the instruction-set simulator."""

from __future__ import annotations

__all__ = ["PeCodegenError", "IssFault", "NocDeadlock"]


class PeCodegenError(ValueError):
    """A layer the PE code generator cannot lower (its name, kind and the reason).

    Raised at build time: a program is never run half in generated code, half interpreted."""

    def __init__(self, layer: str, kind: str, reason: str):
        self.layer, self.kind, self.reason = layer, kind, reason
        super().__init__(f"layer {layer} ({kind}): cannot generate PE code: {reason}")


class IssFault(RuntimeError):
    """An image that faulted in the instruction-set simulator (bad address, undefined
    instruction, runaway loop): the PE, the image and the program counter."""

    def __init__(self, pe: int, image: str, pc: int, what: str):
        self.pe, self.image, self.pc, self.what = pe, image, pc, what
        super().__init__(f"PE {pe}, image {image}: {what} at pc=0x{pc:08x}")


class NocDeadlock(RuntimeError):
    """PEs running concurrently that all wait for NoC packets none of them will send: ``waits``
    maps each waiting PE to what it waits for."""

    def __init__(self, waits: dict):
        self.waits = dict(sorted(waits.items()))
        lines = "; ".join(f"PE {pe}: {what}" for pe, what in self.waits.items())
        super().__init__(f"NoC deadlock: every running PE waits on an empty RX FIFO ({lines})")
