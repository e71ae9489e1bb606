"""A whole model's package, the deployment side (attnx build --model writes it): verify it here, load it, generate.

    manifest.json        kind "model": files and their sha256, the models and their forms, the decode form served and
                         its proof, the golden generations, the bound they are replayed under, the optimization's
                         report, context, vocabulary, padding, the build machine
    model.onnx           the optimized model: its own inputs and outputs (the growing cache)
    decode.onnx          its buffer form (attnx.workflows.rewrite.serve), where attnx could write it: the cache
                         written in place, each row its own length; the two read one weights file, model.onnx.data
    generations.npz      golden generations, recorded from the served form: per request its prompt, its greedy tokens,
                         the prompt's logits (at every position [L, V], or at its last alone [1, V] where the served
                         form computes no other: the manifest's generations.prompt_logits) and each later step's [V]
    optimize.json        attnx optimize's report (blocks, cores, repairs, proofs, times)

The served form (served_model): the buffer form on ONNX Runtime's CPU provider where the package has one, else the
model's own I/O. verify: the files (sizes, sha256), the served model loaded on the provider asked (never another in
its place), and every golden generation replayed token by token through the generation engine
(attnx.runtimes.generate), its recorded tokens fed: each step's greedy token the golden one, each step's logits within
the tolerance table's whole-model bound. Without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.model.contract import get_provider
from attnx.model.tolerance import ProblemSize, Tolerance, whole_model_tolerance
from attnx.runtimes._manifest import Check, check_model_data, member_path
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.generate import Engine, GenerateStats, Request, check_prompts
from attnx.runtimes.sampling import Sampling
from attnx.runtimes.text import PackageText, package_text

__all__ = ["BUFFER_PROVIDER", "GENERATIONS_FILE", "GenerativeModel", "golden_arrays", "load_model_package",
           "recorded_cases", "replay_cases", "replay_generations", "served_model"]

GENERATIONS_FILE = "generations.npz"
BUFFER_PROVIDER = "cpu"  # the provider the buffer form is served on: its buffers are host memory, bound by address


def golden_arrays(requests: Sequence[Request]) -> dict[str, np.ndarray]:
    """The golden generations of recorded requests (Request.logits), as generations.npz holds them."""
    out: dict[str, np.ndarray] = {}
    for r in requests:
        out[f"prompt_{r.index}"] = np.asarray(r.prompt, np.int64)
        out[f"tokens_{r.index}"] = np.asarray(r.tokens, np.int64)
        out[f"prompt_logits_{r.index}"] = np.asarray(r.logits[0], np.float32)
        steps = r.logits[1:]
        out[f"step_logits_{r.index}"] = (np.stack(steps).astype(np.float32) if steps
                                         else np.zeros((0, r.logits[0].shape[-1]), np.float32))  # fmt: skip
    return out


def served_model(manifest: Mapping[str, Any], provider: str) -> Mapping[str, Any]:
    """The manifest's entry of the model generation runs on `provider`: the buffer form where the package has one
    and the provider is ONNX Runtime's CPU (its buffers are host memory, bound by address), else the model's own
    I/O (UsageError where the package has no model for the provider)."""
    models = [m for m in manifest["models"] if provider in m["providers"]]
    if not models:
        built = sorted({p for m in manifest["models"] for p in m["providers"]})
        raise UsageError(f"this package has no model for provider {provider!r} (built for: {', '.join(built)})")
    buffer = next((m for m in models if m.get("form") == "buffer"), None)
    if buffer is not None and provider == BUFFER_PROVIDER:
        return buffer
    return next((m for m in models if m.get("form", "growing") == "growing"), models[0])


def open_model(root: str, manifest: Mapping[str, Any], provider: str) -> Runner:
    """The package's served model (served_model) loaded on `provider` through the runner registry
    (ProviderUnavailable where it cannot start: never another provider in its place), its external data checked to
    lie in the package first."""
    get_provider(provider)
    model = served_model(manifest, provider)
    check_model_data(root, manifest, model["file"])
    source = ModelSource(model_path=member_path(root, model["file"], "the model"))
    return create_runner(get_provider(provider).backend, source).load()


def engine_for(runner: Runner, manifest: Mapping[str, Any], max_batch: int | None = None,
               record: bool = False) -> Engine:  # fmt: skip
    """The generation engine over the package's loaded model, as the manifest says to feed it. Golden generations
    (record) are recorded and replayed at the manifest's batch; serving takes `max_batch` (None: Engine.batch_rows,
    every request within memory), never capped by the recorded one."""
    batch = manifest["generations"]["max_batch"] if record and max_batch is None else max_batch
    if manifest.get("one_row"):  # rows that would change each other's tokens: one at a time (the manifest says why)
        batch = 1
    return Engine(runner, max_batch=batch, context=manifest.get("context"), record=record,
                  right_padded=manifest["padding"] == "right", cache_dims=manifest.get("cache_dims"))  # fmt: skip


class _BadGolden(Exception):
    """A golden generations file that cannot be used; the message says why."""


def _load_golden(path: str, requests: int, last: bool = False) -> list[dict[str, np.ndarray]]:
    """The golden cases of generations.npz; `last`: each prompt's logits at its last position alone."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:  # noqa: BLE001 - a damaged file of the package: one line
        raise _BadGolden(f"not readable as .npz: {type(e).__name__}: {e}") from None
    out = []
    for i in range(requests):
        keys = [f"{k}_{i}" for k in ("prompt", "tokens", "prompt_logits", "step_logits")]
        missing = [k for k in keys if k not in arrays]
        if missing:
            raise _BadGolden(f"has no {', '.join(missing)}")
        prompt, tokens, first, steps = (arrays[k] for k in keys)
        if prompt.ndim != 1 or tokens.ndim != 1 or len(tokens) < 1 or first.shape[0] != (1 if last else len(prompt)) \
                or steps.shape[0] != len(tokens) - 1:  # fmt: skip
            raise _BadGolden(f"request {i}'s arrays do not go together (prompt {list(prompt.shape)}, tokens "
                             f"{list(tokens.shape)}, logits {list(first.shape)} and {list(steps.shape)})")  # fmt: skip
        out.append({"prompt": prompt, "tokens": tokens, "first": first, "steps": steps})
    return out


def replay_generations(root: str, manifest: Mapping[str, Any], runner: Runner,
                       progress: Callable[[str], None] = lambda _m: None) -> list[Check]:  # fmt: skip
    """Each golden generation replayed on `runner` (the module doc): one Check a request, failing at its first step
    whose greedy token is not the golden one, or whose logits pass the bound."""
    golden = manifest["generations"]
    name = golden["file"]
    try:
        cases = _load_golden(member_path(root, name, "the golden generations"), golden["requests"],
                             golden.get("prompt_logits") == "last")  # fmt: skip
    except _BadGolden as e:
        return [Check(name, False, str(e))]
    tol_said = manifest["tolerance"]
    progress(f"replaying {len(cases)} golden generations ({sum(len(c['tokens']) for c in cases)} tokens)")
    return replay_cases(runner, manifest, cases, whole_model_tolerance(tol_said["dtype"], tol_said["blocks"]),
                        ProblemSize(tol_said["k"]))  # fmt: skip


def recorded_cases(requests: Sequence[Request]) -> list[dict[str, np.ndarray]]:
    """Recorded requests (Request.logits) as the cases replay_cases takes: prompt, tokens, the prompt's logits [L, V]
    and each later step's [N - 1, V]."""
    arrays = golden_arrays(requests)
    return [{"prompt": arrays[f"prompt_{r.index}"], "tokens": arrays[f"tokens_{r.index}"],
             "first": arrays[f"prompt_logits_{r.index}"], "steps": arrays[f"step_logits_{r.index}"]}
            for r in requests]  # fmt: skip


def replay_cases(runner: Runner, manifest: Mapping[str, Any], cases: Sequence[Mapping[str, np.ndarray]],
                 tol: Tolerance, size: ProblemSize, label: str = "generation") -> list[Check]:  # fmt: skip
    """Each case's tokens fed through the generation engine on `runner` (batched as the manifest says), its logits
    recorded: one Check a case, failing at its first step whose greedy token is not the case's, or whose logits pass
    the bound `tol` (compare_arrays) of the case's."""
    requests = [Request(i, [int(t) for t in c["prompt"]], len(c["tokens"]), forced=[int(t) for t in c["tokens"]])
                for i, c in enumerate(cases)]  # fmt: skip
    engine = engine_for(runner, manifest, record=True)
    engine.run(requests)
    checks = []
    for request, case in zip(requests, cases):
        name = f"{label} {request.index}"
        said = f"a prompt of {len(request.prompt)} tokens, {len(request.tokens)} new"
        # the golden token of step s is chosen from logits s: the prompt's last row, then each step's
        recorded = [request.logits[0][-1], *request.logits[1:]]
        failure = None
        for step, (row, token) in enumerate(zip(recorded, case["tokens"])):
            if int(np.argmax(row)) != int(token):
                failure = f"step {step}: greedy token {int(np.argmax(row))}, the golden one {int(token)}"
                break
        # the prompt's logits at every position, or at its last alone where the model computes no other (the
        # served form's LastLogits): the positions both have are compared
        first = len(request.logits[0])
        got = np.concatenate([request.logits[0], *(x[None] for x in request.logits[1:])])  # [P + N - 1, V]
        want = np.concatenate([case["first"][-first:], case["steps"]])
        cmp = compare_arrays(name, got, want, tol, size)
        if failure is None and not cmp:
            row = int(np.flatnonzero((np.abs(got - want) > cmp.atol + cmp.rtol * np.abs(want)).any(-1))[0])
            at = f"prompt position {len(request.prompt) - first + row}" if row < first else f"step {row - first + 1}"
            failure = f"{at}: logits past the bound ({cmp.detail()})"
        checks.append(Check(name, failure is None, f"{said}: {failure}" if failure else f"{said}: the same greedy "
                            f"tokens, logits {cmp.detail()}",
                            {**cmp.stats(), "atol": cmp.atol, "rtol": cmp.rtol}))  # fmt: skip
    return checks


@dataclasses.dataclass
class GenerativeModel:
    """A whole model's package, loaded (attnx.load of such a package): generate() serves prompts of any length
    together (attnx.runtimes.generate); a context manager."""

    directory: str
    manifest: dict[str, Any]
    runner: Runner
    stats: GenerateStats | None = None

    @property
    def vocab(self) -> int | None:
        return self.manifest.get("vocab")

    @property
    def context(self) -> int | None:
        return self.manifest.get("context")

    @functools.cached_property
    def text(self) -> PackageText | None:
        """The package's text (attnx.runtimes.text: tokenizer, chat template, eos ids), or None where it carries none;
        read from its hashed files on first use (the tokenizers and jinja2 libraries: the serve extra)."""
        return package_text(self.directory, self.manifest)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, eos: Sequence[int] = (),
                 max_batch: int | None = None,
                 on_finish: Callable[[Request], None] | None = None) -> list[list[int]]:  # fmt: skip
        """The new tokens of each prompt, in the prompts' order: greedy by default, else sampled (temperature, top-k,
        top-p) from each request's own generator seeded by (seed, its index); a row ends at an eos id, at
        max_new_tokens, or at the model's context."""
        prompts = [list(p) for p in prompts]
        check_prompts(prompts, self.vocab, self.context)
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens {max_new_tokens}: must be 1 or more")
        sampling = Sampling(temperature, top_k, top_p, seed)
        requests = [Request(i, p, max_new_tokens, frozenset(eos),
                            None if sampling.greedy else np.random.default_rng([seed, i]))
                    for i, p in enumerate(prompts)]  # fmt: skip
        engine = engine_for(self.runner, self.manifest, max_batch)
        self.stats = engine.run(requests, sampling, on_finish)
        return [r.tokens for r in requests]

    def generate_text(self, prompts: Sequence[str], *, max_new_tokens: int = 32, **options: Any) -> list[str]:
        """The text each prompt continues with: generate() on the prompts' ids (the tokenizer's special tokens
        added), ending at the package's eos ids, decoded without special tokens. UsageError where the package
        carries no text."""
        if self.text is None:
            raise UsageError(f"{self.directory}: the package carries no tokenizer (built without --tokenizer or a "
                             "--checkpoint holding tokenizer.json): generate() takes token ids")  # fmt: skip
        ids = [self.text.encode(p) for p in prompts]
        eos = sorted(set(options.pop("eos", ())) | self.text.eos_ids)
        tokens = self.generate(ids, max_new_tokens=max_new_tokens, eos=eos, **options)
        return [self.text.decode(t) for t in tokens]

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> GenerativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_model_package(root: str, manifest: dict[str, Any], provider: str = "cpu") -> GenerativeModel:
    """The package's model loaded on `provider`, ready to generate (its files were checked by the caller)."""
    with contextlib.ExitStack() as stack:
        runner = stack.enter_context(open_model(root, manifest, provider))
        stack.pop_all()
    return GenerativeModel(os.fspath(root), manifest, runner)
