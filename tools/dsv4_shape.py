"""The KV pools of a DeepSeek-V4-Flash-like model on one GPU, by pool, for the demo.

The geometry is DeepSeek-V4-Flash's as transformers' ``DeepseekV4Config`` describes it (43
layers; its default layer schedule: 2 heavily compressed layers, then compressed-sparse and
heavily compressed layers alternating, so 20 at ratio 4 and 23 at ratio 128; a 512-wide
latent; a 128-wide indexer), laid out the way SGLang 0.5.23's ``DeepSeekV4TokenToKVPool``
lays it out (one latent slot per token and layer: 448 fp8 bytes without RoPE, 64 bf16 RoPE
values, 8 bytes of scales and padding; SWA tokens a tenth of the full tokens, 256-token
pages; float32 compressor state in rings of 8 rows per SWA page at ratio 4, 128 rows per
request slot at ratio 128).  MLA keeps the whole latent on every tensor-parallel rank, so
these are one rank's pools.

This is the demo's own arithmetic, to give its DeepSeek-V4-shaped server realistic pool
sizes without SGLang: the adapters measure SGLang's real pools (adapters/sglang/pool_bytes.py).

All sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The pools, in the order SGLang's DeepSeek-V4 pool builds them (the names the adapter reports).
POOLS = ("swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool", "compress_state_pools",
         "indexer_compress_state_pools")


@dataclass(frozen=True)
class Dsv4Shape:
    """One rank's KV geometry.  Invariant: :meth:`pools` grows with ``full_tokens``."""

    c4_layers: int = 20
    c128_layers: int = 23
    latent_slot_bytes: int = 448 + 64 * 2 + 8
    indexer_slot_bytes: int = 128 + 4  # fp8 index key and its scale
    head_dim: int = 512
    indexer_head_dim: int = 128
    swa_tokens_per_full_token: float = 0.1
    page_tokens: int = 256
    c4_ring_rows: int = 8
    c128_ring_rows: int = 128
    request_slots: int = 65  # 64 running requests and the padding slot
    state_value_bytes: int = 4  # float32

    @property
    def layers(self) -> int:
        return self.c4_layers + self.c128_layers

    def pools(self, full_tokens: int) -> dict[str, int]:
        """Each pool's bytes for a cache of ``full_tokens`` (rounded down to whole pages)."""
        full = full_tokens // self.page_tokens * self.page_tokens
        swa_pages = -(-int(full * self.swa_tokens_per_full_token) // self.page_tokens)
        swa_tokens = swa_pages * self.page_tokens
        c4_state_rows = swa_pages * self.c4_ring_rows
        c128_state_rows = self.request_slots * self.c128_ring_rows
        overlapped_row = 2 * 2 * self.state_value_bytes  # (kv, score), twice for the overlapping window
        return {
            "swa_kv_pool": swa_tokens * self.layers * self.latent_slot_bytes,
            "c4_kv_pool": full // 4 * self.c4_layers * self.latent_slot_bytes,
            "c128_kv_pool": full // 128 * self.c128_layers * self.latent_slot_bytes,
            "c4_indexer_kv_pool": full // 4 * self.c4_layers * self.indexer_slot_bytes,
            "compress_state_pools": c4_state_rows * self.c4_layers * overlapped_row * self.head_dim
            + c128_state_rows * self.c128_layers * 2 * self.state_value_bytes * self.head_dim,
            "indexer_compress_state_pools": c4_state_rows * self.c4_layers * overlapped_row * self.indexer_head_dim,
        }

    def full_tokens_for(self, budget_bytes: int) -> int:
        """The most full tokens (whole pages) whose pools fit in ``budget_bytes``; 0 if none do."""
        low, high = 0, max(0, budget_bytes) // self.page_tokens + 1  # pages: a page costs more than a byte
        while low < high:  # the largest page count that fits (pools grow with pages)
            mid = (low + high + 1) // 2
            if sum(self.pools(mid * self.page_tokens).values()) <= budget_bytes:
                low = mid
            else:
                high = mid - 1
        return low * self.page_tokens
