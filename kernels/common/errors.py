"""User-facing errors.

Every failure a user can cause (bad path, corrupt file, budget too small,
prompt too long, bad sampling value) is raised as an :class:`LLMSysError` whose
message is one line naming the file or limit and the fix. The CLI prints
``error: <message>`` and exits 2; the server maps them to HTTP 400 bodies. A
traceback is shown only with ``LLMSYS_DEBUG=1``.
"""

from __future__ import annotations


class LLMSysError(Exception):
    """Base class: a one-line, actionable message for the user."""

    exit_code = 2


class ModelNotFoundError(LLMSysError):
    """Path does not exist, or a catalog name is not downloaded yet."""


class CheckpointError(LLMSysError):
    """Missing config, corrupt/truncated safetensors, missing tensors."""


class UnsupportedModelError(LLMSysError):
    """The architecture / model_type is not one llmsys implements."""


class TokenizerError(LLMSysError):
    """No usable tokenizer files, or a chat template that fails to render."""


class InvalidParameterError(LLMSysError, ValueError):
    """A sampling or engine parameter is outside its valid range."""


class ContextOverflowError(LLMSysError):
    """A prompt (plus what must be generated) does not fit the context."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, message: str | None = None):
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        super().__init__(
            message
            or (
                f"prompt has {n_prompt_tokens} tokens but the context holds {n_ctx}; "
                "shorten the prompt or raise --max-model-len (up to the model's limit)"
            )
        )


class BudgetError(LLMSysError):
    """A memory budget too small to run; the message gives the minimum."""


class HubError(LLMSysError):
    """Download failures (offline, repo missing)."""


class KVReadError(OSError):
    """KV blocks could not be read back from an offload tier (the swap file, the cold KV tier).

    Not a user error: the engine catches it around a step. ``blocks`` are the
    block ids as block tables hold them (pool ids for a swap-in, cold ids for
    the tier), so the engine re-prefills only the sequences holding them and
    every other request carries on.
    """

    def __init__(self, message: str, blocks: list[int]):
        super().__init__(message)
        self.blocks = tuple(blocks)
