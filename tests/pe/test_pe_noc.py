"""The PE runtime's NoC driver and barrier executed in the instruction-set simulator (packets, their
order and timing, the bounded wait's fault, a deadlock named), and a region's PEs run
concurrently with the jobs' dependencies carried by NoC packets: the bits of the sequential
replay and of the default simulator."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("unicorn")
pytest.importorskip("elftools")
pytest.importorskip("ziglang")

from tvm_spinn.pe import run_firmware  # noqa: E402
from tvm_spinn.pe.errors import IssFault, NocDeadlock  # noqa: E402
from tvm_spinn.pe.images import role_image  # noqa: E402
from tvm_spinn.pe.iss import PeMachine, image_symbols  # noqa: E402
from tvm_spinn.pe.memory_map import NOC_KEY_ARRIVE, NOC_KEY_READY, NOC_KEY_RELEASE, NOC_WAIT_POLLS  # noqa: E402
from tvm_spinn.pe.multi import NocFabric, _handoffs, barrier_pes, barrier_tree, run_barrier, run_firmware_concurrent  # noqa: E402
from tvm_spinn.pe.images import noc_role_image  # noqa: E402
from tvm_spinn.pe.noc import NOC_ROUTINES  # noqa: E402
from tvm_spinn.runtime.simulator import run_program  # noqa: E402
from tvm_spinn.target.arch import SpinnArch  # noqa: E402

from test_firmware_loader import _Block, _Mlp, _inputs, _same_bits  # noqa: E402


@pytest.fixture(scope="module")
def image():
    return noc_role_image(("relu",))


def _words(m, address, n):
    return [int(v) for v in np.frombuffer(m.read(address, 4 * n), dtype="<u4")]


def _fabric(image, pes, arch=None):
    arch = arch or SpinnArch()
    fabric = NocFabric(arch)
    machines = {}
    for pe in pes:
        machines[pe] = PeMachine(image.elf, image.name, pe, arch.acc_bits, arch)
        fabric.attach(machines[pe])
    return fabric, machines


def _call(m, symbol, args):
    """A process that runs ``symbol`` on ``m``, yielding while it waits on an empty RX FIFO."""
    done = m.call(symbol, args)
    while not done:
        yield False
        done = m.resume()
    yield True


def test_noc_image_keeps_the_role_image_and_adds_the_driver(image):
    """The NoC image is the role's image with the driver after it: the runtime's and the kernel's
    code at the same addresses, the same bytes; the routines present only in the NoC image."""
    plain = role_image(("relu",))
    a, b = image_symbols(plain.elf), image_symbols(image.elf)
    assert a["pe_kernel"] == b["pe_kernel"] and a["_start"] == b["_start"]
    ma, mb = PeMachine(plain.elf, "a", 0, 24), PeMachine(image.elf, "b", 0, 24)
    code = a["pe_kernel"] + 64
    assert ma.read(0, code) == mb.read(0, code)
    assert all(r in b and r not in a for r in NOC_ROUTINES)


def test_packets_arrive_in_order_with_their_source_and_latency(image):
    """PE 0 sends three packets to PE 9 (another quad-PE); PE 9 receives them in order, each
    with its payload and source, no earlier than the send plus the route's hops."""
    arch = SpinnArch()
    fabric, ms = _fabric(image, [0, 9], arch)
    sender, receiver = ms[0], ms[9]

    def send():
        for k in range(3):
            assert sender.call("pe_noc_send", [9, 0x100 + k, 7 * k])
        yield True

    got = []

    def receive():
        for _ in range(3):
            buf = receiver.arena
            done = receiver.call("pe_noc_recv", [buf, buf + 4])
            while not done:
                yield False
                done = receiver.resume()
            from unicorn.arm_const import UC_ARM_REG_R0
            got.append((receiver.uc.reg_read(UC_ARM_REG_R0), *_words(receiver, buf, 2), receiver.noc_time()))
        yield True

    fabric.run({9: receive(), 0: send()}, lambda pe: "a packet")
    assert [g[:3] for g in got] == [(0x100, 0, 0), (0x101, 7, 0), (0x102, 14, 0)]
    hops = 1 + 2  # PE 9: quad-PE 2, two steps along the first row of the 7-wide grid of 38 quad-PEs
    assert fabric.hops(0, 9) == hops
    assert got[0][3] >= hops * arch.noc_hop_cycles
    assert fabric.packets == 3


def test_bounded_wait_faults_naming_pe_image_and_pc(image):
    """A receive on an empty RX FIFO with nobody to yield to: after NOC_WAIT_POLLS polls the
    driver reports a timeout, raised naming the PE, the image and a PC inside the driver."""
    m = PeMachine(image.elf, image.name, 3, 24)
    with pytest.raises(IssFault, match=r"PE 3, image relu: NoC driver fault 1: receive timed out.*"
                                       rf"detail {NOC_WAIT_POLLS:#x}.*at pc=0x") as err:
        m.call("pe_noc_recv", [m.arena, m.arena + 4])
    syms = image_symbols(image.elf)
    assert syms["pe_noc_send"] <= err.value.pc < max(syms[r] for r in NOC_ROUTINES) + 256


def test_unexpected_packet_is_a_fault(image):
    """A barrier member that receives a ready packet instead of the release faults with the key."""
    fabric, ms = _fabric(image, [0, 1])

    def stray():
        assert ms[0].call("pe_noc_send", [1, NOC_KEY_READY | 5, 0])
        yield True

    with pytest.raises(IssFault, match=rf"PE 1, image relu: NoC driver fault 2: unexpected packet.*"
                                       rf"detail {NOC_KEY_READY | 5:#x}"):
        fabric.run({0: stray(), 1: _call(ms[1], "pe_barrier", [0, 0, 4])}, lambda pe: "")


@pytest.mark.parametrize("key", [NOC_KEY_READY | 5, NOC_KEY_ARRIVE | 9])
def test_stray_packet_while_counting_arrivals_is_a_fault(image, key):
    """The barrier counts its children's arrivals unread: a root (PE 0, one child PE 1) sent a
    ready packet or another group's arrival by PE 2 while it counts faults naming the PE, the
    image, the key and its source, instead of releasing PE 1 early."""
    fabric, ms = _fabric(image, [0, 1, 2])
    fabric.route(NOC_KEY_RELEASE | 4, 0xFFFFFFFF, [1])

    def stray():
        assert ms[2].call("pe_noc_send", [0, key, 0])
        yield True

    with pytest.raises(IssFault, match=rf"PE 0, image relu: packet key {key:#x} from PE 2 popped unread "
                                       rf"in barrier group 4.*at pc=0x"):
        fabric.run({0: _call(ms[0], "pe_barrier", [0, 1, 4]), 1: _call(ms[1], "pe_barrier", [0, 0, 4]),
                    2: stray()}, lambda pe: "")


def test_scratch_word_read_by_a_byte_placement_stays_in_dram():
    """A scratch word handed by NoC (job 0 on PE 0 writes words 1000-1012, job 1 on PE 1 reads
    1000 and 1004 as words) that a byte placement on PE 2 also reads (bytes 1005-1006, from
    DRAM as it is) is still written to DRAM; the word no byte is read from is only handed."""
    words = lambda off, n: ["dram", off, [n, 1, 1, 1], [4, 0, 0, 0]]  # noqa: E731
    jobs = [{"id": 0, "pe": 0, "steps": [["get", 0x2000, [words(1000, 4)]]]},
            {"id": 1, "pe": 1, "steps": [["put", 0x2000, [words(1000, 2)]]]},
            {"id": 2, "pe": 2, "steps": [["put", 0x2000, [["dram8", 1005, [2, 1, 1, 1], [1, 0, 0, 0]]]]]}]
    sends, takes, kept = _handoffs(jobs, {0: 0, 1: 1, 2: 2}, [1000, 64])
    assert sends == {0: [(1, 0, 0x2000), (1, 1, 0x2004)]} and takes == {(1, 0): [(0, 0), (1, 1)]}
    assert kept == {1004}


def test_barrier_releases_no_pe_before_the_last_arrives(image):
    """Four PEs in a barrier (root PE 21), each alone in its quad-PE: the root leaves no earlier
    than the farthest arrival's trip, each member no earlier than its arrival's trip to the root
    and the release's trip back. Gathered by quad-PE, 64 PEs cost the root fewer cycles than
    every PE reporting to it (16 leaders' packets instead of 63)."""
    arch = SpinnArch()
    cycles = run_barrier([0, 4, 21, 37], master=21, arch=arch, image=image)
    # 38 quad-PEs on a 7-wide grid: PE 0 at (0, 0), 4 at (1, 0), 21 at (5, 0), 37 at (2, 1);
    # hops: the own router plus the grid steps
    hops = {0: 1 + 5, 4: 1 + 4, 37: 1 + 3 + 1}
    for pe, h in hops.items():
        assert cycles[pe] >= 2 * h * arch.noc_hop_cycles
    assert cycles[21] >= max(hops.values()) * arch.noc_hop_cycles
    small, large = run_barrier([0, 1], image=image), run_barrier(range(8), image=image)
    assert large[0] > small[0]
    assert barrier_tree(range(8), 0, 4) == {0: (0, 4), 1: (0, 0), 2: (0, 0), 3: (0, 0), 4: (0, 3), 5: (4, 0),
                                            6: (4, 0), 7: (4, 0)}
    tree, flat = run_barrier(range(64), image=image), run_barrier(range(64), image=image, by_qpe=False)
    assert tree[0] < flat[0]
    # the release is routed by the router's table: without the entry nobody is released
    fabric, ms = _fabric(image, [0, 1])
    with pytest.raises(IssFault, match=r"multicast packet key 0x3000004 matches no route"):
        fabric.run({pe: _call(ms[pe], "pe_barrier", [0, 1 - pe, 4]) for pe in ms}, lambda pe: "")
    assert NOC_KEY_RELEASE | 4 == 0x3000004


@pytest.mark.parametrize("pes", [3, 13, 37, 100, 148])
def test_timing_models_barrier_is_the_executed_one(image, pes):
    """``SpinnArch.barrier_cost_cycles`` against the executed barrier on the same tree (the
    model's layout of quad-PEs placed on the chip's grid, its root in the middle), at sizes its
    counted cycles were not read from: the slowest PE's cycles within 10%; a dearer hop or a
    dearer pop moves both."""
    for arch in (SpinnArch(), SpinnArch(noc_hop_cycles=9)):
        chip, root = barrier_pes(pes, arch)
        assert len(chip) == pes and root in chip
        executed = max(run_barrier(chip, master=root, arch=arch, image=image).values())
        modelled = arch.barrier_cost_cycles(pes)
        assert abs(modelled / executed - 1) <= 0.10, (pes, arch.noc_hop_cycles, modelled, executed)
    assert SpinnArch(noc_hop_cycles=9).barrier_cost_cycles(pes) > SpinnArch().barrier_cost_cycles(pes)


def test_deadlock_names_the_pes_and_what_they_wait_for(image):
    """Two PEs that each wait for a ready packet from the other: one NocDeadlock naming both."""
    fabric, ms = _fabric(image, [2, 6])
    for m in ms.values():
        m.write(m.arena, np.array([1 - (m.pe == 6), 1], dtype="<u4").tobytes())
    with pytest.raises(NocDeadlock, match=r"PE 2: waits for slot 1; PE 6: waits for slot 0") as err:
        fabric.run({pe: _call(m, "pe_noc_wait_ready", [m.arena, 1]) for pe, m in ms.items()},
                   lambda pe: f"waits for slot {1 - (pe == 6)}")
    assert sorted(err.value.waits) == [2, 6]


def test_packet_to_a_pe_not_running_is_a_fault_naming_pe_image_and_pc(image):
    """A send to a PE that is not on the fabric: an IssFault naming the sending PE, its image and
    a PC inside the driver's send."""
    fabric, ms = _fabric(image, [0, 1])
    syms = image_symbols(image.elf)
    with pytest.raises(IssFault, match=r"PE 1, image relu: packet to PE 7, which is not running \(PEs \[0, 1\]\)"
                                       r" at pc=0x") as err:
        fabric.run({1: _call(ms[1], "pe_noc_send", [7, 1, 2])}, lambda pe: "")
    assert syms["pe_noc_send"] <= err.value.pc < syms["pe_noc_recv"]


def _check_concurrent(make, shape, tmp_path):
    import torch
    import tvm_spinn
    from tvm import relax
    from tvm_spinn.pe.firmware import export_firmware, programs_of
    torch.manual_seed(3)
    net = make()
    ex = relax.build(tvm_spinn.frontend.from_pytorch(net.eval(), (torch.randn(*shape),)), target="spinn")
    export_firmware(ex, tmp_path / "noc", noc=True)
    programs = programs_of(ex)
    runs = []
    for r, program in enumerate(programs):
        x = _inputs(program, r)
        run = run_firmware_concurrent(tmp_path / "noc", x, region=r)
        assert _same_bits(run.outputs, run_firmware(tmp_path / "noc", x, region=r))
        assert _same_bits(run.outputs, run_program(program, x, mode="layers"))
        assert run.packets > 0 and all(c > 0 for c in run.cycles.values())
        runs.append(run)
    return ex, programs, runs


def test_mlp_pes_run_concurrently_with_noc_dependencies(tmp_path):
    """The MLP's PEs run concurrently, each job waiting for ready packets from its producers'
    PEs: the sequential replay's bits and the default simulator's; a firmware without the NoC
    driver is refused naming an image."""
    ex, programs, _ = _check_concurrent(_Mlp, (4, 16), tmp_path)
    import tvm_spinn
    tvm_spinn.export_firmware(ex, tmp_path / "again", noc=True)  # the same bytes again
    names = sorted(p.name for p in (tmp_path / "noc").iterdir())
    assert all((tmp_path / "noc" / n).read_bytes() == (tmp_path / "again" / n).read_bytes() for n in names)
    tvm_spinn.export_firmware(ex, tmp_path / "plain")
    with pytest.raises(ValueError, match=r"image '.*' has no NoC driver .*export the firmware with noc=True"):
        run_firmware_concurrent(tmp_path / "plain", _inputs(programs[0]))


@pytest.mark.slow
def test_transformer_block_pes_run_concurrently(tmp_path):
    """Split rows, matmuls, GELU, residuals on 128 PEs: the split rows' statistics handed from
    PE to PE as data packets into the receivers' mailboxes (their DRAM scratch words never
    written, so the bits prove the packets' words)."""
    _, _, runs = _check_concurrent(_Block, (1, 8, 16), tmp_path)
    assert runs[0].handed > 0


def test_cli_compile_noc_firmware(tmp_path):
    """``tvm-spinn compile --firmware DIR --noc`` links the driver into every image (the plain
    export does not); ``--noc`` alone is refused before anything is written."""
    import torch
    from tvm_spinn import cli
    from tvm_spinn.pe import load_firmware
    torch.manual_seed(3)
    onnx_path = tmp_path / "mlp.onnx"
    torch.onnx.export(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval(), (torch.randn(4, 16),),
                      str(onnx_path), dynamo=False, input_names=["x"], output_names=["y"])
    for flags, has in (([], False), (["--noc"], True)):
        fw = tmp_path / f"fw{len(flags)}"
        assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / f"m{len(flags)}.so"), "--firmware", str(fw),
                         *flags]) == 0
        loaded = load_firmware(fw)
        for rec in loaded.manifest["images"].values():
            assert all((r in image_symbols(loaded.files[rec["file"]])) == has for r in NOC_ROUTINES)
    assert cli.main(["compile", str(onnx_path), "-o", str(tmp_path / "m3.so"), "--noc"]) == 2
    assert not (tmp_path / "m3.so").exists()


def test_data_packets_fill_the_mailbox_and_count_as_packets(image):
    """Data packets waited for as packets from their sender: each word lands in the mailbox word
    its key names, counted for the slot in its key; a ready packet in between counts for its
    payload's slot; a mailbox word past the mailbox is a fault naming the key."""
    import struct
    from tvm_spinn.pe.memory_map import (NOC_KEY_DATA, NOC_MAILBOX_ADDR, NOC_MAILBOX_WORDS, NOC_STATE_ADDR,
                                         NOC_STATE_WORDS)
    m = PeMachine(image.elf, image.name, 5, 24)
    words = [0x3F800000, 0xDEADBEEF, 7]
    for i, w in enumerate(words):
        m.noc_rx.append((NOC_KEY_DATA | (2 << 16) | (10 + i), w, 9, 0))
    m.noc_rx.insert(1, (NOC_KEY_READY | 44, 3, 11, 0))
    m.write(m.arena, struct.pack("<4I", 2, 3, 3, 1))
    assert m.call("pe_noc_wait_ready", [m.arena, 2])
    assert _words(m, NOC_MAILBOX_ADDR + 40, 3) == words
    assert _words(m, NOC_STATE_ADDR, NOC_STATE_WORDS)[:4] == [0, 0, 3, 1] and not m.noc_rx
    m.noc_rx.append((NOC_KEY_DATA | NOC_MAILBOX_WORDS, 1, 9, 0))
    m.write(m.arena, struct.pack("<2I", 0, 1))
    with pytest.raises(IssFault, match=rf"PE 5, image relu: NoC driver fault 4: data packet for a word outside the "
                                       rf"mailbox .*detail {NOC_KEY_DATA | NOC_MAILBOX_WORDS:#x}"):
        m.call("pe_noc_wait_ready", [m.arena, 1])
