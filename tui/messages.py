"""Messages the engine thread posts to the app (Textual messages as dataclasses).

``post_message`` is thread-safe in Textual, so the engine thread never touches
a widget: it only posts these, and the app's handlers update the screen.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from llmsys.tui.snapshot import TierSnapshot


@dataclass
class ModelInfo:
    """Static facts for the status line, read once after loading."""

    name: str
    dtype: str
    quant: str
    device: str
    weight_format: str  # what the weights were read from: "llama2.c", "Hugging Face safetensors", "GGUF", ...
    n_layers: int
    max_len: int
    is_chat: bool  # has a chat template -> chat mode; else plain completion
    stored_as: str = ""  # what the weights are kept as, e.g. "Q4_1 (int4 + offset)" (status_line.stored_weights)


@dataclass
class EngineReady(Message):
    info: ModelInfo
    snapshot: TierSnapshot


@dataclass
class EngineFailed(Message):
    """The model could not be loaded; ``error`` is one readable line."""

    error: str


@dataclass
class TokensReceived(Message):
    gen_id: int
    text: str
    n_tokens: int


@dataclass
class GenerationDone(Message):
    gen_id: int
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None


@dataclass
class GenerationFailed(Message):
    gen_id: int
    error: str


@dataclass
class SnapshotUpdated(Message):
    snapshot: TierSnapshot
