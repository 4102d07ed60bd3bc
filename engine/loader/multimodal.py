"""A multimodal checkpoint's text weights under the engine's names (Gemma 3 4B/12B/27B).

``Gemma3ForConditionalGeneration`` stores its language model under a prefix, spelled two ways:
``language_model.model.layers.N...`` (the Hub's google/gemma-3-*-it files, and what transformers 5's
``save_pretrained`` writes back through its conversion mapping) or ``model.language_model.layers.N...``
(transformers' in-memory names, saved as such by 4.52-4.5x); the head is ``language_model.lm_head.weight``
or ``lm_head.weight`` (absent when tied). Each text tensor is added to the index under the engine's name
(``model.layers.N...``) as a view of the stored bytes (``CheckpointIndex.add_view``: nothing copied, the
offload runtime streams it like a stored tensor). ``vision_tower.*`` and ``multi_modal_projector.*`` (either
spelling) stay in the index unread: images are not supported.
"""

from __future__ import annotations

from llmsys.engine.loader.safetensors_io import CheckpointIndex

# stored prefix -> the engine's, longest first so "language_model.lm_head." is not read as a body tensor
TEXT_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
)
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def engine_name(stored: str) -> str | None:
    """The engine's name of a stored text tensor, None for any other tensor."""
    for prefix, ours in TEXT_PREFIXES:
        if stored.startswith(prefix):
            return ours + stored[len(prefix):]
    return None


def add_text_views(index: CheckpointIndex) -> int:
    """Add every stored text tensor under the engine's name (a view of all its bytes), unless a tensor of that
    name is stored too. Returns the number of image tensors (vision tower, projector) left unread."""
    for stored in list(index.where):
        name = engine_name(stored)
        if name is not None and name not in index:
            index.add_view(name, stored, 0, index.info(stored).shape)
    return sum(1 for n in index.where if n.startswith(IMAGE_PREFIXES))


def image_notice(skipped: int) -> str:
    """The one line a load says about the part it leaves out."""
    return (f"text model only: the image part ({skipped} vision tower / projector tensors) is not loaded; "
            "image inputs are not supported")
