"""A whole model another tool exported, opened once (`open_whole_model`) and handed down: `attnx audit`, `attnx
optimize` and `attnx build --model` read it from this object, never from its file again; and the one reading of
its blocks that the audit and optimize share (`read_blocks`).

Opening checks the file as untrusted input and parses it once (attnx.runtimes._untrusted.read_untrusted_model:
external data inside its folder, sizes, cycles, domains); what is derived from that parse is made on first use and
kept: the onnx-ir model (its external data read tensor by tensor, as a block reaches it) and the structure blocks
are cut from, typed once by onnx's shape inference (AuditGraph).

What still goes to the file's path, and why: an ONNX Runtime session (the proofs' runner, the whole model's timing,
the audit's decoding). ONNX Runtime parses its own copy in C++ whichever way it is handed the model, so bytes would
save no parse, only a read of the file; and a model past protobuf's 2 GB holds its tensors in external data, which
ONNX Runtime finds beside the model's path and cannot find from bytes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from attnx.errors import UsageError
from attnx.export._blocks import iter_blocks
from attnx.export.cores import Block, Unread
from attnx.model.config import TensorSpec
from attnx.model.contract import CONFIG_KEY, io_specs
from attnx.model.onnx_tensors import external_locations
from attnx.runtimes._untrusted import read_untrusted_model
from attnx.workflows.audit.cut import AuditGraph, cut_extractor, read_computed_terms
from attnx.workflows.audit.run import cache_sizes, first_line
from attnx.workflows.audit.shapes import model_shapes

__all__ = ["CacheRead", "WholeModel", "open_whole_model", "read_blocks"]


class CacheRead(NamedTuple):
    """A cache input as its block reads it, where the model's dims do not say (the GenAI builder names its head size
    kv_cache_dim): one rule for keys and values, each its own head size (a value's is the config's v_head_dim)."""

    kv_heads: int
    capacity: int  # the positions it holds before the first token: a window kept in a ring buffer, else 0
    head_size: int


class WholeModel:
    """A model file opened once (open_whole_model): its protobuf as read and checked (without its external data;
    never edited), the I/O it declares (TensorSpec: the contract's names, dtypes and dims), the external data it
    names, who wrote it; and, made from that parse on first use, the onnx-ir model (which optimize edits in place)
    and the typed structure blocks are cut from (graph: AuditGraph). The caches (`caches`: each past input's
    CacheRead; `presents`: each past input's present output) are recorded as read_blocks reads the blocks."""

    def __init__(self, path: str, proto: Any) -> None:
        self.path = path
        self.folder = os.path.dirname(os.path.abspath(path))
        self.proto = proto
        self.inputs: tuple[TensorSpec, ...]
        self.outputs: tuple[TensorSpec, ...]
        self.inputs, self.outputs = io_specs(proto)
        self.metadata = {p.key: p.value for p in proto.metadata_props}
        self.external_data: tuple[str, ...] = tuple(external_locations(proto, path))
        self.caches: dict[str, CacheRead] = {}
        self.presents: dict[str, str] = {}

    @property
    def written_by_another_tool(self) -> bool:
        """Whether it carries no attnx.config (attnx did not write it)."""
        return CONFIG_KEY not in self.metadata

    @functools.cached_property
    def model(self) -> Any:
        """The onnx-ir model, made from the protobuf read (onnx_ir.load's own steps, without its parse)."""
        import onnx_ir as ir

        model = ir.serde.deserialize_model(self.proto)
        ir.external_data.set_base_dir(model.graph, self.folder)  # relative locations, as onnx_ir.load resolves them
        return model

    @functools.cached_property
    def graph(self) -> AuditGraph:
        """The model as the audit and optimize read it: the onnx-ir model, onnx's Extractor over the structure typed
        once (shape inference), the folder its data lies in, the shapes its dims allow."""
        import onnx

        try:
            typed = onnx.shape_inference.infer_shapes(self.proto)
        except onnx.shape_inference.InferenceError as e:
            raise UsageError(f"{self.path}: its shapes contradict each other: {first_line(e)}") from None
        return AuditGraph(self.model, cut_extractor(typed), self.folder, model_shapes(self.model))

    def release(self) -> None:
        """Drop what was made from the protobuf (the onnx-ir model, the typed structure), keeping the protobuf, its
        I/O and the caches read: for a caller that goes on to run the model in a runtime's own copy."""
        self.__dict__.pop("graph", None)
        self.__dict__.pop("model", None)

    def record_caches(self, block: Block) -> None:
        """The block's cache inputs (CacheRead) and their present outputs, where it reads a config."""
        if block.config is None:
            return
        capacity = block.cache_capacity
        for role, (heads, size) in zip(("key", "value"), cache_sizes(block)):
            past = block.inputs.get(f"past_{role}")
            if past is not None:
                self.caches[past] = CacheRead(heads, capacity, size)
                if f"present_{role}" in block.outputs:
                    self.presents[past] = block.outputs[f"present_{role}"]


def open_whole_model(path: str | os.PathLike[str], *, whole_model: bool = True) -> WholeModel:
    """The model at `path` checked as untrusted input and parsed, once (the module doc). whole_model: its tensors
    together must fit in memory too (a runtime holds them all at once), as every command that runs it needs."""
    path = os.fspath(path)
    return WholeModel(path, read_untrusted_model(path, whole_model=whole_model))


def read_blocks(whole: WholeModel, unread: list[str], source: Any = None, wanted: Callable[[int], bool] | None = None,
                others: list[str] | None = None) -> Iterator[Block]:  # fmt: skip
    """Every attention block of the model, read as the audit and optimize both read it (attnx.export._blocks'
    iter_blocks: `unread`, `others`, `wanted` are its own), each block's caches recorded on `whole`; and of each
    block wanted whose config is read, the terms the graph computes rather than states (cut.read_computed_terms,
    reaching as far as `source`, a checkpoint's layers or a config attnx stated, says: its reach and its rope's
    original length). A computation that does not run is the block's Unread (named, never raised): an untrusted
    model's subgraph, in the runtime's own error types. A block's terms are read before it is handed over, so a
    caller that holds one block at a time drops it before asking for the next (its weights and its tables: the rotary
    tables read at several lengths are tens of MB)."""
    for block in iter_blocks(whole.model, unread, wanted, others):
        whole.record_caches(block)
        if block.config is not None and (wanted is None or wanted(block.index)):
            hints = (source.reach or 0, source.rope_original or 0) if source is not None else (0, 0)
            try:
                read_computed_terms(whole.graph, block, *hints)
            except Exception as e:  # noqa: BLE001 - the runtime's own error types, on a subgraph of an untrusted model
                block.unread = Unread(f"what the graph computes for it (its mask, its rotary tables) does not run: "
                                      f"{first_line(e)}")  # fmt: skip
        yield block
