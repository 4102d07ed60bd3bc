"""KV eviction policies for long contexts (public entry point).

``parse_kv_policy(text) -> KVPolicy`` reads ``--kv-policy``; a
:class:`PolicyRuntime` applies it inside the engine (see
``llmsys.offload.eviction``: ``policy`` decides which tokens stay,
``compact`` moves/re-rotates K/V, ``runtime`` hooks scheduler and runner,
``quest`` selects pages per query; the attention side of a policy is the
engine's attention backend, ``engine/attention.py``).
"""

from llmsys.offload.eviction.compact import compact_kv, ensure_rope_positions, rotate_by
from llmsys.offload.eviction.policy import POLICIES, KVPolicy, parse_kv_policy
from llmsys.offload.eviction.quest import QuestAttention, QuestStats
from llmsys.offload.eviction.runtime import PolicyRuntime, SeqKVState, make_policy_runtime

__all__ = [
    "POLICIES",
    "KVPolicy",
    "PolicyRuntime",
    "QuestAttention",
    "QuestStats",
    "SeqKVState",
    "compact_kv",
    "ensure_rope_positions",
    "parse_kv_policy",
    "make_policy_runtime",
    "rotate_by",
]
