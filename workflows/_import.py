"""`attnx import`: one attention layer of a model people have, into attnx's contract (a folder with
config.json and weights.safetensors), and its check against the source model.

The check runs the source's own attention module (torch; Hugging Face's classes through
transformers, with its eager attention) on seeded inputs and masks, and compares its output with
attnx's float64 reference of the imported weights under the tolerance table: the mapping is right
when they agree. It also runs attnx's exported model (each lowering asked for) against the same
reference. Rows whose keys are all hidden are left out of the comparison with the source: attnx
gives the output bias there (z = 0), while Hugging Face's eager attention averages every value
(a softmax over equal masked scores) and torch's nn.MultiheadAttention fast path gives NaN.

A rotary decoder (Llama, Mistral, Qwen, Gemma, Phi-3, gpt-oss) is checked on a left-padded batch
with Hugging Face's position_ids, full-sequence and as a prefill then single-token steps: its whole
transformers model runs (eager, float32), with the layer's own input replaced by the check's x (a
forward pre-hook on its self_attn), so the masks, rotary tables and cache are the ones transformers
builds for that layer (its window, its layer type's rope). attnx's exported full-sequence graph and
step model run the same sequence in each lowering asked for; a lowering that does not express the
config yet is skipped with the reason (attnx.model.cores.core_for). An ALiBi decoder (BLOOM, MPT) is
checked alike: its model builds the bias from the attention mask as it does in use (BLOOM from the
mask's cumsum, MPT over the keys' index), and its slopes are compared with attnx's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from attnx.errors import CheckFailed, UsageError
from attnx.model.checkpoint import Checkpoint, fp8_blocks, read_checkpoint_config
from attnx.model.config import AttentionConfig
from attnx.model.contract import REFERENCE
from attnx.model.cores import core_for
from attnx.model.families import READ_AS
from attnx.model.importers import (
    ALIBI_FAMILIES,
    ROTARY_FAMILIES,
    ImportResult,
    check_import_target,
    import_weights,
    write_import,
)
from attnx.model.inputs import make_inputs
from attnx.model.reference import reference_attention
from attnx.model.rope import rope_frequencies
from attnx.model.terms import TERMS
from attnx.model.tolerance import ProblemSize, problem_size, rotated_cache_size, tolerance_for
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.runtimes.decode import decode_sequence, empty_cache, make_decode_inputs
from attnx.workflows._export import export_model

__all__ = ["ImportReport", "import_model", "check_against_source", "CHECK_SHAPE", "DECODE_CHECK"]

# (batch, seq, mem_seq) the check runs at: make_inputs' padding mask hides every key of batch
# element 1 (left out of the comparison with the source, see above) and some of the others'.
CHECK_SHAPE = (3, 7, 5)
# A rotary decoder's check: a batch of 3 left-padded rows (make_decode_inputs: 0, 2 and 4 padding
# tokens) of 9 tokens, full-sequence, and as a prefill of 5 then 4 single-token steps.
DECODE_CHECK = {"batch": 3, "tokens": 9, "prefill": 5}


@dataclasses.dataclass
class ImportReport:
    result: ImportResult
    out: str | None
    files: list[str]
    checks: list[Comparison]
    skipped: list[str] = dataclasses.field(default_factory=list)  # forms the check could not run, and why

    @property
    def passed(self) -> bool:
        return all(self.checks)


def import_model(
    source: Any,
    out: str | os.PathLike[str] | None,
    *,
    layer: int = 0,
    attention: str = "self",
    stack: str | None = None,
    key_padding_mask: bool | None = None,
    check: bool = False,
    lowerings: Sequence[str] = ("decomposed",),
    force: bool = False,
    kv_cache: bool = False,
    progress: Callable[[str], None] = lambda msg: None,
) -> ImportReport:
    """Import, check (with check) and write the attnx folder `out` (config.json,
    weights.safetensors; attnx.model.importers.write_import), published only once the check
    passed. CheckFailed (exit 1) when the import disagrees with its source: nothing is written.
    kv_cache: write the step model's config (a causal decoder's: 'kv_cache': true)."""
    if out is not None:
        check_import_target(os.fspath(out), force)
    progress(f"reading {source if isinstance(source, (str, os.PathLike)) else type(source).__name__}")
    result = import_weights(source, layer=layer, attention=attention, stack=stack, key_padding_mask=key_padding_mask,
                            kv_cache=kv_cache)  # fmt: skip
    skipped: list[str] = []
    checks = check_against_source(result, source, lowerings, progress, skipped) if check else []
    failed = [c for c in checks if not c]
    if failed:
        raise CheckFailed("the import disagrees with its source, nothing written: " + "; ".join(map(str, failed[:3])))
    files = write_import(result, out, force=force) if out is not None else []
    return ImportReport(result, None if out is None else os.fspath(out), files, checks, skipped)


def check_against_source(
    result: ImportResult,
    source: Any,
    lowerings: Sequence[str] = ("decomposed",),
    progress: Callable[[str], None] = lambda msg: None,
    skipped: list[str] | None = None,
    forms: Sequence[str] = ("full", "step"),
) -> list[Comparison]:
    """The source module and attnx's exported model (each lowering), each against attnx's float64
    reference of the imported weights, on the same seeded inputs and masks. A rotary decoder is
    checked full-sequence and step by step (_check_decoder; `forms` picks attnx's exported forms:
    "full" the full-sequence graph, "step" the step model); the forms a lowering cannot build yet
    are appended to `skipped` with the reason."""
    if result.architecture in ROTARY_FAMILIES or result.architecture in ALIBI_FAMILIES:
        return _check_decoder(result, os.fspath(source), lowerings, progress,
                              skipped if skipped is not None else [], forms)  # fmt: skip
    config, weights = result.config, result.weights
    batch, seq, mem_seq = CHECK_SHAPE
    feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, seed=11)
    ref = reference_attention(config, weights, **feeds)
    size = problem_size(config, weights, feeds)
    tol = tolerance_for("fp32")
    keep = _visible_rows(config, feeds)
    progress(f"running the source module ({result.architecture or 'torch'}) on the check inputs")
    theirs = _source_outputs(result, source, feeds)
    checks = [compare_arrays("source module vs attnx reference (rows with a visible key)", theirs[keep], ref[keep],
                             tol, size)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="attnx-import-check-") as tmp:
        for lowering in lowerings:
            progress(f"exporting and running the {lowering} lowering")
            path = os.path.join(tmp, f"{lowering}.onnx")
            export_model(config, path, weights, attention=lowering, validate=False)
            with create_runner("ort-cpu", ModelSource(config, None, path)) as runner:
                ours = runner.run(feeds)["y"]
            checks.append(compare_arrays(f"attnx {lowering} model vs attnx reference", ours, ref, tol, size))
    return checks


def _visible_rows(config: AttentionConfig, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """[batch, seq] True where query i sees at least one key."""
    batch, seq = feeds["x"].shape[:2]
    keys = feeds["memory"].shape[1] if config.cross else seq
    hidden = np.zeros((batch, seq, keys), dtype=bool)
    if config.causal:
        hidden |= np.triu(np.ones((seq, keys), dtype=bool), 1)[None]
    if "key_padding_mask" in feeds:
        hidden |= feeds["key_padding_mask"][:, None, :]
    return ~hidden.all(axis=-1)


def _source_outputs(result: ImportResult, source: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    config = result.config
    x = torch.from_numpy(feeds["x"])
    memory = torch.from_numpy(feeds["memory"]) if config.cross else None
    kpm = torch.from_numpy(feeds["key_padding_mask"]) if "key_padding_mask" in feeds else None
    with torch.inference_mode():
        if not isinstance(source, (str, os.PathLike)):  # an nn.MultiheadAttention
            m = memory if memory is not None else x
            causal = torch.triu(torch.ones(x.shape[1], m.shape[1], dtype=torch.bool), 1) if config.causal else None
            y, _ = source(x if source.batch_first else x.transpose(0, 1),
                          m if source.batch_first else m.transpose(0, 1), m if source.batch_first else m.transpose(0, 1),
                          key_padding_mask=kpm, attn_mask=causal, need_weights=False)  # fmt: skip
            return (y if source.batch_first else y.transpose(0, 1)).numpy()
        return _hugging_face_outputs(result, os.fspath(source), x, memory, kpm).numpy()


def _hugging_face_outputs(result: ImportResult, folder: str, x: Any, memory: Any, kpm: Any) -> Any:
    """The attention block of `result` in the checkpoint's own transformers classes (eager)."""
    import torch

    try:
        import transformers
    except ImportError:
        raise UsageError("--check runs the source model, which needs transformers: pip install transformers") from None
    with _quiet_transformers(transformers):
        model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    # The additive mask every eager attention takes, [batch, 1, queries, keys]: 0 sees, lowest hides.
    keys = memory.shape[1] if memory is not None else x.shape[1]
    hidden = torch.zeros(x.shape[0], 1, x.shape[1], keys, dtype=torch.bool)
    if result.config.causal:
        hidden |= torch.triu(torch.ones(x.shape[1], keys, dtype=torch.bool), 1)
    if kpm is not None:
        hidden |= kpm[:, None, None, :]
    mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
    n, kind = result.layer, result.architecture
    if kind in ("bert", "roberta"):
        block = model.encoder.layer[n].attention
        return block.output.dense(block.self(x, attention_mask=mask)[0])
    if kind == "vit":
        if hasattr(model, "layers"):  # transformers 5: layers[n].attention holds q/k/v/o_proj
            return model.layers[n].attention(x)[0]
        block = model.encoder.layer[n].attention  # earlier: attention.attention, attention.output.dense
        return block.output.dense(block.attention(x)[0])
    if kind == "gpt2":
        return model.h[n].attn(x, attention_mask=mask)[0]
    if kind in ("bart", "whisper"):
        stack = model.encoder if result.stack == "encoder" else model.decoder
        block = stack.layers[n].encoder_attn if result.attention == "cross" else stack.layers[n].self_attn
        return block(x, key_value_states=memory, attention_mask=mask)[0]
    if kind == "t5":
        block = model.decoder.block[n].layer[1].EncDecAttention
        return block(x, mask=mask, key_value_states=memory)[0]
    raise UsageError(f"--check has no way to run {kind!r} modules")  # pragma: no cover - the table and this agree


# Rotary decoders ----------------------------------------------------------------------------------
def _check_decoder(
    result: ImportResult,
    folder: str,
    lowerings: Sequence[str],
    progress: Callable[[str], None],
    skipped: list[str],
    forms: Sequence[str],
) -> list[Comparison]:
    """The transformers layer, full-sequence and as a prefill then single-token steps, and attnx's
    exported forms (each lowering), each against attnx's float64 reference, on one left-padded
    batch with Hugging Face's position_ids (make_decode_inputs)."""
    full = dataclasses.replace(result.config, kv_cache=False)
    step = dataclasses.replace(result.config, kv_cache=True)
    weights = result.weights
    batch, tokens, prefill = DECODE_CHECK["batch"], DECODE_CHECK["tokens"], DECODE_CHECK["prefill"]
    feeds = make_decode_inputs(full, batch, tokens, seed=11)
    past = dict(zip((spec.name for spec in step.cache_specs()), empty_cache(step, batch)))  # past_key, ..
    ref_y = reference_attention(full, weights, **feeds)
    # The reference decodes too, step by step: longrope switches to its long factors for a whole call
    # once its largest position + 1 passes the original length, so keys cached before the switch keep
    # the short rotation (transformers' rule) and the steps differ from the full forward after it.
    with create_runner(REFERENCE, ModelSource(step, weights)) as reference:
        ref_steps, ref_cache = decode_sequence(reference, feeds, prefill, step)
    size = problem_size(step, weights, {**feeds, **past})
    tol = tolerance_for("fp32")
    keep = _visible_rows(full, feeds)
    label = f"[batch={batch},tokens={tokens},prefill={prefill}]"
    progress(f"running the source layer ({result.architecture} {result.layer}, transformers, eager) "
             f"full-sequence and as a prefill of {prefill} + {tokens - prefill} steps")  # fmt: skip
    theirs_full, theirs_steps, their_table = _hugging_face_decoder(result, folder, feeds, prefill)
    checks = [_alibi_slopes_check(full, result.architecture, their_table) if result.architecture in ALIBI_FAMILIES
              else _rope_table_check(full, their_table)] if result.architecture in ALIBI_FAMILIES or \
        full.rope is not None else []  # fmt: skip (a NoPE layer has no table)
    checks += [
        compare_arrays(f"source layer vs attnx reference, full sequence{label} (rows with a visible key)",
                       theirs_full[keep], ref_y[keep], tol, size),
        compare_arrays(f"source layer vs attnx reference, prefill + steps{label} (rows with a visible key)",
                       theirs_steps[keep], ref_steps[keep], tol, size),
    ]  # fmt: skip
    cache_size = rotated_cache_size(step, size, ref_cache[0])  # present_key (present_latent): keys as rotated
    with tempfile.TemporaryDirectory(prefix="attnx-import-check-") as tmp:
        for lowering in lowerings:
            for form, config in (("full", full), ("step", step)):
                if form not in forms:
                    continue
                what = "full-sequence graph" if form == "full" else "step model"
                try:
                    core_for(lowering, config)
                except UsageError as e:
                    skipped.append(f"attnx {lowering} {what}: {e}")
                    continue
                progress(f"exporting and running the {lowering} {what}")
                path = os.path.join(tmp, f"{lowering}-{form}.onnx")
                export_model(config, path, weights, attention=lowering, validate=False)
                with create_runner("ort-cpu", ModelSource(config, None, path)) as runner:
                    if form == "full":
                        ours = runner.run(feeds)["y"]
                        checks.append(compare_arrays(f"attnx {lowering} {what} vs attnx reference{label}", ours,
                                                     ref_y, tol, size))  # fmt: skip
                        continue
                    y, cache = decode_sequence(runner, feeds, prefill, config)
                presents = [(spec.name, got, ref, cache_size if i == 0 else size) for i, (spec, got, ref) in
                            enumerate(zip(step.cache_specs(prefix="present_"), cache, ref_cache))]  # fmt: skip
                for out, got, ref, out_size in [("y", y, ref_steps, size), *presents]:
                    checks.append(compare_arrays(f"attnx {lowering} {what} {out} vs attnx reference, prefill + "
                                                 f"steps{label}", got, ref, tol, out_size))  # fmt: skip
    return checks


def _rope_table_check(config: AttentionConfig, theirs: dict[str, np.ndarray]) -> Comparison:
    """attnx's rope table (inv_freq and attention_factor: attnx.model.rope.rope_frequencies) against
    the one transformers built: the check's positions (to 8) turn the slow pairs by too little to
    show a wrong low frequency (llama3's interpolated band, longrope's long factors), this does. The
    tolerance is the fp32 rule of one rounding (transformers computes them in float32)."""
    rope = config.rope
    ours = {"short": np.append(*rope_frequencies(rope))}
    if "long" in theirs:
        ours["long"] = np.append(*rope_frequencies(rope, rope.scaling["original_max_position_embeddings"] + 1))
    names = " and ".join(f"{k} factors" for k in theirs) if "long" in theirs else "inv_freq"
    return compare_arrays(f"rope table vs transformers' ({names}, attention_factor)",
                          np.concatenate([theirs[k] for k in sorted(theirs)]),
                          np.concatenate([ours.get(k, np.zeros(0)) for k in sorted(theirs)]),
                          tolerance_for("fp32"), ProblemSize(1))  # fmt: skip


def _alibi_slopes_check(config: AttentionConfig, family: str, theirs: np.ndarray) -> Comparison:
    """attnx's ALiBi slopes (the term's table: attnx.model.alibi) against the ones the transformers model builds its bias
    from (_hugging_face_alibi): the check's distances (to 8) move a late head's small slope by too little
    to show a wrong one. The tolerance is the fp32 rule at K = 1 (transformers computes them in float32;
    BLOOM's powers of a float32 base and MPT's slopes pass it for 1 to 256 heads, measured)."""
    return compare_arrays(f"alibi slopes vs transformers' ({family}, {config.n_heads} heads)", theirs,
                          TERMS["alibi"].table(config), tolerance_for("fp32"), ProblemSize(1))  # fmt: skip


def _source_config(transformers: Any, folder: str, architecture: str) -> Any:
    """transformers' config of the checkpoint; a model_type read as a transformers family's (READ_AS: Kimi K2's
    kimi_k2) by that family's config class, from config.json's keys, its own code never run."""
    if architecture not in READ_AS:
        return transformers.AutoConfig.from_pretrained(folder)
    stated = {k: v for k, v in read_checkpoint_config(folder).items()
              if k not in ("model_type", "auto_map", "architectures", "transformers_version")}  # fmt: skip
    return transformers.AutoConfig.for_model(READ_AS[architecture], **stated)


def _source_model(transformers: Any, torch: Any, folder: str, hf_config: Any) -> Any:
    """transformers' model of the checkpoint in float32, eager attention. FP8 blocks (DeepSeek-V3's published
    weights): transformers loads them only through accelerate, and on a CPU into bfloat16, so its model is made from
    the config without the quantization and given the weights dequantized as the import reads them (Checkpoint):
    the check then holds transformers' attention to attnx's, over the same weights."""
    if fp8_blocks(hf_config.to_dict()) is None:
        return transformers.AutoModel.from_pretrained(folder, config=hf_config, attn_implementation="eager",
                                                      dtype=torch.float32).eval()  # fmt: skip
    del hf_config.quantization_config
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModel.from_config(hf_config, dtype=torch.float32).eval()
    ckpt = Checkpoint(folder)
    state = {}
    for name in model.state_dict():
        if ckpt.find(name) is not None:
            state[name] = torch.from_numpy(ckpt.get(name)[1])
    missing = [name for name in model.state_dict() if name not in state and "rotary" not in name]
    if missing:
        raise UsageError(f"{folder}: the checkpoint has no tensor {missing[0]!r} that transformers' model takes")
    model.load_state_dict(state, strict=False)
    return model


def _hugging_face_alibi(model: Any, family: str) -> np.ndarray:
    """The slopes the transformers model's forward builds its ALiBi bias with, read back from the bias
    itself: BLOOM's build_alibi_tensor of a mask of two tokens (key 1: the slope), MPT's
    build_mpt_alibi_tensor as its forward calls it (max_seq_len keys, the default bias max; the last
    two keys: -slope, 0)."""
    import torch

    if family == "bloom":
        bias = model.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), model.num_heads, torch.float32)
        return bias[:, 0, 1].double().numpy()  # (N, 1, 2): slope * position 0, 1
    bias = model.build_mpt_alibi_tensor(model.num_heads, model.config.max_seq_len)  # (N, 1, max_seq_len)
    return (bias[:, 0, -1] - bias[:, 0, -2]).double().numpy()


# Where each decoder family keeps a layer's attention module, and which of its inputs is the residual
# that the module adds itself (BLOOM's: zeros, so that its output is the attention block's alone).
_ATTENTION_MODULES = {"bloom": ("h", "self_attention", "residual"), "mpt": ("blocks", "attn", None)}


def _hugging_face_decoder(
    result: ImportResult, folder: str, feeds: dict[str, np.ndarray], prefill: int
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray] | np.ndarray]:
    """The layer's output in its own transformers model (eager, float32): the whole sequence at once,
    then a prefill of `prefill` tokens and one token per step on the cache transformers keeps. The
    model runs up to the layer (the layers above are dropped: no weights of theirs are read), with
    the layer's self_attn input replaced by the check's x (a forward pre-hook); its output is taken
    by a forward hook. Hugging Face's attention mask (1 = token) and position_ids (rope) are fed as
    given. Also the rope tables the model built for the layer's type ({"short"[, "long"]}: inv_freq
    with attention_factor appended), read from its rotary embedding (_hugging_face_rope), or for an
    ALiBi decoder its slopes (_hugging_face_alibi)."""
    import torch

    try:
        import transformers
    except ImportError:
        raise UsageError("--check runs the source model, which needs transformers: pip install transformers") from None
    n = result.layer
    with _quiet_transformers(transformers):
        hf_config = _source_config(transformers, folder, result.architecture)
    hf_config.num_hidden_layers = n + 1  # the layers above n are not needed, nor loaded
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = hf_config.layer_types[: n + 1]
    with _quiet_transformers(transformers):  # its load report would name every tensor of the layers dropped
        model = _source_model(transformers, torch, folder, hf_config)
    family = result.architecture
    stack, name, residual = _ATTENTION_MODULES.get(family, ("layers", "self_attn", None))
    attention = getattr(getattr(model, stack)[n], name)
    tables = _hugging_face_alibi(model, family) if family in ALIBI_FAMILIES else _hugging_face_rope(model, n)
    x = torch.from_numpy(feeds["x"])
    tokens = x.shape[1]
    mask = feeds.get("key_padding_mask")
    attended = torch.from_numpy(~mask if mask is not None else np.ones(x.shape[:2], bool)).to(torch.int64)
    positions = torch.from_numpy(feeds["position_ids"]) if "position_ids" in feeds else None
    current: dict[str, Any] = {}
    outputs: list[Any] = []

    def replace_input(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": current["x"]}
        else:
            args = (current["x"], *args[1:])
        if residual is not None:  # added by the module itself (BLOOM's dropout_add): zeros
            if residual in kwargs:
                kwargs = {**kwargs, residual: torch.zeros_like(current["x"])}
            else:
                args = (args[0], torch.zeros_like(current["x"]), *args[2:])
        return args, kwargs

    def take_output(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        outputs.append(output[0].detach())

    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    hooks = [attention.register_forward_pre_hook(replace_input, with_kwargs=True),
             attention.register_forward_hook(take_output, with_kwargs=True)]  # fmt: skip

    def run(start: int, stop: int, cache: Any) -> Any:
        current["x"] = x[:, start:stop]
        embeds = torch.zeros(x.shape[0], stop - start, hf_config.hidden_size)  # replaced at layer n
        where = {} if positions is None else {"position_ids": positions[:, start:stop]}
        out = model(inputs_embeds=embeds, attention_mask=attended[:, :stop], use_cache=cache is not False, **where,
                    **({cache_arg: cache} if cache not in (None, False) else {}))  # fmt: skip
        return out["cache"] if "cache" in out else out.get("past_key_values")

    try:
        with torch.inference_mode(), _quiet_transformers(transformers):
            run(0, tokens, False)
            cache = run(0, prefill, None)
            for t in range(prefill, tokens):
                cache = run(t, t + 1, cache)
    finally:
        for hook in hooks:
            hook.remove()
    whole = outputs[0].numpy()
    steps = torch.cat(outputs[1:], dim=1).numpy()
    return whole, steps, tables


def _hugging_face_rope(model: Any, layer: int) -> dict[str, np.ndarray]:
    """The frequencies transformers' model rotates the layer by, with attention_factor appended:
    its rotary embedding's inv_freq as built from the config (the layer type's, for Gemma 3), and
    for longrope the long factors' set (its ROPE_INIT_FUNCTIONS at the original length + 1)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.rotary_emb
    # a rotary embedding per layer type (Gemma 3): the layer's own
    layer_type = model.config.layer_types[layer] if getattr(rotary, "layer_types", None) else None
    prefix = f"{layer_type}_" if layer_type else ""
    short = getattr(rotary, f"{prefix}original_inv_freq")
    factor = getattr(rotary, f"{prefix}attention_scaling")
    tables = {"short": np.append(short.double().numpy(), factor)}
    kind = rotary.rope_type[layer_type] if layer_type else rotary.rope_type
    if kind == "longrope":
        params = model.config.rope_parameters[layer_type] if layer_type else model.config.rope_parameters
        kw = {"layer_type": layer_type} if layer_type else {}
        long, long_factor = ROPE_INIT_FUNCTIONS[kind](model.config, None,
                                                      seq_len=params["original_max_position_embeddings"] + 1, **kw)  # fmt: skip
        tables["long"] = np.append(long.double().numpy(), long_factor)
    return tables


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """transformers' warnings and progress bars off while it loads a checkpoint (the CLI's output
    stays attnx's own), restored after."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
