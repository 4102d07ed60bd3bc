"""llmsys: a single-node LLM inference engine for constrained hardware.

The public API is deliberately small: build an :class:`LLM` from a model path
or catalog name, and call ``generate`` / ``stream`` / ``chat`` with
:class:`SamplingParams`.
"""

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Each of these pulls in torch; imported on first use so that `llmsys --help` and light tools
    # stay fast, and the console script catches a Ctrl-C from its first line (engine/cli/main.py).
    if name == "LLM":
        from llmsys.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from llmsys.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from llmsys.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
