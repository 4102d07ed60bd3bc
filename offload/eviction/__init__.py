"""KV eviction and page selection; the public names are in ``llmsys.offload.kv_policy``."""
