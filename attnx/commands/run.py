"""attnx run: run a model (or a package) on .npy inputs."""

from __future__ import annotations

import argparse
import os
import sys
import zipfile

import numpy as np

from attnx._io import check_output_file, not_a_file, write_npy_atomic
from attnx.commands import COMMANDS
from attnx.errors import InputError, UsageError
from attnx.model.contract import PROVIDERS, model_form
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.model_package import GenerativeModel
from attnx.runtimes.package import load

HELP = COMMANDS["run"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help=HELP, description=HELP)
    p.add_argument("model", metavar="DIR|MODEL.onnx", help="a package folder (attnx build) or an ONNX model file")
    p.add_argument("--input", required=True, metavar="x.npy", help="x [batch, seq, d_model], the model's dtype")
    p.add_argument("--memory", metavar="m.npy",
                   help="memory [batch, mem_seq, kv_dim]: the second sequence, for a cross-attention model")  # fmt: skip
    p.add_argument("--key-padding-mask", metavar="k.npy",
                   help="bool [batch, seq or mem_seq], True where a key is padding (hidden), for a model with one")  # fmt: skip
    p.add_argument("--position-ids", metavar="p.npy",
                   help="int64 [batch, seq]: each token's position, for a model with rope (its input position_ids)")  # fmt: skip
    p.add_argument("--past-key", metavar="k.npy", help="a step model's past_key (default: an empty cache, the prefill)")
    p.add_argument("--past-value", metavar="v.npy", help="a step model's past_value (with --past-key)")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cpu", help="execution provider to run on (default cpu)")
    p.add_argument("--output", required=True, metavar="y.npy", help="write y [batch, seq, d_model] here")
    p.add_argument("--present-key", metavar="k.npy", help="write a step model's present_key here")
    p.add_argument("--present-value", metavar="v.npy", help="write a step model's present_value here")
    p.set_defaults(run=run)


def load_npy(path: str, what: str) -> np.ndarray:
    """One array from a .npy file, without pickles: an object array is refused, never
    executed; an empty, truncated or foreign file, or an .npz archive, is one InputError."""
    if (why := not_a_file(path)) is not None:
        raise InputError(f"{what} file {path!r} {why}")
    try:
        array = np.load(path, allow_pickle=False, mmap_mode=None)
    except (ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "pickled" in first:  # numpy's words go on to suggest loading it unsafely: attnx never does
            first = "it holds pickled data (an object array, or not a .npy file at all), which attnx never loads"
        raise InputError(f"{what} file {path!r} is not a plain .npy array: {first}") from None
    except OSError as e:
        raise InputError(f"{what} file {path!r} cannot be read: {e.strerror or e}") from None
    if not isinstance(array, np.ndarray):  # np.load opens an .npz archive, whatever its name
        array.close()
        raise InputError(f"{what} file {path!r} is an .npz archive, not one .npy array")
    return array


def open_runner(path: str, provider: str):
    """A loaded runner for a model file or a package folder."""
    if os.path.isdir(path):
        loaded = load(path, provider=provider)
        if isinstance(loaded, GenerativeModel):
            loaded.close()
            raise UsageError(f"{path!r} is a whole model's package (attnx build --model): attnx run feeds one attention "
                             "layer's .npy inputs; serve it with attnx generate")  # fmt: skip
        return loaded
    if not os.path.isfile(path):
        raise UsageError(f"{path!r} is neither a model file nor a package folder")
    form = model_form(path)  # the model describes itself: its config and dtype
    return create_runner(PROVIDERS[provider].backend, ModelSource(form.config, None, path, form.dtype)).load()


def _step_feeds(args: argparse.Namespace, runner, feeds: dict[str, np.ndarray]) -> None:
    """past_key/past_value of a step model: the files given, or an empty cache (past_seq 0)."""
    takes = {s.name: s for s in runner.inputs}
    if "past_key" not in takes:
        if args.past_key or args.past_value or args.present_key or args.present_value:
            raise UsageError(
                "--past-key/--past-value/--present-* are for a step model (kv_cache); this one has no cache"
            )
        return
    if "seqlens_k" in takes:
        raise UsageError(
            "this step model is the buffer form (one cache bound as past and present through IOBinding): "
            "run it with attnx.runtimes.decode.BufferDecoder; attnx run takes the growing form"
        )
    if bool(args.past_key) != bool(args.past_value):
        raise UsageError("--past-key and --past-value go together (or neither: an empty cache)")
    if args.past_key:
        feeds["past_key"] = load_npy(args.past_key, "--past-key")
        feeds["past_value"] = load_npy(args.past_value, "--past-value")
        return
    batch = feeds["x"].shape[0] if feeds["x"].ndim == 3 else 1
    for name in ("past_key", "past_value"):
        spec = takes[name]  # [batch, n_kv_heads, past_seq, dim]: zero positions
        shape = (batch, *(d if isinstance(d, int) else 0 for d in spec.shape[1:]))
        feeds[name] = np.zeros(shape, feeds["x"].dtype)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output, "--output")
    for flag in ("present_key", "present_value"):
        if getattr(args, flag):
            check_output_file(getattr(args, flag), "--" + flag.replace("_", "-"))
    feeds = {"x": load_npy(args.input, "--input")}
    if args.memory:
        feeds["memory"] = load_npy(args.memory, "--memory")
    if args.key_padding_mask:
        feeds["key_padding_mask"] = load_npy(args.key_padding_mask, "--key-padding-mask")
    if args.position_ids:
        feeds["position_ids"] = load_npy(args.position_ids, "--position-ids")
    for name, array in feeds.items():
        # A NaN or an infinity in the input gives NaN outputs: the model is not at fault, say so.
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            bad = array.size - int(np.count_nonzero(np.isfinite(array)))
            print(f"attnx run: warning: input {name!r} holds {bad} NaN or infinite value(s): the outputs that "
                  "depend on them are not finite", file=sys.stderr)  # fmt: skip
    runner = open_runner(args.model, args.provider)
    try:
        _step_feeds(args, runner, feeds)
        outputs = runner.run(feeds)
    finally:
        runner.close()
    y = outputs["y"]
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        bad = y.size - int(np.count_nonzero(np.isfinite(y)))
        print(f"attnx run: warning: output 'y' holds {bad} NaN or infinite value(s)", file=sys.stderr)
    write_npy_atomic(args.output, y)
    print(f"wrote {args.output}: y {list(y.shape)} {y.dtype}")
    for name in ("present_key", "present_value"):
        if getattr(args, name):
            write_npy_atomic(getattr(args, name), outputs[name])
            print(f"wrote {getattr(args, name)}: {name} {list(outputs[name].shape)} {outputs[name].dtype}")
    return 0
