"""``llmsys bench``: llama-bench-style measurements of the engine, swept over its axes.

``machine`` (measured bandwidths, reusable by the offload planner),
``synthetic`` (random-weight checkpoints of standard shapes), ``measure``
(pp / tg / pg timing through the engine's scheduler + runner), ``baseline``
(transformers / accelerate), ``suite`` (the sweep matrix), ``report``
(Markdown / JSON / JSONL / CSV / PNG).
"""

from llmsys.engine.bench.machine import MachineInfo, machine_info, measure_bandwidths

__all__ = ["MachineInfo", "machine_info", "measure_bandwidths"]
