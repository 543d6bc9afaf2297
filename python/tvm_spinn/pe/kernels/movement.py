"""The data-movement PE kernels: strided DMA descriptors, and the embedding lookup that
resolves indices and moves table rows by DMA.

Kernels (the ``spec`` of :func:`~tvm_spinn.pe.kernels.kernel_object`):

- ``("dma",)``: data movement by the DMA engine: ``n`` strided descriptors
  (:data:`~tvm_spinn.pe.memory_map.DMA_DESC_WORDS` words each, the engine's register order) run one after
  another through the runtime's driver ``pe_dma`` (copy in, start, wait); args ``desc, n``. The
  host builds them from the layer's strided view of its input
  (:func:`tvm_spinn.program.ops.movement.dma_descriptors`: ``reshape``, ``permute_dims``,
  ``broadcast_to``, ``strided_slice``), or from each input's strided view of the output
  (scatter descriptors, :func:`tvm_spinn.program.ops.movement.scatter_targets`: ``concat``;
  ``pad`` after a fill descriptor whose source strides are 0); the elements go from the inputs,
  outside the PE's SRAM, to the tile's output in SRAM.
- ``("take",)``: the rows of an embedding lookup: each int32 index resolved by the layer's mode
  (``mode`` 0 ``fast``: an index outside ``[0, extent)`` sets ``err[0]`` and gives its value
  in ``err[1]``, the first one only; 1 ``clip``; 2 ``wrap``, the non-negative remainder) into
  ``rows``; then per segment of the tile (a run of one table row's elements: ``nseg`` records
  of a row's position in ``rows`` and a DMA descriptor whose source is the run's place in row 0)
  the row's offset (``rows[k] * row_bytes``) is added to the descriptor's source and the DMA
  engine copies the run into the tile; args ``idx, rows, err, n, extent, mode, seg, nseg,
  row_bytes``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..memory_map import DMA_DESC_WORDS


def _dma():
    @T.prim_func
    def kernel(desc: T.handle("int32"), n: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        D = T.decl_buffer((n * DMA_DESC_WORDS,), "int32", data=desc)
        for d in range(n):
            T.evaluate(T.call_extern("int32", "pe_dma", T.address_of(D[d * DMA_DESC_WORDS])))
    return kernel


def _take():
    @T.prim_func
    def kernel(idx: T.handle("int32"), rows: T.handle("int32"), err: T.handle("int32"), n: T.int32,
               extent: T.int32, mode: T.int32, seg: T.handle("int32"), nseg: T.int32, row_bytes: T.int32):
        T.func_attr({"tir.noalias": True, "calling_conv": 0})
        I = T.decl_buffer((n,), "int32", data=idx)
        R = T.decl_buffer((n,), "int32", data=rows)
        E = T.decl_buffer((2,), "int32", data=err)
        S = T.decl_buffer((nseg * (DMA_DESC_WORDS + 1),), "int32", data=seg)
        v = T.decl_buffer((1,), "int32", scope="local")
        E[0] = 0
        for i in range(n):
            v[0] = I[i]
            if mode == 1:  # clip
                v[0] = T.if_then_else(v[0] < 0, 0, T.if_then_else(v[0] >= extent, extent - 1, v[0]))
            elif mode == 2:  # wrap: the non-negative remainder
                v[0] = T.truncmod(v[0], extent)
                v[0] = T.if_then_else(v[0] < 0, v[0] + extent, v[0])
            elif v[0] < 0 or v[0] >= extent:  # fast: the first broken promise is reported
                if E[0] == 0:
                    E[0] = 1
                    E[1] = v[0]
                v[0] = 0
            R[i] = v[0]
        # each segment (a run of one table row's elements): its row's offset added to its
        # descriptor's source, then the DMA engine copies it
        for s in range(nseg):
            S[s * (DMA_DESC_WORDS + 1) + 1] = S[s * (DMA_DESC_WORDS + 1) + 1] + R[S[s * (DMA_DESC_WORDS + 1)]] * row_bytes
            T.evaluate(T.call_extern("int32", "pe_dma", T.address_of(S[s * (DMA_DESC_WORDS + 1) + 1])))
    return kernel
