"""llmsys: a single-node LLM inference engine for constrained hardware.

The public API is deliberately small: build an :class:`LLM` from a model path
or catalog name, and call ``generate`` / ``stream`` / ``chat`` with
:class:`SamplingParams`.
"""

from llmsys.engine.config import EngineConfig
from llmsys.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the whole engine; import it on first use so that
    # `llmsys --help` and light tools stay fast.
    if name == "LLM":
        from llmsys.engine.llm import LLM

        return LLM
    raise AttributeError(name)
