"""Pure-PyTorch stand-ins for the eight `sgl_kernel` CPU helpers SGLang 0.5.23 imports.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports these names from `sgl_kernel` at module level
(`kernels/ops/kvcache/cache_move.py`, `srt/mem_cache/allocation.py`,
`kernels/ops/speculative/{eagle.py, cache_locs.py, spec_tree.py}`). Their compiled versions ship
only as a source build of SGLang's CPU kernels; the registry wheels are CUDA-only. Each function
below has the signature of its call site and the semantics of the Triton/CUDA kernel the GPU path
runs instead (same file, or `kernels/jit/include/sgl_kernel/speculative/eagle.cuh`). Outputs are
written in place, as the kernels do. torch only: no sglang import, so tests run without it.

Cache-location helpers work on `req_to_token [max_reqs, pool_len]` (int32 cache slot of each
token of each request) and a flat `out_cache_loc` that packs request after request.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "copy_all_layer_kv_cache_cpu",
]

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2  # sglang's TreeMaskMode values


def _spans(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(request i, start, end, offset of its run in the packed buffer) per request."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        yield i, s, e, offset
        offset += e - s


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[req_i, start_i:end_i] = the i-th run of the packed `out_cache_loc`."""
    del pool_len  # the row width; req_to_token carries it
    rows = req_pool_indices.tolist()
    flat = out_cache_loc.reshape(-1)
    for i, s, e, off in _spans(start_offset, end_offset):
        if e > s:
            req_to_token[rows[i], s:e] = flat[off : off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """The reverse: the i-th run of `out_cache_loc` = req_to_token[req_i, start_i:end_i]."""
    del pool_len
    rows = req_pool_indices.tolist()
    flat = out_cache_loc.view(-1)
    for i, s, e, off in _spans(start_offset, end_offset):
        if e > s:
            flat[off : off + e - s] = req_to_token[rows[i], s:e].to(flat.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
):
    """Request i's `topk * num_steps` draft slots, req_to_token[req_i, seq_len_i:+n], packed."""
    del pool_len
    n = topk * num_steps
    flat = out_cache_loc.view(-1)
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        flat[i * n : (i + 1) * n] = req_to_token[row, s : s + n].to(flat.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the cache slots of the accepted tokens (accept_index != -1), in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat > -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def _parent_position(sel: list[int], parents: list[int], i: int, topk: int, n: int) -> int:
    """Tree position (0 = root) of the parent of selected token i-1; n when it has none."""
    parent_tb = sel[i - 1] // topk
    if parent_tb == 0:
        return 0
    token = parents[parent_tb]
    for pp in range(n - 1):
        if sel[pp] == token:
            return pp + 1
    return n


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """EAGLE tree from the draft's top-k expansions (eagle.cuh `build_tree_efficient`).

    Node 0 of request b is the verified (bonus) token; node t > 0 is the draft token picked at
    `selected_index[b, t-1]`, an index into the flattened per-step top-k candidates whose parent
    candidate is `parent_list[b, selected_index // topk]`. Fills, for every request:
    - retrive_index[b, t] = b * n + t (row into the flat verify batch);
    - retrive_next_token[b, p] = the last-listed child of node p, retrive_next_sibling[b, t] =
      the next child of t's parent (-1 ends a list; callers pre-fill both with -1);
    - positions[b * n + t] = seq_len_b + depth of node t;
    - tree_mask: node t sees the root, itself and its ancestors. QLEN_ONLY is [bs, n, n];
      FULL_MASK is per request [n, seq_len_b + n] with the prefix columns left as the caller set
      them (all True).
    """
    if int(tree_mask_mode) == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("bit-packed tree masks are a GPU-only mode")
    n = int(draft_token_num)
    bs = verified_seq_len.numel()
    parents_all = parent_list.reshape(bs, -1).tolist()
    sel_all = selected_index.reshape(bs, -1).tolist()
    seq_lens = verified_seq_len.tolist()
    mask = tree_mask.view(-1)
    nxt, sib, ridx, pos = retrive_next_token, retrive_next_sibling, retrive_index, positions
    prefix = 0
    for b in range(bs):
        sel, parents, seq_len = sel_all[b], parents_all[b], seq_lens[b]
        if int(tree_mask_mode) == FULL_MASK:
            base, width, first = n * n * b + prefix * n, seq_len + n, seq_len
        else:
            base, width, first = n * n * b, n, 0
        prefix += seq_len
        for t in range(n):  # row t: root column True, the n-1 draft columns False
            row = base + width * t + first
            mask[row] = True
            mask[row + 1 : row + n] = False
        pos[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            ridx[b, i] = b * n + i
            p = _parent_position(sel, parents, i, topk, n)
            if p == n:  # no selected parent (NaN logprobs upstream): skip the node, as CUDA does
                continue
            if int(nxt[b, p]) != -1:
                sib[b, i] = nxt[b, p]
            nxt[b, p] = i
        ridx[b, 0] = b * n
        for t in range(1, n):
            row = base + width * t + first + 1
            cur, d = t - 1, 0
            while True:
                d += 1
                mask[row + cur] = True
                p = _parent_position(sel, parents, cur + 1, topk, n)
                if p == 0 or p == n:
                    break
                cur = p - 1
            pos[b * n + t] = seq_len + d


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    """Greedy tree verification (spec_tree.py `verify_tree_greedy_kernel_triton`).

    Walk from the root: among the children of the last accepted node, accept the first whose
    draft token equals the target's argmax at that node; stop when none does or
    `accept_index.shape[1] - 1` drafts are accepted. Writes accept_index[b, :k+1] (flat verify
    rows of root and accepted nodes), accept_token_num[b] = k, and predicts[row] = the target
    token at each accepted row plus the bonus token after the last one.
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    out = predicts.view(-1)
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            out[last] = want
            accepted += 1
            accept_index[b, accepted] = ridx[b][cur]
            last = ridx[b][cur]
        accept_token_num[b] = accepted
        out[last] = target[last]


def _rows(ptr: int, stride: int, n_rows: int) -> torch.Tensor:
    """The [n_rows, stride] bytes at address ptr, as a uint8 tensor aliasing that memory."""
    buf = (ctypes.c_uint8 * (n_rows * stride)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(n_rows, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Move KV rows src_loc -> tgt_loc in every layer buffer (memory_pool.py `data_ptrs`).

    `data_ptrs[l]` is the address of layer buffer l (K and V of every layer), `strides[l]` its
    row size in bytes. Rows are gathered before they are scattered, so overlapping moves are
    safe, as in the Triton kernel.
    """
    src = src_loc.to(torch.int64).reshape(-1)
    tgt = tgt_loc.to(torch.int64).reshape(-1)
    if src.numel() == 0:
        return
    n_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _rows(int(ptr), int(stride), n_rows)
        rows[tgt] = rows[src].clone()
