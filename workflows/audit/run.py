"""A cut block run: on a backend (runner_for), at the shapes its model allows, each check against the reference
(run_checks), a failing block localised to its first stage (localise_block); and the whole model's decoding as
exported (decode_whole)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.errors import AttnxError
from attnx.model.config import AttentionConfig
from attnx.model.contract import PROVIDERS
from attnx.model.resources import available_memory_bytes
from attnx.model.stages import STAGES
from attnx.model.tolerance import Requantization, RequantizedTolerance, tolerance_for
from attnx.runtimes.base import Runner
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.runtimes.localise import compare_stages, reference_stages
from attnx.workflows.audit.cut import NP_DTYPES, AuditGraph, NotFed, cut_block, cut_file, graph_feeds, runner_for
from attnx.workflows.audit.report import AuditReport, BlockAudit
from attnx.workflows.audit.shapes import Shapes

__all__ = ["decode_whole", "first_line", "localise_block", "run_block", "run_checks", "runner_for"]


def run_block(runner: Runner, block: Any, needs: Sequence[str], x: np.ndarray, past_len: int,
               past: tuple[np.ndarray, np.ndarray], lengths: np.ndarray | None = None,
               left: np.ndarray | None = None) -> list[np.ndarray]:  # fmt: skip
    """One call of the cut block on `x` after `past_len` cached tokens. GroupQueryAttention's convention: each
    row's length in seqlens_k (`lengths`: a right-padded prompt). Hugging Face's (attention_mask, position_ids):
    `left`, each row's padding tokens at its start (position_ids as transformers makes them: cumsum(mask) - 1)."""
    batch, tokens, _ = x.shape
    total = past_len + tokens
    dtype = NP_DTYPES[block.dtype]
    feeds = {block.inputs["x"]: x.astype(dtype)}
    if "seqlens_k" in block.inputs:
        seqlens = np.full((batch,), total, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        feeds[block.inputs["seqlens_k"]] = seqlens - 1
    if "total_sequence_length" in block.inputs:  # each fed where the cut does not compute it (compute_in_cut)
        feeds[block.inputs["total_sequence_length"]] = np.array(total, np.int32)
    if "mask_index" in block.inputs:  # com.microsoft Attention's: each row's length (right padding)
        feeds[block.inputs["mask_index"]] = np.full((batch,), total, np.int32) if lengths is None else \
            np.asarray(lengths, np.int32)  # fmt: skip
    if "past_key" in block.inputs:
        feeds[block.inputs["past_key"]], feeds[block.inputs["past_value"]] = (p.astype(dtype) for p in past)
    mask = np.ones((batch, total), np.int64)
    if left is not None:
        mask[np.arange(total)[None, :] < np.asarray(left)[:, None]] = 0
    elif lengths is not None:  # right padding: each row's keys past its length
        mask[np.arange(total)[None, :] >= np.asarray(lengths)[:, None]] = 0
    other_cache = feeds.get(block.inputs.get("past_key"))  # another layer's cache input, read for its length
    feeds.update(graph_feeds(needs, mask, past_len, other_cache, runner.inputs))
    outputs = list(runner.run(feeds).values())  # in the cut's order: y, presents (or the stages asked)
    if block.y_bias is not None:  # the output projection's bias, added by the fused op after the block
        outputs[0] = outputs[0] + block.y_bias
    return outputs


def localise_block(graph: AuditGraph, block: Any, backend: str, needs: Sequence[str],
              config: AttentionConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray], size: Any) -> str:  # fmt: skip
    """The first stage of the formula (attnx.model.stages) where the block's full sequence leaves its bound: the
    stages the graph holds as tensors (the projections, their rotations, the heads' output, y) exposed in its cut and
    each held to the reference's under its own bound (attnx.runtimes.localise.compare_stages)."""
    if block.quantization is not None:
        return f"block {block.index}: not localised: a quantized block's stages have no float reference"
    order = [s.name for s in STAGES if s.name in block.stages]
    names = list(dict.fromkeys(block.stages[s][0] for s in order))
    x = feeds["x"]
    try:
        with cut_file(cut_block(graph, block, outputs=names, boundary=True)) as path:
            runner = runner_for(backend, path)
            if isinstance(runner, str):
                return f"block {block.index}: not localised: {runner}"
            with runner:
                empty = empty_cache(block, x.shape[0])
                values = dict(zip(names, run_block(runner, block, needs, x, 0, empty)))
    except Exception as e:  # noqa: BLE001 - the runtime's own error types
        return f"block {block.index}: not localised: the block with its stages exposed fails on {backend}: {first_line(e)}"
    found = {}
    batch, tokens = x.shape[:2]
    for stage in order:
        tensor, columns = block.stages[stage]
        value = np.asarray(values[tensor], np.float64)
        if columns is not None:
            value = value[..., columns[0] : columns[1]]
        if value.ndim == 4:  # [batch, heads, tokens, dim] or [batch, tokens, heads, dim]
            value = value.transpose(0, 2, 1, 3) if value.shape[1] != tokens else value
            value = value.reshape(batch, tokens, -1)
        found[stage] = value
    ref = reference_stages(config, weights, feeds, False)
    result = compare_stages(backend, config, found, ref, tolerance_for(block.dtype), size)
    if result.stage is None:
        return f"block {block.index}: not localised: every stage the graph holds agrees ({', '.join(found)})"
    check = next(c for c in result.checks if c.stage == result.stage)
    agree = f"; {', '.join(result.agree)} agree{'s' if len(result.agree) == 1 else ''}" if result.agree else ""
    error = (f"max_abs {check.max_abs:.3g} > atol {check.atol:.3g}" if check.max_abs is not None and check.atol is not None
             and np.isfinite(check.max_abs) else check.detail or "its shape differs")  # fmt: skip
    return f"block {block.index}: localised to stage {result.stage} (tensor {block.stages[result.stage][0]}): {error}{agree}"


def decode_whole(model_path: str, graph: AuditGraph, caches: dict[str, tuple[int, int, int]], presents: dict[str, str],
                 report: AuditReport) -> None:  # fmt: skip
    """The whole model as exported, on ONNX Runtime's CPU: a prefill then single steps through its own cache (every
    present fed back as the next past), which fails in some exports though every block cut out alone runs (a
    buffer the runtime plans from the graph's dim labels). It only has to run: its numbers are the blocks'."""
    model, shapes = graph.model, graph.shapes
    if not caches or "input_ids" not in {v.name for v in model.graph.inputs}:
        return  # nothing to decode, or a model that is its blocks (from a hidden state): each block says
    if shapes.prefill is None:
        if "cache" in shapes.fixed:
            report.not_checked.append(f"the whole model's decoding: its cache is fixed ({shapes.fixed['cache']}), a "
                                      "static cache the audit does not fill")  # fmt: skip
        return  # a sequence fixed by its dims: not applicable (report.not_applicable says so)
    size = sum(os.path.getsize(os.path.join(graph.base_dir, f)) for f in os.listdir(graph.base_dir))
    memory = available_memory_bytes()
    if memory is not None and size > memory // 2:
        report.not_checked.append(f"the whole model's decoding: its folder ({size / 2**30:.1f} GiB) is more than half "
                                  f"the memory available ({memory / 2**30:.1f} GiB); each block's is checked")  # fmt: skip
        return
    known = ("input_ids", "attention_mask", "position_ids")
    other = [v.name for v in model.graph.inputs if v.name not in known and v.name not in caches]
    if other:
        report.not_checked.append(f"the whole model's decoding: it reads {', '.join(other)}, which the audit does "
                                  "not feed")  # fmt: skip
        return
    try:
        runner = runner_for(PROVIDERS["cpu"].backend, model_path)
    except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
        report.findings.append(f"the whole model as exported does not load on ort-cpu: {first_line(e)}")
        return
    if isinstance(runner, str):
        return  # ort-cpu is not here: each block says so
    with runner:
        decode_steps(runner, caches, presents, shapes, report)


def decode_steps(runner: Runner, caches: dict[str, tuple[int, int, int]], presents: dict[str, str], shapes: Shapes,
                 report: AuditReport) -> None:  # fmt: skip
    """decode_whole's prefill and steps on the loaded whole model: each cache input fed its block's present output
    (`presents`: as the blocks were read, WholeModel.presents)."""
    types = {s.name: s.dtype for s in runner.inputs}
    batch, prefill, steps = shapes.batch, shapes.prefill, shapes.tokens - shapes.prefill
    past = {name: np.zeros((batch, kv, capacity, hd), NP_DTYPES.get(types.get(name, ""), np.float32))
            for name, (kv, capacity, hd) in caches.items()}  # fmt: skip
    done = 0
    for step, tokens in enumerate([prefill] + [1] * steps):
        feeds = {"input_ids": np.ones((batch, tokens), np.int64),
                 "attention_mask": np.ones((batch, done + tokens), np.int64),
                 "position_ids": np.broadcast_to(np.arange(done, done + tokens, dtype=np.int64), (batch, tokens))}  # fmt: skip
        feeds = {k: v for k, v in feeds.items() if k in types} | past
        what = f"the prefill of {prefill} tokens" if step == 0 else f"decoding step {step} (after {done} tokens)"
        try:
            outputs = runner.run(feeds)
        except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
            report.findings.append(f"the whole model as exported fails at {what} on ort-cpu: {first_line(e)}")
            return
        unfed = [n for n in caches if presents.get(n) not in outputs]
        if unfed:
            report.not_checked.append(f"the whole model's decoding: no output of the model is the present its blocks "
                                      f"write for {', '.join(unfed[:3])}")  # fmt: skip
            return
        past = {n: outputs[presents[n]] for n in caches}
        done += tokens


def empty_cache(block: Any, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A block's past keys and values before its first token, each its own head size (head_dim, v_head_dim): no
    position, or a window's worth where the window is kept in a ring buffer (GroupQueryAttention's
    sliding_window_cache, whose past has the window's capacity)."""
    capacity = block.cache_capacity
    return tuple(np.zeros((batch, heads, capacity, size), np.float32)  # type: ignore[return-value]
                 for heads, size in cache_sizes(block))  # fmt: skip


def cache_sizes(block: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, size) of a block's key cache and value cache: as its reader found them (Block.cache_sizes: MLA's
    latent parts), or n_kv_heads of head_dim and of v_head_dim."""
    c = block.config
    return block.cache_sizes or ((c.n_kv_heads, c.head_dim), (c.n_kv_heads, c.v_head_dim))


def run_checks(run: Callable[..., list[np.ndarray]], backend: str, block: Any, needs: Sequence[str],
                feeds: dict[str, np.ndarray], ref: tuple[np.ndarray, Requantization | None],
                reference: Callable[..., tuple[np.ndarray, Requantization | None]], size: Any, audit: BlockAudit,
                shapes: Shapes) -> None:  # fmt: skip
    """The block on one backend at the shapes its model allows: a full sequence, a padded batch (in the block's
    convention), a prefill and steps through its cache. A check that fails to run is a finding naming the check and
    the runtime's error, except where the runtime refuses that input by its operator's own rule (a padded batch with
    a ring-buffer window): a gap, named with what the model then cannot serve. ref and reference give the
    reference's y and, at accuracy_level 4, what z's int8 rounding may change in it (RequantizedTolerance); a check
    that passes only by that slack says so in the block's notes."""
    x = feeds["x"]
    batch, tokens = x.shape[:2]
    empty = empty_cache(block, batch)
    tol = tolerance_for(block.dtype)
    ref, requantized = ref
    slack = None if requantized is None else requantized.slack
    label = f"{backend}: " if backend != "ort-cpu" else ""
    short = tokens - shapes.padding
    right = block.padding == "right"  # as the block's reader found it (GroupQueryAttention's seqlens_k: right)

    def full() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return run(x, 0, empty)[0], ref, slack

    def padded() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        # the last row `padding` tokens shorter, the others whole; each row at its own tokens' positions (the short
        # row's padding left out of both sides)
        fill = np.zeros((1, tokens - short, ref.shape[-1]))
        lengths = np.array([tokens] * (batch - 1) + [short])
        if right:  # right padding: each row's length in seqlens_k (GroupQueryAttention's rule) or its mask
            row, row_rq = reference(**{k: v[-1:, :short] for k, v in feeds.items()})
            y = run(x, 0, empty, lengths=lengths)[0]
            row_slack = None if row_rq is None else row_rq.slack
            mine = y[-1:, :short]
        else:  # transformers' convention: left padding in attention_mask, the row's tokens at the end
            pad = tokens - short
            shifted = np.concatenate([np.zeros_like(x[-1:, :pad]), x[-1:, :short]], axis=1)
            # the reference of the padded row itself, its padding hidden: a term of the token index (a temperature)
            # sees the row's slots as the model does; position_ids count from its first token, as transformers'
            call = {"x": shifted, "key_padding_mask": np.arange(tokens)[None, :] < pad}
            if "position_ids" in feeds:
                call["position_ids"] = np.maximum(np.arange(tokens) - pad, 0)[None, :].astype(np.int64)
            row, row_rq = reference(**call)
            row, row_slack = row[:, pad:], None if row_rq is None else row_rq.slack[:, pad:]
            y = run(np.concatenate([x[:-1], shifted]), 0, empty, left=tokens - lengths)[0]
            mine = y[-1:, pad:]
        expected = np.concatenate([ref[:-1], np.concatenate([row, fill], axis=1)])
        held = None if slack is None or row_slack is None else \
            np.concatenate([slack[:-1], np.concatenate([row_slack, fill], axis=1)])  # fmt: skip
        if y.shape != ref.shape:  # an output of another shape: the comparison says so
            return y, expected, held
        return np.concatenate([y[:-1], np.concatenate([mine, fill], axis=1)]), expected, held

    def decode() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        # the model's own cache: what the block returns as present is the next step's past (a window kept in
        # a ring buffer, sliding_window_cache, returns its buffer of the window's capacity)
        y, pk, pv = run(x[:, : shapes.prefill], 0, empty)
        steps = [y]
        for t in range(shapes.prefill, tokens):
            y, pk, pv = run(x[:, t : t + 1], t, (pk, pv))
            steps.append(y)
        return np.concatenate(steps, axis=1), ref, slack

    # what the block's inputs and the model's dims allow: a padded batch where it reads each row's length
    # (seqlens_k, attention_mask) and two rows fit, decoding where it has a cache and single steps fit
    plan = [(f"{label}full sequence ({tokens} tokens)", full)]
    lengths_read = "seqlens_k" in block.inputs or "mask_index" in block.inputs or \
        bool({"attention_mask", "key_padding_mask"} & set(needs))  # fmt: skip
    if lengths_read and shapes.padded:
        rows = f"{batch - 1} row(s) of {tokens} and one of {short}" if batch > 2 else f"rows of {tokens} and {short}"
        plan.append((f"{label}padded batch ({rows} tokens, {'right' if right else 'left'}-padded)", padded))
    if "past_key" in block.inputs and shapes.prefill is not None:
        plan.append((f"{label}prefill {shapes.prefill} + {tokens - shapes.prefill} steps", decode))
    elif "past_key" in block.inputs and "cache" in shapes.fixed:
        audit.not_checked.append(f"block {block.index}: {label}decoding: its cache is fixed ({shapes.fixed['cache']}), "
                                 "a static cache the audit does not fill")  # fmt: skip
    rounded: list[str] = []  # the checks that pass by z's int8 rounding slack, past the float rule
    for name, check in plan:
        try:
            out, expected, held = check()
        except NotFed as e:
            audit.not_checked.append(f"block {block.index}: {name}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
            if check is padded and block.ring_cache:
                # ORT 1.31 refuses a row shorter than the prompt when the window is kept in a ring buffer
                audit.not_checked.append(f"block {block.index}: {name}: {backend} refuses it with a "
                                         f"sliding_window_cache ({first_line(e)}): on {backend} this model cannot "
                                         "serve prompts of different lengths in one batch")  # fmt: skip
            else:
                audit.findings.append(f"block {block.index}: {name}: {block.node} fails to run as exported: "
                                      f"{first_line(e)}")  # fmt: skip
            continue
        c = compare_arrays(name, out, expected, tol if held is None else RequantizedTolerance.of(tol, held), size)
        audit.checks.append(c)
        if c and held is not None and not compare_arrays(name, out, expected, tol, size):
            rounded.append(f"{c.name.split(' (')[0]} max_abs {c.max_abs:.3g} (fp32's rule {tol.atol(size, rms(expected)):.3g})")
        if c.shape_error is not None:  # an output of another shape (OpenVINO's empty one, on one thread)
            audit.findings.append(f"block {block.index}: {c.name}: {c.shape_error}")
        elif not c:
            audit.findings.append(f"block {block.index}: {c.name} against the reference fails: max_abs "
                                  f"{c.max_abs:.3g} > atol {c.atol:.3g}, first at position "
                                  f"{first_position(out, expected, c, held)}")  # fmt: skip
    if rounded:
        # said once per block: why a block past fp32's own rule passes
        audit.notes.append(f"block {block.index}: {'; '.join(rounded)}: within the int8 rounding of z (MatMulNBits "
                           f"accuracy_level 4 requantizes the output projection's input in blocks of "
                           f"{requantized.block}): {requantized.ambiguous} of its {requantized.elements} values lie "
                           "within fp32's rule of a rounding midpoint, which the kernel may round either way (up to "
                           f"{float(requantized.slack.max()):.3g} at an element of y)")  # fmt: skip


def first_line(e: BaseException) -> str:
    """A runtime's message in one line: ONNX Runtime's without its "[ONNXRuntimeError] : 2 : ... : " prefix, with
    the node it names ("node N (Op): ..."); OpenVINO's informative line (its first lines are source locations)."""
    if isinstance(e, AttnxError) and e.__cause__ is not None:  # a runner's error: the runtime's own, which it chains
        e = e.__cause__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].startswith("Exception from src/"):
        return next((line for line in lines if "not supported" in line), lines[-1])[:300]
    text = " ".join(lines)
    node = re.search(r"running (\w+) node\. Name:'([^']*)'", text)
    message = text.rsplit(" : ", 1)[-1]
    message = message.split("Status Message: ", 1)[-1] if node else message  # the node is named once, before it
    return (f"node {node.group(2)} ({node.group(1)}): " if node else "") + message[:300]


def rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64)))) if np.size(a) else 0.0


def first_position(out: np.ndarray, ref: np.ndarray, c: Comparison, slack: np.ndarray | None = None) -> int:
    """The first token position where some output is outside the comparison's bound (with z's rounding slack, the
    float rule's atol and the slack element by element)."""
    atol = c.atol if slack is None else c.atol - float(slack.max()) + slack
    bad = np.abs(np.asarray(out, np.float64) - ref) > atol + c.rtol * np.abs(ref)
    return int(np.argmax(bad.any(axis=(0, 2))))
