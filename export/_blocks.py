"""The attention blocks of a whole model another tool exported, read back into attnx's contract.

A block is one attention core (attnx.model.cores; its reader is its entry in attnx.export.cores) with
what belongs to it: the q/k/v projections (packed or separate, with biases, float or MatMulNBits),
the q/k norms, the rotary tables, the output projection and the cache. read_blocks() reads each
into an AttentionConfig and the weights of the weights file's contract, and names the graph's own
tensors at the block's boundary (the hidden state in, the block's output and presents out), which
is where `attnx audit` cuts it out to run (attnx.workflows.audit). What is not read is said, with
the node and why, never skipped in silence (Block.unread, and Blocks.unread for cores not read).

Block readers (GRAPH_CORES[core].read_block, one in each core's module): GroupQueryAttention (ONNX Runtime GenAI's builder: packed or separate
qkv, MatMulNBits, the op's own rotary from cos/sin caches, window, softcap, sinks; attnx's: a RotaryEmbedding of its
own before it), MultiHeadAttention (the builder's fp16 models), ONNX's opset-23 Attention, com.microsoft Attention
(BERT as ONNX Runtime's optimizer fuses it) and the decomposed MatMul-Softmax-MatMul (attnx, torch.onnx, Optimum).
From a core, each of q, k and v is followed back to its projection by the one walker (attnx.export.passes.walk: walk
for the fused ops' inputs, find_projection breadth first for the decomposed form), noting the rotation, norm, cache and scalings met. What the graph computes
rather than states (rotary tables from position_ids, masks from attention_mask) is named for the audit, which reads it
by running it (Block.reading.rope.tensors, Block.mask, Block.masks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import onnx_ir as ir

from attnx.export.cores import GRAPH_CORES, Block, core_of_node
from attnx.export.cores._block import IF_OF_BRANCH, mark_branches
from attnx.export.passes.walk import NotRead

__all__ = ["Block", "Blocks", "block_cores", "block_nodes", "iter_blocks", "read_blocks", "release_external"]


@dataclasses.dataclass
class Blocks:
    blocks: list[Block]
    unread: list[str]  # "node X: a Softmax not read as attention: ..."


def iter_blocks(model: ir.Model, unread: list[str], wanted: Callable[[int], bool] | None = None,
                others: list[str] | None = None) -> Iterator[Block]:  # fmt: skip
    """Every attention block of the graph in graph order, read one at a time (its weights read from the
    graph's tensors as it is reached, and the tensors released when the next block is read: a model larger
    than memory is read a layer at a time), each where its core has a block reader; what is not read is
    appended to `unread` with the node and why; a Softmax of no q.k (a router's, a classifier's) to `others`.
    wanted(index) false: the block is read (its structure, config and index) without its weights (Block.weights
    None), whose bytes are then never read."""
    index = 0
    read_whole: set[int] = set()  # the branches of an If read as one block (the switch core's): not read again
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if id(node.graph) in read_whole:
            continue
        mark_branches(node)  # a block read in one branch of an If is its block: its other branches not read again
        core = core_of_node(node)
        if core is None:
            continue
        if node.op_type == "If":
            read_whole.update(id(a.value) for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH)
        name = node.name or node.op_type
        if not GRAPH_CORES[core].is_attention(node):
            if others is not None:
                others.append(f"node {name}: a {node.op_type} whose input comes from no MatMul of two computed "
                              "operands (q.k): not read as attention")  # fmt: skip
            continue
        reader = GRAPH_CORES[core].read_block
        if reader is None:
            unread.append(f"node {name}: a {node.op_type} ({core} core) not read as a block: attnx audit reads "
                          f"{', '.join(block_cores())} blocks in this version")  # fmt: skip
            continue
        block, why = None, None
        try:
            block = reader(index, node, wanted is None or wanted(index))
        except NotRead as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - an untrusted graph's values (heads 0, sizes that do not add up)
            why = f"{type(e).__name__}: {e}"
        release_external(model)  # after the exception and its traceback (views of the mapped data) are gone
        owner = node.graph.meta.get(IF_OF_BRANCH) if node.graph is not None else None
        if owner is not None:  # attnx's latent step: its block read in the branch met first (or named there)
            read_whole.update(id(graph) for graph in mark_branches(owner))
        if block is None:
            unread.append(f"node {name}: not read as attention: {why}")
            continue
        index += 1
        yield block


def block_cores() -> list[str]:
    """The cores whose blocks are read (a block reader in GRAPH_CORES)."""
    return [name for name, entry in GRAPH_CORES.items() if entry.read_block is not None]


def release_external(model: ir.Model) -> int:
    """Unmap every external tensor of `model` that a read mapped (onnx_ir maps the data file when a tensor
    is read, and keeps it mapped: the pages read stay in the process's memory until released), and return
    how many were. A block keeps copies of what it read, so none is in use."""
    released = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.raw is not None:
            tensor.release()
            released += 1
    return released


def read_blocks(model: ir.Model) -> Blocks:
    """Every attention block of the graph (iter_blocks), all held at once."""
    unread: list[str] = []
    return Blocks(list(iter_blocks(model, unread)), unread)


def block_nodes(model: ir.Model) -> list[str]:
    """The names of the nodes iter_blocks reads as blocks (a core with a block reader), in graph order, from the
    graph alone (no weight read): how many blocks a model has before any is read. A node its reader then
    refuses is still listed here (iter_blocks names it as unread and numbers the blocks after it one lower)."""
    return [node.name or node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if (core := core_of_node(node)) in block_cores()
            and GRAPH_CORES[core].is_attention(node)]  # fmt: skip
