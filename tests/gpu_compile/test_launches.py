"""`deviceless.launches`: how a compiled program runs on a GPU, read from XLA's thunk sequence (no plugin needed)."""

from __future__ import annotations

from tests.gpu_compile.deviceless import Launches, launches

# The shape of XLA's `*thunk_sequence_after_thunk_passes.txt`: a thunk per line, nested thunks indented below
# the command buffer, loop or conditional holding them; section labels and "No thunks." carry no thunk.
SEQUENCE = """\
000: kCommandBuffer [source       | next=010 (1)]
    001: kCustomKernel [source        | next=002 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [32, 1, 1]
    002: kCopy         [prev=001 (1)  | sink        ] kCopy
010: kWhile         [prev=000 (1) | next=020 (1)]
condition:
    011: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    012: kCustomKernel [source       | next=013 (1)] loop_select_fusion grid: [1, 1, 1] threads: [8, 1, 1]
    013: kCopy         [prev=012 (1) | sink        ] kCopy
020: kConditional   [prev=010 (1) | next=030 (1)]
  false_branch:
    No thunks.  true_branch:
    021: kCustomKernel  [source       | next=022 (1)] loop_and_or_fusion grid: [1, 1, 1] threads: [1, 1, 1]
    022: kConditional   [prev=021 (1) | next=000 (1)]
      false_branch:
        000: kCommandBuffer [source | sink]
            023: kCustomKernel [source | sink] wrapped_negate grid: [8, 1, 1] threads: [128, 1, 1]
030: kCustomKernel  [prev=020 (1) | sink] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]
031: kDynamicSliceFusion [prev=030 (1) | sink]
"""


def test_launches_counts_graphs_host_loops_and_branches_apart():
    got = launches(SEQUENCE)
    # outside conditionals: 2 in the graph, 3 in the loop (condition and body once), 2 at the top level
    assert got == Launches(kernels=7, in_conditionals=2, graphs=2, host_loops=1, host_conditionals=2, outside=5)
    assert got.as_dict()["host_loops"] == 1


def test_a_loop_inside_a_graph_is_not_the_host_s():
    nested = """\
000: kCommandBuffer [source | sink]
    001: kWhile [source | sink]
    condition:
        002: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
      body:
        003: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]
004: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]
"""
    assert launches(nested) == Launches(kernels=3, in_conditionals=0, graphs=1, host_loops=0, host_conditionals=0,
                                        outside=1)
    assert launches("") == Launches(0, 0, 0, 0, 0, 0)
