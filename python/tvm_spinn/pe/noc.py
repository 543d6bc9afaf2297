"""The PE runtime's NoC driver and barrier, and the images that link them.

Written in C (:data:`NOC_C`), compiled for the Cortex-M4F like :mod:`.runtime` and linked into a
role's image after the runtime and the kernel (:func:`~.images.noc_role_image`), so the kernel's code keeps
its addresses; images without the NoC (:func:`~.images.role_image`) do not contain it. The
registers are :data:`~.memory_map.NOC_REGS`. Routines (AAPCS calls, returning to their caller):

- ``pe_noc_send(dest, key, payload)``: one packet to PE ``dest`` (or, with
  :data:`~.memory_map.NOC_MULTICAST` in ``dest``, routed by its key);
- ``pe_noc_recv(&payload, &source)``: the oldest received packet's key, its payload and sending
  PE; the wait for one is bounded: after :data:`~.memory_map.NOC_WAIT_POLLS` polls of an empty
  RX FIFO the driver reports a timeout through the FAULT register (a fault, never a hang);
- ``pe_noc_wait_ready(pairs, n)``: a job's dependencies: for each of ``n`` ``(slot, count)``
  word pairs, receives ready packets until ``count`` have arrived from the PE of that slot
  (counted per slot in the NoC state, :data:`~.memory_map.NOC_STATE_ADDR`, which outlives the
  job and the image: a packet for a later job is counted, not lost);
- ``pe_noc_send_words(dest, key0, src, n)``: ``n`` data packets (key ``key0 + i``, payload
  ``src[i]``): ``key0`` is ``NOC_KEY_DATA``, the sender's slot in bits 16-23 and the first of the
  receiver's mailbox words (:data:`~.memory_map.NOC_MAILBOX_ADDR`) in bits 0-15;
  ``pe_noc_wait_ready`` stores a data packet's word in the mailbox and counts it as a packet
  from its sender, like a ready packet;
- ``pe_noc_notify(dests, n, job, slot)``: one ready packet (key ``NOC_KEY_READY | job``,
  payload the sender's slot) to each of ``n`` PEs;
- ``pe_barrier(parent, children, group)``: a barrier over a tree of PEs (the host's static
  schedule gives each PE its parent and its number of children): a PE polls the receive count
  until its ``children`` arrival packets (``NOC_KEY_ARRIVE | group``) are all in, popping them
  unread four at a time while more are due (the static schedule sends a counting PE nothing
  else while it is in the barrier; no per-packet call, no register read per packet); then,
  unless it is the root (its own parent), it sends one to its parent (payload its PE id), pops
  the rest and waits for the release, whose key it checks; the root sends one release packet
  (``NOC_KEY_RELEASE | group``) by multicast, routed by the router's table to every other PE
  of the barrier, and pops the rest. The timing model's barrier
  (:meth:`~tvm_spinn.target.arch.SpinnArch.barrier_cost_cycles`) is this code's path.
"""

from __future__ import annotations

import functools
import os
import tempfile

from .memory_map import (NOC_BASE, NOC_FAULT_MAILBOX, NOC_FAULT_SLOT, NOC_FAULT_TIMEOUT, NOC_FAULT_UNEXPECTED,
                         NOC_KEY_ARRIVE, NOC_KEY_DATA, NOC_KEY_READY, NOC_KEY_RELEASE, NOC_MAILBOX_ADDR,
                         NOC_MAILBOX_WORDS, NOC_MULTICAST, NOC_REGS, NOC_STATE_ADDR, NOC_STATE_WORDS, NOC_WAIT_POLLS)
from .runtime import CC_FLAGS, zig

__all__ = ["NOC_C", "NOC_ROUTINES", "noc_object", "link_noc_image"]

#: The routines a NoC image keeps (the linker's roots beside ``_start``).
NOC_ROUTINES = ("pe_noc_send", "pe_noc_recv", "pe_noc_wait_ready", "pe_noc_notify", "pe_barrier",
                "pe_noc_send_words")

NOC_C = rf"""
typedef unsigned int u32;

extern void pe_halt(void) __attribute__((noreturn));

#define NOC(reg) (*(volatile u32 *)({NOC_BASE:#x}u + (reg)))
#define KIND_MASK 0xFF000000u

/* An error the driver cannot recover from: the detail word, then the code (the PE stops). */
static void __attribute__((noreturn)) noc_fault(u32 code, u32 detail) {{
    NOC({NOC_REGS["FAULT_DETAIL"]:#x}) = detail;
    NOC({NOC_REGS["FAULT"]:#x}) = code;
    pe_halt();
}}

void pe_noc_send(u32 dest, u32 key, u32 payload) {{
    NOC({NOC_REGS["TX_DEST"]:#x}) = dest;
    NOC({NOC_REGS["TX_KEY"]:#x}) = key;
    NOC({NOC_REGS["TX_SEND"]:#x}) = payload;
}}

/* The oldest packet's key (its payload and sender through the pointers), popped; a bounded
   wait for one. */
u32 pe_noc_recv(u32 *payload, u32 *source) {{
    u32 polls = 0u;
    while (NOC({NOC_REGS["RX_COUNT"]:#x}) == 0u) {{
        if (++polls == {NOC_WAIT_POLLS}u) noc_fault({NOC_FAULT_TIMEOUT}u, polls);
    }}
    u32 key = NOC({NOC_REGS["RX_KEY"]:#x});
    *payload = NOC({NOC_REGS["RX_PAYLOAD"]:#x});
    *source = NOC({NOC_REGS["RX_SOURCE"]:#x});
    NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
    return key;
}}

void pe_noc_wait_ready(const u32 *pairs, u32 n) {{
    volatile u32 *arrived = (volatile u32 *){NOC_STATE_ADDR:#x}u;
    volatile u32 *mailbox = (volatile u32 *){NOC_MAILBOX_ADDR:#x}u;
    for (u32 i = 0u; i < n; i++) {{
        u32 slot = pairs[2u * i], need = pairs[2u * i + 1u];
        while (arrived[slot] < need) {{
            u32 payload, source, from;
            u32 key = pe_noc_recv(&payload, &source);
            if ((key & KIND_MASK) == {NOC_KEY_READY:#x}u) {{
                from = payload;
            }} else if ((key & KIND_MASK) == {NOC_KEY_DATA:#x}u) {{
                if ((key & 0xFFFFu) >= {NOC_MAILBOX_WORDS}u) noc_fault({NOC_FAULT_MAILBOX}u, key);
                mailbox[key & 0xFFFFu] = payload;
                from = (key >> 16) & 0xFFu;
            }} else {{
                noc_fault({NOC_FAULT_UNEXPECTED}u, key);
            }}
            if (from >= {NOC_STATE_WORDS}u) noc_fault({NOC_FAULT_SLOT}u, from);
            arrived[from] += 1u;
        }}
    }}
}}

/* n words from src to PE dest, the i-th with key key0 + i (data packets: the receiver's
   mailbox words from key0's on). */
void pe_noc_send_words(u32 dest, u32 key0, const u32 *src, u32 n) {{
    for (u32 i = 0u; i < n; i++) pe_noc_send(dest, key0 + i, src[i]);
}}

void pe_noc_notify(const u32 *dests, u32 n, u32 job, u32 slot) {{
    for (u32 i = 0u; i < n; i++) pe_noc_send(dests[i], {NOC_KEY_READY:#x}u | job, slot);
}}

/* Wait (bounded, as pe_noc_recv's) until the RX FIFO holds packets; how many it holds. */
static inline u32 noc_rx_wait(void) {{
    u32 polls = 0u, n;
    while ((n = NOC({NOC_REGS["RX_COUNT"]:#x})) == 0u) {{
        if (++polls == {NOC_WAIT_POLLS}u) noc_fault({NOC_FAULT_TIMEOUT}u, polls);
    }}
    return n;
}}

/* n packets popped unread, four a loop turn. */
static inline void noc_pop(u32 n) {{
    _Pragma("clang loop unroll(disable)")
    for (; n >= 4u; n -= 4u) {{
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
    }}
    if (n & 2u) {{
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
    }}
    if (n & 1u) NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
}}

void pe_barrier(u32 parent, u32 children, u32 group) {{
    u32 me = NOC({NOC_REGS["PE_ID"]:#x});
    /* The arrivals are only counted (the static schedule sends a counting PE nothing but its
       children's arrivals while it is in the barrier): the receive count is polled until every
       child's packet is in, the packets popped unread four at a time while more are due, the
       rest after this PE's own packet (the arrival to its parent, or the release) is out. */
    u32 polls = 0u;
    while (children != 0u) {{
        u32 n = NOC({NOC_REGS["RX_COUNT"]:#x});
        if (n >= children) break;
        if (n >= 4u) {{
            NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
            NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
            NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
            NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
            children -= 4u;
        }} else if (++polls == {NOC_WAIT_POLLS}u) {{
            noc_fault({NOC_FAULT_TIMEOUT}u, polls);
        }}
    }}
    if (parent == me) {{
        pe_noc_send({NOC_MULTICAST:#x}u, {NOC_KEY_RELEASE:#x}u | group, 0u);
        noc_pop(children);
    }} else {{
        pe_noc_send(parent, {NOC_KEY_ARRIVE:#x}u | group, me);
        noc_pop(children);
        noc_rx_wait();
        u32 key = NOC({NOC_REGS["RX_KEY"]:#x});
        NOC({NOC_REGS["RX_POP"]:#x}) = 1u;
        if (key != ({NOC_KEY_RELEASE:#x}u | group)) noc_fault({NOC_FAULT_UNEXPECTED}u, key);
    }}
}}
"""


@functools.lru_cache(maxsize=1)
def noc_object() -> bytes:
    """The NoC driver compiled to a Cortex-M4F object (ELF relocatable), built once per process."""
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        src, obj = os.path.join(tmp, "pe_noc.c"), os.path.join(tmp, "pe_noc.o")
        with open(src, "w") as f:
            f.write(NOC_C)
        # no frame pointer: the barrier's path keeps the cycles of setting one up
        zig("cc", *CC_FLAGS, "-fomit-frame-pointer", "-c", src, "-o", obj)
        with open(obj, "rb") as f:
            return f.read()


def link_noc_image(kernel_object: bytes) -> bytes:
    """The ELF image of one PE role with the NoC driver: the runtime, ``kernel_object`` and the
    driver (last, so the kernel's addresses are those of the image without it), linked by the
    script of :mod:`.link` with :data:`NOC_ROUTINES` kept."""
    from .link import LINKER_SCRIPT
    from .runtime import runtime_object
    with tempfile.TemporaryDirectory(prefix="tvm_spinn_pe_") as tmp:
        paths = {}
        for name, data in (("pe_runtime.o", runtime_object()), ("pe_kernel.o", kernel_object),
                           ("pe_noc.o", noc_object()), ("pe.ld", LINKER_SCRIPT.encode())):
            paths[name] = os.path.join(tmp, name)
            with open(paths[name], "wb") as f:
                f.write(data)
        out = os.path.join(tmp, "pe.elf")
        keep = [arg for r in NOC_ROUTINES for arg in ("-u", r)]
        zig("ld.lld", "-T", paths["pe.ld"], "--gc-sections", "--build-id=none", "--strip-debug",
            "--no-undefined", "--nmagic", "-z", "max-page-size=64", *keep, "-o", out,
            paths["pe_runtime.o"], paths["pe_kernel.o"], paths["pe_noc.o"])
        with open(out, "rb") as f:
            return f.read()
