"""The error types of attnx. Each is one readable line; the CLI maps them to exit codes."""

from __future__ import annotations

__all__ = [
    "AttnxError",
    "UsageError",
    "ConfigError",
    "WeightsError",
    "InputError",
    "ExportError",
    "ModelFileError",
    "ProviderUnavailable",
    "CheckFailed",
    "PackageError",
    "interrupt_in",
]


class AttnxError(Exception):
    """Base of every error attnx raises on purpose. exit_code is what the CLI returns."""

    exit_code = 2


class UsageError(AttnxError):
    """Bad arguments or bad input files."""


class ConfigError(UsageError):
    """An AttentionConfig value or file is invalid; the message names the key."""


class WeightsError(UsageError):
    """A weights file is missing, unreadable, or has missing, extra or mis-shaped tensors."""


class InputError(UsageError):
    """A feed does not match the model's inputs (name, rank, dtype, fixed dims)."""


class ModelFileError(UsageError):
    """A file is not a loadable ONNX model."""


class PackageError(UsageError):
    """A folder is not an attnx package, or points outside itself."""


class ProviderUnavailable(AttnxError):
    """A backend cannot run here; the message gives the reason."""


class ExportError(AttnxError):
    """The export produced a model that breaks the contract (e.g. a specialized dim)."""

    exit_code = 1


class CheckFailed(AttnxError):
    """A numerical or integrity check failed (parity, verify)."""

    exit_code = 1


def interrupt_in(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (KeyboardInterrupt) a library wrapped into an error of its own (torch's
    exporter does), found along the error's causes, or None. In a library caller's process
    only: the CLI's process never raises on a signal (attnx._signals)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
