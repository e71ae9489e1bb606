"""Weights: the safetensors key contract, seeded initialisation and converters.

Weights are held as a dict of numpy float32 arrays in the torch Linear convention
(y = x W^T + b), so that the numpy reference and a deployment machine need no torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx._io import atomic_path, not_a_file
from attnx.errors import WeightsError
from attnx.model.config import AttentionConfig
from attnx.model.terms import projection_shapes, term_tensors

__all__ = [
    "weight_shapes",
    "init_weights",
    "weights_sha256",
    "check_weights",
    "check_finite",
    "check_fits",
    "load_weights",
    "save_weights",
    "from_torch_mha_state_dict",
    "from_torch_mha",
]

logger = logging.getLogger(__name__)
# The largest finite value of each half-precision model dtype.
HALF_MAX = {"fp16": float(np.finfo(np.float16).max)}


def weight_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a config's weights file must hold, in a fixed order."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    # q_proj, k_proj, v_proj (n_kv_heads heads: fewer than n_heads when grouped), or a term's own (latent's)
    projections = {**projection_shapes(c), "out_proj": ((c.d_model, c.v_dim), True)}
    for name, (shape, biased) in projections.items():
        shapes[f"{name}.weight"] = shape
        if c.bias and biased:
            shapes[f"{name}.bias"] = (shape[0],)
    # the tensors the config's terms add (attnx.model.terms: q/k norm weights, sinks, ...)
    shapes.update((name, shape) for name, (shape, _) in term_tensors(c).items())
    return shapes


def init_weights(config: AttentionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights, the same on every machine: numpy's PCG64 drawn tensor by tensor.

    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch.nn.Linear, so activations keep their scale. The
    tensors the terms add (after the projections, so the projections' draws do not depend on them)
    are drawn from the range each term gives them (attnx.model.terms: a norm's weights about 1, as
    trained ones are; sink logits of either sign, about as large as a score).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    shapes = weight_shapes(config)
    ranges = {name: draw for name, (_, draw) in term_tensors(config).items()}
    weights = {}
    for name, shape in shapes.items():
        w = rng.random(shape, dtype=np.float32)  # [0, 1)
        if name in ranges:
            low, high = (np.float32(v) for v in ranges[name])
            w *= high - low
            w += low
        else:
            fan_in = shapes[name.replace(".bias", ".weight")][1]
            bound = np.float32(1.0 / np.sqrt(fan_in))
            w *= 2 * bound
            w -= bound
        weights[name] = w
    return weights


def weights_sha256(config: AttentionConfig, weights: Mapping[str, np.ndarray]) -> str:
    """A digest of the weights' values (names, shapes, float32 bytes, in the contract's order),
    whatever file or seed they came from."""
    digest = hashlib.sha256()
    for name in weight_shapes(config):
        array = np.ascontiguousarray(weights[name], dtype=np.float32)
        digest.update(f"{name}:{list(array.shape)};".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def check_weights(config: AttentionConfig, weights: Mapping[str, Any], source: str = "weights") -> None:
    """Raise WeightsError naming the first missing, extra or mis-shaped tensor."""
    expected = weight_shapes(config)
    for name, shape in expected.items():
        if name not in weights:
            raise WeightsError(f"{source}: tensor {name!r} is missing (expected shape {list(shape)})")
        got = tuple(weights[name].shape)
        if got != shape:
            raise WeightsError(f"{source}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise WeightsError(f"{source}: unexpected tensor {extra[0]!r} (this config expects {', '.join(expected)})")


def _safetensors() -> Any:
    """safetensors, part of the `export` extra (the deployment side reads no weights files)."""
    try:
        import safetensors.numpy
    except ImportError:
        raise WeightsError("reading and writing weights files needs safetensors: pip install 'attnx[export]'") from None
    return safetensors


def load_weights(path: str | os.PathLike[str], config: AttentionConfig) -> dict[str, np.ndarray]:
    """Read a safetensors file (never a pickle) and check it against the config."""
    safetensors = _safetensors()
    SafetensorError, load_file = safetensors.SafetensorError, safetensors.numpy.load_file
    source = os.fspath(path)
    if (why := not_a_file(source)) is not None:
        raise WeightsError(f"weights file {source!r} {why}")
    try:
        raw = load_file(source)
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightsError(f"weights file {source!r} is not a readable safetensors file: {e}") from None
    check_weights(config, raw, source)
    out, converted = {}, {}
    for name, array in raw.items():
        if not np.issubdtype(array.dtype, np.floating):
            raise WeightsError(f"{source}: tensor {name!r} has dtype {array.dtype}, expected a float dtype")
        if array.dtype != np.float32:
            converted.setdefault(str(array.dtype), []).append(name)
        out[name] = np.ascontiguousarray(array, dtype=np.float32)
    for dtype, names in converted.items():
        # float16 widens exactly; float64 rounds to the float32 the model computes in.
        logger.warning("%s: %d tensor(s) stored as %s converted to float32 (%s)", source, len(names), dtype,
                       ", ".join(names))  # fmt: skip
    check_finite(out, source)
    return out


def check_finite(weights: Mapping[str, np.ndarray], source: str = "weights") -> None:
    """WeightsError naming the first tensor with a NaN or an infinity, and how many it holds."""
    for name, array in weights.items():
        bad = array.size - int(np.count_nonzero(np.isfinite(array)))
        if bad:
            raise WeightsError(f"{source}: tensor {name!r} holds {bad} NaN or infinite value(s)")


def check_fits(weights: Mapping[str, np.ndarray], dtype: str, source: str = "weights") -> None:
    """WeightsError naming the first weight a model of `dtype` cannot hold (beyond float16's
    range), before any export work: never clamped, never found later under a graph name."""
    limit = HALF_MAX.get(dtype)
    if limit is None:
        return
    for name, array in weights.items():
        peak = float(np.max(np.abs(array))) if array.size else 0.0
        if peak > limit:
            raise WeightsError(
                f"{source}: tensor {name!r} holds values up to {peak:.6g}, beyond {dtype}'s range (+-{limit:g}): "
                "export it as fp32"
            )


def save_weights(weights: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> None:
    """Write safetensors atomically: a temporary name, then rename."""
    with atomic_path(path) as tmp:
        _safetensors().numpy.save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, tmp)


def from_torch_mha(
    module: Any, *, cross: bool | None = None, causal: bool = False, key_padding_mask: bool = False
) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """(config, weights) of a torch.nn.MultiheadAttention, read from the module itself: its
    embed_dim, num_heads, kdim/vdim and biases. What attnx cannot express is refused, naming it:
    add_zero_attn (a zero key and value appended to every sequence), add_bias_kv (learned ones),
    kdim != vdim (attnx has one memory width for keys and values). cross None: cross-attention
    when kdim differs from embed_dim (a module used as cross-attention with kdim == embed_dim
    says cross=True); causal and key_padding_mask are how the caller uses it (the module does
    not know). batch_first only changes the module's calling convention: attnx is batch-first."""
    unsupported = []
    if getattr(module, "add_zero_attn", False):
        unsupported.append("add_zero_attn=True (a zero key and value appended to every sequence)")
    if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
        unsupported.append("add_bias_kv=True (learned bias_k and bias_v appended to the keys and values)")
    if module.kdim != module.vdim:
        unsupported.append(f"kdim {module.kdim} != vdim {module.vdim} (attnx has one memory width, kv_dim)")
    if unsupported:
        raise WeightsError("nn.MultiheadAttention with " + "; ".join(unsupported) + ": attnx cannot express it")
    if cross is None:
        cross = module.kdim != module.embed_dim
    config = AttentionConfig(
        d_model=module.embed_dim,
        n_heads=module.num_heads,
        kv_dim=module.kdim if cross else None,
        bias=module.in_proj_bias is not None,
        causal=causal,
        cross=cross,
        key_padding_mask=key_padding_mask,
    )
    return config, from_torch_mha_state_dict(module.state_dict(), config)


def from_torch_mha_state_dict(state_dict: Mapping[str, Any], config: AttentionConfig) -> dict[str, np.ndarray]:
    """Convert torch.nn.MultiheadAttention's state dict (packed in_proj or separate q/k/v).

    A state dict holds no head count and no add_zero_attn flag: a config whose n_heads differs
    from the module's converts without error and computes something else. from_torch_mha(module)
    reads both from the module and is the safer form."""

    def arr(t: Any) -> np.ndarray:
        return t.detach().cpu().float().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float32)

    unsupported = sorted(k for k in state_dict if k in ("bias_k", "bias_v"))
    if unsupported:
        raise WeightsError(f"nn.MultiheadAttention with add_bias_kv ({unsupported[0]!r}) has no equivalent in attnx")
    out: dict[str, np.ndarray] = {}
    if "in_proj_weight" in state_dict:
        w = arr(state_dict["in_proj_weight"])
        q, k = config.q_dim, config.q_dim
        if w.shape[0] != q + k + config.v_dim:
            raise WeightsError(f"in_proj_weight has {w.shape[0]} rows, expected {q + k + config.v_dim}")
        out["q_proj.weight"], out["k_proj.weight"], out["v_proj.weight"] = np.split(w, [q, q + k])
    else:
        for name in ("q", "k", "v"):
            key = f"{name}_proj_weight"
            if key not in state_dict:
                raise WeightsError(f"state dict has neither 'in_proj_weight' nor {key!r}")
            out[f"{name}_proj.weight"] = arr(state_dict[key])
    if "out_proj.weight" not in state_dict:
        raise WeightsError("state dict has no 'out_proj.weight'")
    out["out_proj.weight"] = arr(state_dict["out_proj.weight"])
    if config.bias:
        if "in_proj_bias" not in state_dict or "out_proj.bias" not in state_dict:
            raise WeightsError("config has bias=true but the state dict has no 'in_proj_bias'/'out_proj.bias'")
        b = arr(state_dict["in_proj_bias"])
        out["q_proj.bias"], out["k_proj.bias"], out["v_proj.bias"] = np.split(b, [config.q_dim, 2 * config.q_dim])
        out["out_proj.bias"] = arr(state_dict["out_proj.bias"])
    out = {k: np.ascontiguousarray(v) for k, v in out.items()}
    check_weights(config, out, "nn.MultiheadAttention state dict")
    return out
