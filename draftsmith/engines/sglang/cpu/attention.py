"""EAGLE / EAGLE3 speculative decoding on SGLang's `torch_native` attention backend.

SGLang 0.5.23 refuses EAGLE with `torch_native` (`srt/speculative/draft_utils.py`: the backend
is missing from both draft backend maps), and `TorchNativeAttnBackend.forward_extend` cannot
serve target verification: it reads `extend_prefix_lens` / `extend_seq_lens`, which a verify batch
does not carry, and it has no tree mask. This module supplies the three missing pieces, modelled
on SGLang's own CPU (`intel_amx`) backend, whose compiled kernels are not available here:

- `forward_verify`: target verification. Request b's `n` draft tokens (tree order, node 0 the
  bonus token) attend to the whole committed prefix and, among the drafts, to themselves and their
  ancestors: the QLEN_ONLY tree mask `spec_info.custom_mask [bs, n, n]` when topk > 1, plain
  causal order for a chain (topk 1).
- `MultiStepDraftBackend`: the draft's multi-step decode. Each of the `topk` branches of a request
  is its own row; at step s row (b, r) attends to b's prefix and to r's own draft slots of steps
  0..s, i.e. req_to_token[b, seq_len + r * num_steps + k] (SGLang's draft KV layout,
  `generate_draft_decode_kv_indices`).
- `install(...)`: patches the two classes so the above is used. Called from the import hook in
  `draftsmith.engines.sglang.cpu.hook` when SGLang's modules load, inside SGLang processes only.

Imports sglang at module level: never import it outside the sglang-cpu role's interpreter.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

MARK = "_draftsmith_sglang_cpu"  # set on every patched class (validate_env checks it)


def _kv(backend, layer, rows: torch.Tensor):
    """Keys and values of the given cache rows as [kv_heads, len, dim] in the query dtype."""
    k = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)[rows]
    v = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)[rows]
    return k.movedim(0, 1), v.movedim(0, 1)


def _save_kv(backend, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
    if save_kv_cache and k is not None and v is not None:
        loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)


def _window(layer) -> int | None:
    """The layer's sliding window in SGLang's reading (a key at position j is visible from
    position p when p - window <= j <= p), or None for full attention."""
    w = layer.sliding_window_size
    return w if w is not None and w > -1 else None


def _unsupported(layer) -> str | None:
    if layer.is_cross_attention:
        return "cross-attention"
    if layer.logit_cap:
        return "logit soft-capping"
    return None


def verify_draft_mask(spec_info, b: int, seq_len: int, prefix_before: int, bs: int):
    """[n, n] bool: which of request b's draft tokens each of its draft tokens may see."""
    n = spec_info.draft_token_num
    mask = spec_info.custom_mask
    if spec_info.tree_topk == 1 or mask is None or mask.numel() == 0:
        return torch.ones(n, n, dtype=torch.bool).tril_()
    if mask.numel() == bs * n * n:  # QLEN_ONLY (SGLang's CPU default)
        return mask.view(bs, n, n)[b].to(torch.bool)
    # FULL_MASK: per request [n, seq_len + n], requests packed one after another
    start = n * n * b + prefix_before * n
    return mask[start : start + n * (seq_len + n)].view(n, seq_len + n)[:, seq_len:].bool()


def window_mask(positions: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
    """[n, seq_len + n] bool: the keys inside each draft token's sliding window. Prefix key j
    sits at position j; draft key i at its query's own position (`positions`, tree depth
    included). The tree mask still decides which drafts see which."""
    pos = positions.to(torch.int64)
    keys = torch.cat([torch.arange(seq_len, dtype=torch.int64), pos])
    return keys.unsqueeze(0) >= (pos.unsqueeze(1) - window)


def forward_verify(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    """Attention of a TARGET_VERIFY batch: bs requests x n draft tokens, tree-masked."""
    why = _unsupported(layer)
    if why:
        raise NotImplementedError(f"draftsmith torch_native verify: {why} is not supported")
    _save_kv(backend, layer, forward_batch, k, v, save_kv_cache)
    spec_info = forward_batch.spec_info
    n = spec_info.draft_token_num
    heads, dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
    q_ = q.reshape(-1, heads, dim)
    o = q.new_empty((q_.shape[0], heads, v_dim))
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    rows = forward_batch.req_pool_indices.tolist()
    window = _window(layer)
    prefix_before = 0
    for b, (row, seq_len) in enumerate(zip(rows, seq_lens, strict=True)):
        keys, values = _kv(backend, layer, req_to_token[row, : seq_len + n].to(torch.int64))
        mask = torch.ones(n, seq_len + n, dtype=torch.bool)
        mask[:, seq_len:] = verify_draft_mask(spec_info, b, seq_len, prefix_before, len(rows))
        if window is not None:
            mask &= window_mask(forward_batch.positions[b * n : (b + 1) * n], seq_len, window)
        prefix_before += seq_len
        query = q_[b * n : (b + 1) * n].movedim(0, 1)
        out = scaled_dot_product_attention(
            query.unsqueeze(0),
            keys.to(query.dtype).unsqueeze(0),
            values.to(query.dtype).unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=heads != layer.tp_k_head_num,
        )
        o[b * n : (b + 1) * n] = out.squeeze(0).movedim(1, 0)
    return o.view(-1, heads * v_dim)


class DraftStepBackend(TorchNativeAttnBackend):
    """One draft decode step: rows are (request, branch) pairs with their own KV tables."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.draft_tables = None  # (req_to_token rows, seq_lens, row ids), set per forward

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        why = _unsupported(layer)
        if why:
            raise NotImplementedError(f"draftsmith torch_native draft decode: {why}")
        _save_kv(self, layer, forward_batch, k, v, save_kv_cache)
        table, seq_lens, row_ids = self.draft_tables
        heads = layer.tp_q_head_num
        q_ = q.reshape(-1, heads, layer.qk_head_dim)
        o = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
        self._run_sdpa_forward_decode(
            q_,
            o,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            table,
            row_ids,
            seq_lens,
            None,
            scaling=layer.scaling,
            enable_gqa=heads != layer.tp_k_head_num,
            causal=False,
        )
        return o.view(-1, heads * layer.v_head_dim)


def draft_decode_tables(req_to_token, req_pool_indices, seq_lens, topk: int, num_steps: int):
    """[bs * topk, max_len + num_steps] KV rows: request b's prefix, then branch r's draft slots."""
    lens = seq_lens.tolist()
    width = (max(lens) if lens else 0) + num_steps
    table = torch.zeros((len(lens) * topk, width), dtype=req_to_token.dtype)
    for b, (row, s) in enumerate(zip(req_pool_indices.tolist(), lens, strict=True)):
        for r in range(topk):
            table[b * topk + r, :s] = req_to_token[row, :s]
            start = s + r * num_steps
            table[b * topk + r, s : s + num_steps] = req_to_token[row, start : start + num_steps]
    return table


class MultiStepDraftBackend:
    """`num_steps - 1` draft decode step backends sharing one set of KV tables per forward."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk > 1 and getattr(model_runner, "page_size", 1) != 1:
            # with pages, each branch's draft slots start on a fresh page (another layout)
            raise NotImplementedError(
                "draftsmith torch_native draft decode: topk > 1 needs page size 1"
            )
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [
            DraftStepBackend(model_runner) for _ in range(speculative_num_steps - 1)
        ]
        self.req_to_token_pool = model_runner.req_to_token_pool

    def init_forward_metadata(self, forward_batch):
        table = draft_decode_tables(
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.topk,
            self.speculative_num_steps,
        )
        row_ids = torch.arange(table.shape[0], dtype=torch.int64)
        seq_lens = forward_batch.seq_lens.to(torch.int64).repeat_interleave(self.topk)
        for step, backend in enumerate(self.attn_backends):
            backend.swa_out_cache_loc = None
            backend.draft_tables = (table, seq_lens + step + 1, row_ids)


def install(draft_utils_module=None) -> None:
    """Patch TorchNativeAttnBackend (verify) and, if given, DraftBackendFactory (backend maps).

    Idempotent: a patched class carries `MARK`.
    """
    cls = TorchNativeAttnBackend
    if not getattr(cls, MARK, False):
        stock_extend = cls.forward_extend

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
            if forward_batch.forward_mode.is_target_verify():
                return forward_verify(self, q, k, v, layer, forward_batch, save_kv_cache)
            return stock_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kw)

        cls.forward_extend = forward_extend
        setattr(cls, MARK, True)
    if draft_utils_module is not None:
        factory = draft_utils_module.DraftBackendFactory
        if not getattr(factory, MARK, False):
            stock_create = factory._create_backend

            def _create_backend(self, backend_name, backend_map, error_template, **kw):
                if kw.get("stamps_children"):  # the multi-step draft decode map
                    make = lambda: (  # noqa: E731
                        "torch_native",
                        MultiStepDraftBackend(
                            self.draft_model_runner, self.topk, self.speculative_num_steps
                        ),
                    )
                else:  # draft extend: the stock backend (its extend path is complete)
                    make = lambda: (  # noqa: E731
                        "torch_native",
                        TorchNativeAttnBackend(self.draft_model_runner),
                    )
                backend_map = {**backend_map, "torch_native": make}
                return stock_create(self, backend_name, backend_map, error_template, **kw)

            factory._create_backend = _create_backend
            setattr(factory, MARK, True)
