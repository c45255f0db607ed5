"""A fake of SGLang's legacy allocator layout (<= 0.5.12), for the tests of that layout.

In 0.5.12 ``sglang.srt.mem_cache.allocator`` is one module that defines
``PagedTokenToKVPoolAllocator`` (with inline Triton kernels), and
``sglang.srt.mem_cache.swa_memory_pool`` builds its SWA sub-allocators from the name it
imported from there.  No overlay of that release is built for CI, so this module has the
same shape, written for these tests: the same constructor, attribute names
(``free_pages``, ``release_pages``, ``is_not_in_free_group``, ``free_group``), method
signatures and page semantics (page 0 reserved, pages taken from the front of the free list,
``free`` takes token ids), with a torch loop in place of the kernels.  ``GET_NUM_NEW_PAGES_CALLS``
counts calls to the module-level ``get_num_new_pages``.
"""

from __future__ import annotations

import types

import torch

GET_NUM_NEW_PAGES_CALLS = 0


def get_num_new_pages(seq_lens, page_size, prefix_lens=None, decode=False):
    global GET_NUM_NEW_PAGES_CALLS
    GET_NUM_NEW_PAGES_CALLS += 1
    if decode:
        return int((seq_lens % page_size == 1).sum())
    return int(((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum())


class PagedTokenToKVPoolAllocator:
    def __init__(self, size, page_size, dtype, device, kvcache, need_sort):
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        self._kvcache, self.need_sort = kvcache, need_sort
        self.num_pages = size // page_size
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    def available_size(self):
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def merge_and_sort_free(self):
        if len(self.release_pages):
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.release_pages)))[0]
            self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)

    def backup_state(self):
        return (self.free_pages, self.release_pages)

    def restore_state(self, state):
        self.free_pages, self.release_pages = state

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self):
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))

    def alloc(self, need_size):
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            return None
        out_pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return (out_pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages=None):
        out, cursor = [], 0
        for prefix, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
            for pos in range(prefix, seq):
                if pos % self.page_size == 0:
                    if cursor >= len(self.free_pages):
                        return None
                    last = int(self.free_pages[cursor]) * self.page_size - 1
                    cursor += 1
                last += 1
                out.append(last)
        if num_new_pages is None:
            num_new_pages = get_num_new_pages(seq_lens_cpu, self.page_size, prefix_lens_cpu)
        if num_new_pages > len(self.free_pages):
            return None
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        num_new_pages = get_num_new_pages(seq_lens_cpu, self.page_size, decode=True)
        if num_new_pages > len(self.free_pages):
            return None
        out, cursor = [], 0
        for seq, last in zip(seq_lens.tolist(), last_loc.tolist()):
            if seq % self.page_size == 1:
                out.append(int(self.free_pages[cursor]) * self.page_size)
                cursor += 1
            else:
                out.append(last + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            pages = torch.unique(free_index // self.page_size)
            if self.need_sort:
                self.release_pages = torch.cat((pages, self.release_pages))
            else:
                self.free_pages = torch.cat((pages, self.free_pages))
        else:
            self.free_group.append(free_index)


def legacy_modules(name: str = "legacy_sglang") -> tuple[types.ModuleType, types.ModuleType]:
    """``(allocator module, swa_memory_pool module)`` of the legacy shape, fresh each call."""
    allocator = types.ModuleType(f"{name}.srt.mem_cache.allocator")
    allocator.get_num_new_pages = get_num_new_pages
    allocator.PagedTokenToKVPoolAllocator = PagedTokenToKVPoolAllocator
    swa = types.ModuleType(f"{name}.srt.mem_cache.swa_memory_pool")
    swa.PagedTokenToKVPoolAllocator = allocator.PagedTokenToKVPoolAllocator

    class SWATokenToKVPoolAllocator:  # builds its sub-allocators from the module-level name
        def __init__(self, size, size_swa, page_size, dtype, device, kvcache, need_sort):
            paged = swa.PagedTokenToKVPoolAllocator
            self.full_attn_allocator = paged(size, page_size, dtype, device, None, need_sort)
            self.swa_attn_allocator = paged(size_swa, page_size, dtype, device, None, need_sort)

    swa.SWATokenToKVPoolAllocator = SWATokenToKVPoolAllocator
    return allocator, swa
