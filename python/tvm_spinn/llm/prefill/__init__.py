"""The prompt as its own plan: chunked prefill pipelined over boards (time to first token).

A prompt of ``n`` tokens is cut into chunks of ``C`` tokens that flow through a pipeline of
*stages*, so the stages work on different chunks at once. A stage is a group of ``g``
neighbouring boards (:func:`tvm_spinn.llm.board_tp.board_groups`) running ``m`` consecutive
blocks, each block tensor-parallel over the group (for ``g >= 2`` each board runs the block's
slice, :func:`tvm_spinn.llm.board_tp.slice_config`, whose int32 partial sums are all-reduced
across the boards twice a block: :func:`tvm_spinn.timing.collectives.board_all_reduce`) and,
inside a board, over its chips as the mapper plans it (the int8 weight GEMMs at ``M = C`` on the
MAC arrays). Between stages each chunk's hidden state (``C x hidden`` elements of the plan's
``handover`` type) crosses the board links, each chip sending its share to its counterpart on
the next group (:func:`tvm_spinn.timing.collectives.point_to_point`; between groups of several
boards in slices where that is cheaper, :func:`tvm_spinn.timing.collectives.sliced_hand_over`),
then all-gathered on the receiving board where its first program reads it whole. Between one-board stages the hand-over
also takes relay paths: the edge-disjoint paths of board edges between the two boards that no
other hand-over's routes or relays use (every hand-over runs at once in the pipeline's steady
state), its shares split so that they finish together.

Chunk ``k`` attends over the ``(k + 1) C`` keys written so far (its own included: a
sliding window keeps at most the window's); its keys and values are the program's outputs,
written into the KV cache of the stage's chips, where that stage's blocks keep them. A block's
chunk is one program (:class:`ChunkStep`, described with descriptor weights by
:mod:`.describe`) mapped on one board by the normal mapper with the board's SRAM ledger
(:func:`tvm_spinn.llm.plan._map_stage`) at the first chunk's context and at the last's; the
chunks between are timed on the straight line between the two (attention's work is linear in
the context, the weight GEMMs' constant). A stage of ``m`` blocks runs the first blocks its SRAM
keeps resident at the time of the block mapped with ``weights="auto"`` and the rest at the time
of the block streaming its weights (as :func:`tvm_spinn.llm.board_tp._run_s`).

The pipeline is timed as a flow shop (:func:`flow_shop_s`): the machines are the stages and the
board links between them, in order, each taking the chunks in order; on identical machines of
time ``t`` per chunk that is ``(machines + chunks - 1) t``. After the last chunk the last token's
hidden state goes to the board of the LM head, which produces the first token; the host link
carries the prompt in and the token out (:func:`tvm_spinn.llm.plan._step_io`).

Searched: the chunk size (powers of two from :data:`MIN_CHUNK` that divide the prompt, and the
whole prompt: all of them up to :data:`EXHAUSTIVE` sizes, else a climb from the size that
makes as many chunks as stages, taking the first faster neighbour, the smaller first), the boards a block is tensor-parallel over (:data:`TP_BOARDS`, at the best
chunk size of one board per block) and the blocks a stage runs (every stage used, two or four
times fewer stages, or one). One board runs every block as one stage. A layout whose stages
stream some of their blocks' weights is mapped with them streamed only when, timed with those
blocks at the mapper's own choice (``auto``, never slower than streaming), it could beat the
best layout found. A layout whose lower bound already exceeds the best time found is not timed
(``prune``): a machine of its pipeline running every chunk between the first chunk's way there
and the last one's way on; for boards taking turns, a last-stage board's chunks one after
another; for a block over several boards, before its slice is mapped, the all-reduces and
hand-overs alone (the layouts over boards taking turns are searched before those wider blocks).
One prompt is planned (a batch's prompts would follow it through the pipeline).

Where the system has the boards, a stage of one block may also run on ``r`` neighbouring boards
(:data:`REPLICAS`), each holding the block's weights and its whole KV cache and taking every
``r``-th chunk, so a stage starts a chunk while its other boards still run the earlier ones
(:func:`replicated_flow_shop`). A chunk's attention reads every earlier chunk's keys and
values: each board sends the chunk's keys and values (fp32) to the stage's other boards as soon
as the block's work before its attention (its norm and the key, query and value projections,
mapped alone: ``prefix``) has written them, each chip its share at once on the link graph, and a
chunk's attention waits for those of the chunks before it (writing the received keys and values
into a board's cache is not timed: ``2 x kv_heads x head_dim`` fp32 values a token and block). Each board hands a chunk over to its
counterpart on the next stage (every pair at once on the link graph), charged the keys' and
values' transfer on top of its own (the two may share board edges and are not timed together on
the link graph). The chunk sizes are climbed again from the best layout's of one board a
block (healthy systems only). The prompt's plan is the system's, whatever the
decode placement: every decode alternative's time to first token is this plan's.

On a system with faults or a partial allocation (:mod:`tvm_spinn.target.faults`) the prompt
runs on the live hardware only: stages of one board on the usable boards (the whole ones first),
a block tensor-parallel over whole boards only, and a stage or the head on a board with dead
chips or links mapped on that board as it is (:func:`~tvm_spinn.target.faults.board_view`);
``PrefillPlan.boards`` names the boards used.

The bound next to it (:func:`prefill_bound`) is the project's physical bound
(:func:`tvm_spinn.timing.bounds.physical_bound`) of the prompt's work (:func:`prefill_workload`):
its MACs at the system's peak, every weight read once, and the least crossings a placement needs.
"""

from __future__ import annotations

from .chunk import ChunkStep
from .result import PrefillPlan
from .schedule import flow_shop_path, flow_shop_s, replicated_flow_shop
from .search import EXHAUSTIVE  # noqa: F401 - a public constant, not in __all__
from .search import MIN_CHUNK, REPLICAS, TP_BOARDS, chunk_sizes, plan_prefill
from .workload import prefill_bound, prefill_workload

__all__ = ["PrefillPlan", "ChunkStep", "plan_prefill", "prefill_workload", "prefill_bound", "flow_shop_s",
           "flow_shop_path", "replicated_flow_shop", "chunk_sizes", "TP_BOARDS", "REPLICAS", "MIN_CHUNK"]
