"""The attention cores, as data: what each operator can compute, and the one question every check asks.

A core is the operator (or the few standard ops) that computes softmax(scale * q.k + mask) v in a
graph. Each entry says what it is in the graph (op, domain, opset), the forms it is built in (FORMS),
its dtypes, the terms of the formula it expresses (attnx.model.terms) and how, and the limits of its
kernel beyond the terms (measured refusals of ONNX Runtime). Its graph half (how attnx writes it, how a
node of it and the block around it are read back, whoever wrote the graph) registers itself by the core's
name in attnx.export.cores (GRAPH_CORES: one module a core), as transformers' attention kernels register
in ALL_ATTENTION_FUNCTIONS.

    why_not(core, config, dtype, form)  every reason the core cannot compute the config, [] when it can
    why_not_on_cuda(...)                the same, and what ONNX Runtime's CUDA kernel refuses beyond it
    core_for(lowering, config, ...)     the core a lowering (--attention) writes for a config, or one
                                        UsageError with every candidate's reasons
    LOWERINGS                           the user's choices (--attention) and the cores behind each
    Core.found(seen)                    whether a graph's node is the core (attnx.model.recognise asks each entry)

The checks of export, build, optimize, parity and bench, the CLI's choices and the docs' capability
tables (docs/reference/capabilities.md: core_table(), capability_table()) are all read from these tables. No torch and no onnx here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping

from attnx.errors import UsageError
from attnx.model._core_limits import (
    MS_DOMAIN,
    QUANTIZED,
    Limits,
    decomposed_limits,
    gqa_cuda_limits,
    gqa_limits,
    grouped_mha_cuda_limits,
    grouped_mha_limits,
    mha_limits,
    no_limits,
    switch_cuda_limits,
    switch_limits,
)
from attnx.model.config import AttentionConfig
from attnx.model.seen import Found, Seen, tells_grouped, tells_mha, tells_packed, tells_switch
from attnx.model.terms import TERMS

__all__ = [
    "FORMS",
    "Takes",
    "TermOps",
    "Core",
    "CORES",
    "Lowering",
    "LOWERINGS",
    "AUTO",
    "MEASURE",
    "OLD_SPELLINGS",
    "LOWERING_OF_CORE",
    "BUFFER_CORES",
    "LENGTHS_CORES",
    "DEFAULT_BUFFER_CORE",
    "MS_DOMAIN",
    "buffer_core_of",
    "form_of",
    "why_not",
    "why_not_on_cuda",
    "attention_help",
    "buffer_core_help",
    "core_for",
    "export_core",
    "lowerings_for",
    "GENERATED_TABLES",
    "capability_table",
    "core_table",
    "lowering_table",
    "term_table",
    "update_markdown",
]

# The forms a core is built in: the full-sequence model, and the step model's two (docs/concepts/step-forms.md):
# a growing cache (past in, past + new out) or one fixed-capacity buffer written in place.
FORMS = ("full", "growing", "buffer")
_EVERY_DTYPE = ("fp32", "fp16", *QUANTIZED)


@dataclasses.dataclass(frozen=True)
class Takes:
    """How a core expresses a term, and in which of its forms."""

    how: str
    forms: tuple[str, ...] = FORMS


class TermOps(enum.Enum):
    """The operators a core's graph writes the q/k norms and the rotation in (attnx.export._llm.norm_and_rotate)."""

    STANDARD = "standard ops"  # ReduceMean, Sqrt, Div, Mul; Slice, Mul, Concat: any opset
    ONNX = "ONNX's opset-23 ops"  # RMSNormalization-23, RotaryEmbedding-23
    CONTRIB = "com.microsoft's"  # RMSNormalization-23 and com.microsoft.RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class Core:
    """One attention core (the module doc)."""

    name: str
    label: str  # what it is in the graph, as reports say it
    domain: str  # "" for the standard ops
    op_type: str  # the node a reader finds it by ("Softmax" for the decomposed core)
    opset: int  # the lowest opset of its domain's ops that it needs (the default domain's for decomposed)
    forms: tuple[str, ...]
    dtypes: tuple[str, ...]
    terms: Mapping[str, Takes]
    limits: Limits = no_limits  # reasons beyond the terms: its kernel's own refusals
    summary: str = ""
    term_ops: TermOps = TermOps.CONTRIB  # the operators of its q/k norms and rotation
    holds_scores: bool = False  # its kernel holds the whole score matrix (the memory estimate's)
    cuda_limits: Limits = no_limits  # what ONNX Runtime's CUDA kernel refuses beyond `limits` (why_not_on_cuda)
    tells: Callable[[Seen], Found] = lambda seen: Found.NODE  # its node from another core's of its op (model.seen)
    fallback: bool = False  # the core a graph holds where none other is found (its op stays beside a fused core)
    form_opsets: Mapping[str, int] = dataclasses.field(default_factory=dict)  # a form's own opset above `opset`
    # its buffer form reads each row's own length (seqlens_k: rows of any lengths in one call, a past buffer longer
    # than what is filled); grouped-mha's reads one past_sequence_length for every row
    row_lengths: bool = False

    def opset_of(self, form: str) -> int:
        """The lowest opset of its domain's ops that its `form` needs (the decomposed buffer form: TensorScatter-24)."""
        return max(self.opset, self.form_opsets.get(form, self.opset))

    def found(self, seen: Seen) -> Found:
        """Whether a node is this core (recognise): its op in its domain, told apart by `tells`."""
        if (seen.domain, seen.op_type) != (self.node_domain, self.op_type):
            return Found.NO
        return self.tells(seen)

    def takes(self, term: str, form: str) -> bool:
        t = self.terms.get(term)
        return t is not None and form in t.forms

    @property
    def node_domain(self) -> str:
        """The domain of the node a reader finds it by: its own, but the default domain's for an If (the switch core:
        an If around its branches' ops of its domain)."""
        return "" if self.op_type == "If" else self.domain


_MASKS = {
    "causal": Takes("the causal mask"),
    "key_padding_mask": Takes("the padding mask"),
}
_BOOL_GRID = "a boolean grid over token index (Where)"
_PLAIN_NORM = "ReduceMean, Add, Sqrt, Div after the rotation"
_ROWS_BIAS = "an additive attention_bias over a token's rows"
_TEMPERATURE = "a Mul of q by its token index's factor (Range, Floor, Log)"

CORES: dict[str, Core] = {
    c.name: c
    for c in (
        Core(
            "decomposed", "MatMul, Softmax, MatMul", "", "Softmax", 18, FORMS, _EVERY_DTYPE,
            {
                "grouped_heads": Takes("a group's query heads stacked on the query axis (no copy of the keys)"),
                "cross": Takes("k and v projected from memory", ("full",)),
                "qk_norm": Takes("ReduceMean, Sqrt, Div, Mul"),
                "rope": Takes("Slice, Mul, Concat over cos/sin of position_ids (buffer: each row's, from seqlens_k)"),
                "qk_l2_norm": Takes(_PLAIN_NORM),
                "attn_temperature": Takes(_TEMPERATURE, ("full", "growing")),
                "kv_cache": Takes("Concat onto past_key/past_value (growing); TensorScatter-24 writing each row's new "
                                  "tokens into the buffer at seqlens_k (buffer)", ("growing", "buffer")),
                "softcap": Takes("Div, Tanh, Mul"),
                "alibi": Takes("an Add of slope_h * (j - i) (Range, Sub, Mul)", ("full", "growing")),
                "causal": Takes(_BOOL_GRID),
                "sliding_window": Takes(_BOOL_GRID),
                "attention_chunk": Takes(_BOOL_GRID),
                "key_padding_mask": Takes(_BOOL_GRID, ("full", "growing")),
                "sinks": Takes("a logit column joined before the Softmax, dropped after it"),
                "latent": Takes("the latent's MatMuls and RMSNorms, the latent cache (past_latent); kv_b_proj's MatMul "
                                "expanding each head's k and v (full), folded into q and the heads' outputs (the "
                                "step: absorbed, the latents one key/value head)"),
            },
            decomposed_limits, summary="standard ops, runs anywhere (its buffer form: opset 24's TensorScatter)",
            term_ops=TermOps.STANDARD, holds_scores=True, fallback=True, form_opsets={"buffer": 24}, row_lengths=True,
        ),
        Core(
            "attention23", "Attention (opset 23)", "", "Attention", 23, ("full", "growing"), _EVERY_DTYPE,
            {
                "grouped_heads": Takes("kv_num_heads"),
                "cross": Takes("k and v projected from memory", ("full",)),
                "qk_norm": Takes("RMSNormalization-23 nodes"),
                "rope": Takes("RotaryEmbedding-23 nodes fed cos/sin of position_ids"),
                "qk_l2_norm": Takes(_PLAIN_NORM),
                "attn_temperature": Takes(_TEMPERATURE),
                "kv_cache": Takes("past_key/past_value inputs", ("growing",)),
                "softcap": Takes("its softcap attribute"),
                "alibi": Takes("an additive float attn_mask"),
                "causal": Takes("a boolean attn_mask over token index"),
                "sliding_window": Takes("a boolean attn_mask over token index"),
                "attention_chunk": Takes("a boolean attn_mask over token index"),
                "key_padding_mask": Takes("a boolean attn_mask over token index"),
            },
            summary="the standard operator", term_ops=TermOps.ONNX, holds_scores=True,
        ),
        Core(
            "mha", f"{MS_DOMAIN}.MultiHeadAttention", MS_DOMAIN, "MultiHeadAttention", 1, ("full", "growing"),
            _EVERY_DTYPE,
            {
                "cross": Takes("key and value from memory's projections", ("full",)),
                "kv_cache": Takes("past_key/past_value", ("growing",)),
                "alibi": Takes("attention_bias [1, H, S, T]"),
                "causal": Takes("unidirectional=1"),
                "key_padding_mask": Takes("key_padding_mask int32 (1 keeps); fully hidden rows zeroed after"),
            },
            mha_limits, summary="ONNX Runtime's fused kernel (flash attention on CPU and CUDA)", tells=tells_mha,
        ),
        Core(
            "mha-packed", f"one q/k/v MatMul, Split, {MS_DOMAIN}.MultiHeadAttention", MS_DOMAIN, "MultiHeadAttention",
            1, ("full",), _EVERY_DTYPE,
            {
                "alibi": Takes("attention_bias [1, H, S, T]"),
                "causal": Takes("unidirectional=1"),
                "key_padding_mask": Takes("key_padding_mask int32 (1 keeps); fully hidden rows zeroed after"),
            },
            summary="one GEMM for q, k and v", tells=tells_packed,
        ),
        Core(
            "ms-attention", f"{MS_DOMAIN}.Attention (packed q/k/v weights)", MS_DOMAIN, "Attention", 1, ("full",),
            ("fp32", "fp16"),
            {
                "causal": Takes("unidirectional=1"),
                "key_padding_mask": Takes("mask_index int32 (1 keeps); fully hidden rows zeroed after"),
            },
            summary="ONNX Runtime's BERT-style op: the projection inside the op (its weights cannot be quantized)",
        ),
        Core(
            "gqa", f"{MS_DOMAIN}.GroupQueryAttention", MS_DOMAIN, "GroupQueryAttention", 1, FORMS, _EVERY_DTYPE,
            {
                "grouped_heads": Takes("kv_num_heads"),
                "qk_norm": Takes("RMSNormalization-23 nodes (the op's q_norm_weight runs on CUDA only)"),
                "rope": Takes("com.microsoft.RotaryEmbedding nodes at each token's position; in the buffer form the "
                              "op itself (do_rotary, cos/sin tables)"),
                "qk_l2_norm": Takes(_PLAIN_NORM, ("full", "growing")),
                "attn_temperature": Takes(_TEMPERATURE, ("full", "growing")),
                "kv_cache": Takes("past/present (growing); one buffer written in place (buffer)", ("growing", "buffer")),
                "softcap": Takes("its softcap attribute"),
                "alibi": Takes("attention_bias (added after its softcap)", ("full", "growing")),
                "causal": Takes("the op's causal attention"),
                "sliding_window": Takes("local_window_size (key j seen by query p iff p - W < j <= p)"),
                "attention_chunk": Takes("an additive attention_bias", ("full", "growing")),
                "key_padding_mask": Takes("an additive attention_bias", ("full", "growing")),
                "sinks": Takes("head_sink"),
            },
            gqa_limits, summary="ONNX Runtime's grouped-query kernel", cuda_limits=gqa_cuda_limits, row_lengths=True,
        ),
        Core(
            "grouped-mha", f"{MS_DOMAIN}.MultiHeadAttention, a group's query heads as rows", MS_DOMAIN,
            "MultiHeadAttention", 1, ("growing", "buffer"), ("fp32", *QUANTIZED),
            {
                "grouped_heads": Takes("a group's query heads as rows of one key/value head (each read once a step)"),
                "qk_norm": Takes("RMSNormalization-23 nodes"),
                "rope": Takes("com.microsoft.RotaryEmbedding nodes at each token's position (growing), at the token "
                              "index (buffer)"),
                "qk_l2_norm": Takes(_PLAIN_NORM, ("growing",)),
                "attn_temperature": Takes(_TEMPERATURE, ("growing",)),
                "kv_cache": Takes("past/present (growing); one buffer written in place (past_sequence_length)",
                                  ("growing", "buffer")),
                "causal": Takes(_ROWS_BIAS),
                "sliding_window": Takes(_ROWS_BIAS),
                "attention_chunk": Takes(_ROWS_BIAS, ("growing",)),
                "key_padding_mask": Takes(_ROWS_BIAS, ("growing",)),
            },
            grouped_mha_limits,
            summary="a group's query heads as rows: each key/value head read once a step (a CPU form: no fp16)",
            cuda_limits=grouped_mha_cuda_limits, tells=tells_grouped,
        ),
        Core(
            "switch", "If on the call: gqa for a prompt (growing: one with no padding), grouped-mha otherwise", MS_DOMAIN,
            "If", 1,
            ("growing", "buffer"), ("fp32", *QUANTIZED),
            {
                "grouped_heads": Takes("both branches"),
                "qk_norm": Takes("both branches"),
                "rope": Takes("both branches"),
                "kv_cache": Takes("past/present (growing); each branch writes the buffer in place (buffer)",
                                  ("growing", "buffer")),
                "causal": Takes("both branches"),
                "sliding_window": Takes("both branches"),
                "key_padding_mask": Takes("a padded call takes the grouped branch", ("growing",)),
            },
            switch_limits, summary="what gqa and grouped-mha both express", cuda_limits=switch_cuda_limits,
            tells=tells_switch,
        ),
    )
}  # fmt: skip
# The buffer form's cores (--buffer-core). ort-fused's default is GroupQueryAttention: it takes every term and fp16;
# the decomposed lowering writes its own (TensorScatter-24: any cache layout, the latent's too).
DEFAULT_BUFFER_CORE = "gqa"
BUFFER_CORES = tuple(sorted((name for name, core in CORES.items() if "buffer" in core.forms),
                            key=lambda name: name != DEFAULT_BUFFER_CORE))  # the default first  # fmt: skip
# The buffer cores that read each row's length (Core.row_lengths): what serves rows of other lengths together, and
# the only ones that compute a block bound to GroupQueryAttention's lengths (attnx optimize's plan)
LENGTHS_CORES = tuple(name for name in BUFFER_CORES if CORES[name].row_lengths)


def form_of(config: AttentionConfig, form: str | None = None) -> str:
    """The form asked, or the config's own: its step model's growing form with kv_cache, else full."""
    if form is None:
        return "growing" if config.kv_cache else "full"
    if form not in FORMS:
        raise UsageError(f"unknown form {form!r} (known: {', '.join(FORMS)})")
    if (form == "full") == config.kv_cache:
        raise UsageError(
            f"the {form} form is for a config {'without' if form == 'full' else 'with'} 'kv_cache': true"
        )
    return form


def why_not(core: str | Core, config: AttentionConfig, dtype: str = "fp32", form: str | None = None) -> list[str]:
    """Every reason `core` cannot compute `config` in `dtype` and `form` (FORMS; None: the config's
    own, form_of), each naming what is missing; [] when it can."""
    core = CORES[core] if isinstance(core, str) else core
    form = form_of(config, form)
    reasons = []
    if form not in core.forms:
        reasons.append(f"{core.label} has no {form} form (it has: {', '.join(core.forms)})")
    if dtype not in core.dtypes:
        reasons.append(f"{core.label} is not built in {dtype} (it is in: {', '.join(core.dtypes)})")
    lacks = [t for t in config.terms if not core.takes(t, form)]
    if lacks:
        where = f" in the {form} form" if form in core.forms and any(t in core.terms for t in lacks) else ""
        reasons.append(f"{core.label} does not express {', '.join(lacks)}{where}")
    reasons += list(core.limits(config, dtype, form))
    return reasons


def why_not_on_cuda(core: str | Core, config: AttentionConfig, dtype: str = "fp32", form: str | None = None) -> list[str]:
    """why_not, and every reason ONNX Runtime's CUDA kernel of `core` refuses the config (Core.cuda_limits): a
    core the CPU runs and CUDA places off the GPU or runs out of bounds; [] when CUDA runs it."""
    core = CORES[core] if isinstance(core, str) else core
    return why_not(core, config, dtype, form) + list(core.cuda_limits(config, dtype, form_of(config, form)))


# Lowerings: the user's choice (--attention), and the cores behind it --------------------------------
@dataclasses.dataclass(frozen=True)
class Lowering:
    """One choice of `--attention`: the cores it writes, per form, in order of preference (the first
    that computes the config is written)."""

    name: str
    cores: Mapping[str, tuple[str, ...]]  # {form: cores}; the buffer form's is --buffer-core's
    torch_core: str | None = None  # the torch module's core this lowering's full form is traced from
    export: bool = True  # a choice of `attnx export/build/optimize --attention`
    auto: bool = False  # a candidate `measure` measures (MEASURE)
    bench: bool = False  # timed by `attnx bench` on ONNX Runtime by default

    @property
    def graph(self) -> str:
        """What the lowering is in the graph, as reports say it."""
        return " or ".join(dict.fromkeys(CORES[c].label for cores in self.cores.values() for c in cores))

    @property
    def traced(self) -> bool:
        """Its full form is the torch module's export (attnx.export.export_onnx), not written from the registry."""
        return self.torch_core is not None

    @property
    def contrib(self) -> bool:
        """It writes ONNX Runtime's contrib operators (com.microsoft) in some form."""
        return any(CORES[c].domain == MS_DOMAIN for cores in self.cores.values() for c in cores)

    def holds_scores(self, form: str = "full") -> bool:
        """Its cores of `form` hold the whole score matrix (Core.holds_scores)."""
        return any(CORES[c].holds_scores for c in self.cores.get(form, ()))

    @property
    def opset(self) -> int:
        """The default-domain opset it is written at, at least."""
        return max(18, *(CORES[c].opset for cores in self.cores.values() for c in cores if not CORES[c].domain))


LOWERINGS: dict[str, Lowering] = {
    lw.name: lw
    for lw in (
        Lowering("decomposed", {"full": ("decomposed",), "growing": ("decomposed",), "buffer": ("decomposed",)},
                 torch_core="decomposed", bench=True),
        Lowering("onnx", {"full": ("attention23",), "growing": ("attention23",)}, bench=True),
        Lowering("ort-fused", {"full": ("mha", "gqa"), "growing": ("mha", "gqa", "grouped-mha", "switch"),
                                "buffer": tuple(c for c in BUFFER_CORES if CORES[c].domain == MS_DOMAIN)},
                 auto=True, bench=True),
        Lowering("ort-fused-packed", {"full": ("mha-packed",)}, export=False, auto=True),
        Lowering("ort-attention", {"full": ("ms-attention",)}, export=False, auto=True),
    )
}  # fmt: skip
MEASURE = "measure"  # neither a lowering nor a core: the fastest of the candidates that passes parity, measured
AUTO = MEASURE  # the constant's old name (its value was "auto")

# A spelling users have in scripts, now another's: (flag, old) -> (the new one, what it is). "auto" named the measured
# choice of --attention and --core, and the switch core (--buffer-core): three things, each with its own name now.
OLD_SPELLINGS: dict[tuple[str, str], tuple[str, str]] = {
    ("--attention", "auto"): (MEASURE, "the fastest lowering that passes parity, measured"),
    ("--core", "auto"): (MEASURE, "the fastest core, measured; the switch core is --core switch"),
    ("--buffer-core", "auto"): ("switch", "the If of gqa for a prompt and grouped-mha for a step"),
}


def _respelled(flag: str, value: str) -> str:
    """The new spelling of an old one, for an error (the Python API takes no old spelling: the CLI does)."""
    return f"; {value} is spelled {OLD_SPELLINGS[flag, value][0]} now" if (flag, value) in OLD_SPELLINGS else ""
# The lowering each core is written by (the first that lists it).
LOWERING_OF_CORE: dict[str, str] = {}
for _lw in LOWERINGS.values():
    for _cores in _lw.cores.values():
        for _core in _cores:
            LOWERING_OF_CORE.setdefault(_core, _lw.name)


def core_for(lowering: str, config: AttentionConfig, dtype: str = "fp32", form: str | None = None,
             buffer_core: str | None = None, what: str | None = "--attention", core: str | None = None) -> Core:  # fmt: skip
    """The core `lowering` writes for `config` in `dtype` and `form` (None: the config's own): the first
    of its cores that computes it (for the buffer form, `buffer_core`; `core`: that one of the lowering's cores for
    the form, as a measured choice names it). One UsageError otherwise, with every candidate's reasons and the
    lowerings that would compute it (what: the flag that chose it, advised; None: no flag, as in a whole model's
    plan, where the reasons alone are said)."""
    label = lowering if what is None else f"{what} {lowering}"
    if lowering not in LOWERINGS:
        raise UsageError(f"unknown {what or 'lowering'} {lowering!r} (known: {', '.join(LOWERINGS)})"
                         f"{_respelled(what or '--attention', lowering)}")  # fmt: skip
    form = form_of(config, form)
    candidates = LOWERINGS[lowering].cores.get(form, ())
    if form == "buffer" and candidates:
        chosen = buffer_core_of(lowering) if buffer_core is None else buffer_core
        if chosen not in BUFFER_CORES:
            raise UsageError(f"unknown --buffer-core {chosen!r} (known: {', '.join(BUFFER_CORES)})"
                             f"{_respelled('--buffer-core', chosen)}")
        if chosen not in candidates:
            raise UsageError(f"{label} writes no {chosen} core in the buffer form (it writes: {', '.join(candidates)}); "
                             f"--buffer-core {chosen} is --attention {LOWERING_OF_CORE[chosen]}'s")  # fmt: skip
        candidates = (chosen,)
    elif buffer_core not in (None, DEFAULT_BUFFER_CORE):
        raise UsageError(f"--buffer-core {buffer_core} is the buffer form's (--decode-form buffer)")
    if core is not None:
        if core not in candidates:
            raise UsageError(f"{label} writes no {core} core in the {form} form (it writes: "
                             f"{', '.join(candidates) or 'none'})")  # fmt: skip
        candidates = (core,)
    reasons: list[str] = []
    for name in candidates:
        why = why_not(name, config, dtype, form)
        if not why:
            return CORES[name]
        reasons += why
    what_form = {"full": "the full-sequence model", "growing": "the step model (kv_cache)",
                 "buffer": "the buffer form"}[form]  # fmt: skip
    if not candidates:
        has = [f for f in FORMS if f in LOWERINGS[lowering].cores]
        reasons.append(f"{label} has no {form} form (it has: {', '.join(has)})")
    others = [lw for lw in lowerings_for(config, dtype, form, buffer_core) if lw != lowering] if what else []
    advice = f"; use {what} {' or '.join(others)}" if others else ""
    if what and form == "buffer" and not others and "buffer" in LOWERINGS[lowering].cores:
        fine = [b for b in BUFFER_CORES if not why_not(b, config, dtype, form)]
        advice = f"; use --buffer-core {' or '.join(fine)}" if fine else "; use the growing form (--decode-form growing)"
    raise UsageError(f"{label} cannot build {what_form} of this config in {dtype}: "
                     f"{'; '.join(dict.fromkeys(reasons))}{advice}")  # fmt: skip


def export_core(config: AttentionConfig, attention: str, dtype: str = "fp32", decode_form: str = "growing",
                buffer_core: str | None = None) -> Core | None:  # fmt: skip
    """The core `attnx export` and `attnx build` write for `config` (decode_form, buffer_core: the step
    model's form and the buffer form's core), or None for auto (measured among the candidates): one
    UsageError before any work for what does not go together."""
    if decode_form not in ("growing", "buffer"):
        raise UsageError(f"unknown --decode-form {decode_form!r} (known: growing, buffer)")
    if not config.kv_cache and (decode_form == "buffer" or buffer_core not in (None, DEFAULT_BUFFER_CORE)):
        form_of(config, "buffer")  # raises: the form is a step model's
    if attention == AUTO:
        if config.kv_cache:
            raise UsageError(f"--attention {MEASURE} does not measure step models; choose one of "
                             + ", ".join(lw for lw in LOWERINGS if "growing" in LOWERINGS[lw].cores))  # fmt: skip
        return None
    return core_for(attention, config, dtype, decode_form if config.kv_cache else "full", buffer_core)


def lowerings_for(config: AttentionConfig, dtype: str = "fp32", form: str | None = None,
                  buffer_core: str | None = None) -> list[str]:  # fmt: skip
    """The lowerings (export choices first) that compute `config` in `dtype` and `form`."""
    form = form_of(config, form)
    out = []
    for name, lw in LOWERINGS.items():
        cores = lw.cores.get(form, ())
        if form == "buffer" and cores:
            cores = (buffer_core_of(name),) if buffer_core is None else (buffer_core,) if buffer_core in cores else ()
        if any(not why_not(c, config, dtype, form) for c in cores):
            out.append(name)
    return out


def buffer_core_of(lowering: str) -> str:
    """The core `lowering` writes in the buffer form unless --buffer-core says: DEFAULT_BUFFER_CORE where it is one
    of the lowering's, else its first."""
    cores = LOWERINGS[lowering].cores.get("buffer", ())
    if not cores:
        raise UsageError(f"--attention {lowering} has no buffer form")
    return DEFAULT_BUFFER_CORE if DEFAULT_BUFFER_CORE in cores else cores[0]


def attention_help(names: Iterable[str], default: str) -> str:
    """The --attention help of a command whose choices are `names`: each lowering and the cores it
    writes, from the registry (the CLI's words never drift from the tables)."""
    parts = []
    for name in names:
        if name == AUTO:
            parts.append(f"{AUTO}: the fastest that passes parity, measured")
            continue
        cores = dict.fromkeys(c for cs in LOWERINGS[name].cores.values() for c in cs)
        parts.append(f"{name}: {' or '.join(cores)}")
    return f"the lowering of the attention core, the core it writes (default {default}): " + "; ".join(parts)


def buffer_core_help() -> str:
    """The --buffer-core help: each buffer core of the registry, what it is, and the default."""
    parts = [f"{name} ({CORES[name].label}, --attention {LOWERING_OF_CORE[name]}"
             f"{'' if buffer_core_of(LOWERING_OF_CORE[name]) != name else ', its default'}: {CORES[name].summary})"
             for name in BUFFER_CORES]  # fmt: skip
    return "with --decode-form buffer, the attention core: " + "; ".join(parts)


# The docs' generated tables (docs/reference/capabilities.md): each between "<!-- generated: NAME -->" and
# "<!-- end generated -->", rewritten by update_markdown() when the docs are built (docs/_gen/hooks.py)
# and held to these functions by tests/test_docs.py.
GENERATED_TABLES: dict[str, Callable[[], str]] = {}


def generated_table(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        GENERATED_TABLES[name] = fn
        return fn

    return register


def update_markdown(text: str) -> str:
    """`text` (Markdown) with every generated table rewritten from the registry; each of GENERATED_TABLES
    must have its block ("<!-- generated: NAME -->" ... "<!-- end generated -->") in it."""
    import re

    for name, fn in GENERATED_TABLES.items():
        pattern = re.compile(rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end generated -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"the text has no generated block {name!r}")
        text = pattern.sub(lambda m, fn=fn: m.group(1) + fn() + "\n" + m.group(2), text)
    return text


@generated_table("terms")
def term_table() -> str:
    """The table of the formula's terms (Markdown), from TERMS."""
    rows = [["term", "config keys", "place", "what it computes", "tolerance"], ["---"] * 5]
    for t in TERMS.values():
        rows.append([f"`{t.name}`", ", ".join(f"`{k}`" for k in t.keys), t.place, t.summary, t.tolerance])
    return _markdown_table(rows)


@generated_table("lowerings")
def lowering_table() -> str:
    """The table of lowerings (--attention): the cores each writes, per form (Markdown)."""
    rows = [["--attention", "full sequence", "growing cache (step)", "buffer (step)", "export", f"{MEASURE} times"],
            ["---"] * 6]  # fmt: skip
    for lw in LOWERINGS.values():
        cells = [f"`{lw.name}`"]
        for form in FORMS:
            cores = lw.cores.get(form, ())
            cells.append(", then ".join(f"`{c}`" for c in cores) if form != "buffer" or not cores
                         else f"--buffer-core: {', '.join(f'`{c}`' for c in cores)}")  # fmt: skip
        cells += ["yes" if lw.export else "optimize only", "yes" if lw.auto else "-"]
        rows.append([c if c else "-" for c in cells])
    return _markdown_table(rows)


# The docs' text column is 688 px wide at 1280 px and Material gives a table's column at least 100 px (5rem):
# a term and four cores to a table fit it (measured in Chromium), eight cores and the term did not.
CORES_PER_TABLE = 4


@generated_table("cores")
def core_table() -> str:
    """The table of cores (Markdown), from CORES: what each is in the graph, its forms and dtypes."""
    rows = [["core", "graph", "forms", "dtypes"], ["---"] * 4]
    for core in CORES.values():
        rows.append([f"`{core.name}`", core.label, ", ".join(core.forms), ", ".join(core.dtypes)])
    return _markdown_table(rows)


@generated_table("core-terms")
def capability_table() -> str:
    """The terms each core expresses (Markdown), generated from CORES and TERMS: a row per term, a column per
    core, CORES_PER_TABLE cores to a table; a cell is yes (in every form the core has), the forms it does it in,
    or - (not expressed)."""
    cores = list(CORES.values())
    tables = []
    for at in range(0, len(cores), CORES_PER_TABLE):
        group = cores[at : at + CORES_PER_TABLE]
        rows = [["term", *(f"`{core.name}`" for core in group)], ["---"] * (len(group) + 1)]
        for t in TERMS:
            cells = [f"`{t}`"]
            for core in group:
                takes = core.terms.get(t)
                if takes is None:
                    cells.append("-")
                else:
                    forms = [f for f in takes.forms if f in core.forms]
                    cells.append("yes" if forms == list(core.forms) else ", ".join(forms))
            rows.append(cells)
        tables.append(_markdown_table(rows))
    return "\n\n".join(tables)


def _markdown_table(rows: list[list[str]]) -> str:
    """Markdown rows, a "|" inside a cell escaped (it would end the cell)."""
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows)
