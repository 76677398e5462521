"""The SGLang CPU compatibility layer's stand-in kernels, against hand-computed cases.

Tree conventions (SGLang's EAGLE): the draft's candidates are numbered across steps, step 0
has `topk` (children of the root), every later step `topk * topk`; candidate c's parent is
`parent_list[c // topk]` (0 there means the root). `selected_index` picks the n-1 tree nodes.
"""

from __future__ import annotations

import torch

from draftsmith.engines.sglang.cpu import LAUNCH_ARGS, OVERLAY, server_env
from draftsmith.engines.sglang.cpu.kernels import (
    FULL_MASK,
    QLEN_ONLY,
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

T, F = True, False


def test_assign_req_to_token_pool_writes_each_run_into_its_row():
    table = torch.zeros(3, 6, dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        table,
        torch.tensor([1, 0]),
        torch.tensor([3, 2]),
        torch.tensor([10, 11, 20, 21]),
        6,
    )
    assert table.tolist() == [[20, 21, 0, 0, 0, 0], [0] * 6, [0, 10, 11, 0, 0, 0]]


def test_assign_extend_cache_locs_reads_runs_back():
    table = torch.arange(18, dtype=torch.int32).view(3, 6)
    out = torch.full((5,), -1, dtype=torch.int64)
    assign_extend_cache_locs_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 3]), torch.tensor([3, 6]), out, 6
    )
    assert out.tolist() == [13, 14, 3, 4, 5]


def test_assign_draft_cache_locs_contiguous_packs_topk_times_steps_per_request():
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    out = torch.zeros(8, dtype=torch.int64)
    # topk 2 x 2 steps = 4 slots per request, starting at the request's seq_len
    assign_draft_cache_locs_contiguous_cpu(
        torch.tensor([1, 0]), table, torch.tensor([3, 5]), out, 12, 2, 2
    )
    assert out.tolist() == [15, 16, 17, 18, 5, 6, 7, 8]


def test_fill_bonus_tokens_takes_last_accepted():
    bonus = torch.zeros(2, dtype=torch.int32)
    fill_bonus_tokens_cpu(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [6, 10]


def test_fill_accept_out_cache_loc_compacts_accepted_slots():
    out = torch.full((4,), -7, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(
        torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.arange(100, 106), out
    )
    assert out.tolist() == [100, 102, 103, -7]


def _tree(parent_list, selected, seq_lens, topk, depth, n, mode=QLEN_ONLY):
    bs = len(seq_lens)
    if mode == QLEN_ONLY:
        mask = torch.ones(bs * n * n, dtype=torch.bool)
    else:
        mask = torch.ones(sum(seq_lens) * n + bs * n * n, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.int64)
    ridx, nxt, sib = torch.full((3, bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient_cpu(
        torch.tensor(parent_list),
        torch.tensor(selected),
        torch.tensor(seq_lens),
        mask,
        positions,
        ridx,
        nxt,
        sib,
        topk,
        depth,
        n,
        mode,
    )
    return mask, positions.tolist(), ridx.tolist(), nxt.tolist(), sib.tolist()


def test_build_tree_topk1_is_a_chain():
    # candidates 0, 1, 2 (one per step), each the child of the previous
    mask, pos, ridx, nxt, sib = _tree([[-1, 0, 1]], [[0, 1, 2]], [7], 1, 3, 4)
    assert ridx == [[0, 1, 2, 3]]
    assert nxt == [[1, 2, 3, -1]] and sib == [[-1, -1, -1, -1]]
    assert pos == [7, 8, 9, 10]
    assert mask.view(4, 4).tolist() == [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]]


def test_build_tree_topk2_branches_and_second_request_offsets():
    # step 0: candidates 0 (a), 1 (b), children of the root; step 1: 2, 3 under 0 and 4, 5
    # under 1. Request 0 selects a, b and a's child (2); request 1 selects a, b and b's child (4).
    mask, pos, ridx, nxt, sib = _tree(
        [[-1, 0, 1], [-1, 0, 1]], [[0, 1, 2], [0, 1, 4]], [5, 9], 2, 2, 4
    )
    assert ridx == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the root's children list is 1 -> 2 (the later-built child is linked first)
    assert nxt == [[1, 3, -1, -1], [1, -1, 3, -1]]
    assert sib == [[-1, 2, -1, -1], [-1, 2, -1, -1]]
    assert pos == [5, 6, 6, 7, 9, 10, 10, 11]
    m = mask.view(2, 4, 4).tolist()
    assert m[0] == [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, T, F, T]]
    assert m[1] == [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, F, T, T]]


def test_build_tree_skips_a_node_whose_parent_was_not_selected():
    # candidate 4's parent is candidate 1, which is not selected: node 2 stays unlinked
    _, _, _, nxt, sib = _tree([[-1, 0, 1]], [[0, 4, 2]], [3], 2, 2, 4)
    assert nxt == [[1, 3, -1, -1]] and sib == [[-1, -1, -1, -1]]


def test_build_tree_full_mask_keeps_prefix_columns_per_request():
    # two requests (prefix 2 and 1), one draft token each after the root: n = 2
    mask, pos, *_ = _tree([[-1], [-1]], [[0], [0]], [2, 1], 1, 1, 2, mode=FULL_MASK)
    assert pos == [2, 3, 1, 2]
    assert mask.tolist() == [T, T, T, F, T, T, T, T] + [T, T, F, T, T, T]


def _verify(candidates, tree, target, steps):
    ridx, nxt, sib = (torch.tensor(t) for t in tree)
    bs, n = len(candidates), len(candidates[0])
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept = torch.full((bs, steps), -1, dtype=torch.int32)
    num = torch.zeros(bs, dtype=torch.int32)
    verify_tree_greedy_cpu(
        predicts, accept, num, torch.tensor(candidates), ridx, nxt, sib, torch.tensor(target)
    )
    return predicts.tolist(), accept.tolist(), num.tolist()


def test_verify_greedy_chain_accepts_the_matching_prefix():
    chain = ([[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1, -1, -1, -1]])
    # drafts a=11, b=12, c=13; the target agrees on a and b, then wants 40 instead of c
    predicts, accept, num = _verify([[99, 11, 12, 13]], chain, [[11, 12, 40, 41]], 4)
    assert accept == [[0, 1, 2, -1]] and num == [2]
    assert predicts == [11, 12, 40, 0]  # accepted tokens, then the bonus token at row 2


def test_verify_greedy_chain_rejects_at_the_first_draft():
    chain = ([[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1, -1, -1, -1]])
    predicts, accept, num = _verify([[99, 11, 12, 13]], chain, [[50, 12, 13, 41]], 4)
    assert accept == [[0, -1, -1, -1]] and num == [0]
    assert predicts == [50, 0, 0, 0]


def test_verify_greedy_tree_follows_siblings_and_flat_rows():
    # the topk-2 tree of request 0 above, twice: root children 1 (a=11) and 2 (b=12), node 3
    # (c=13) under node 1. Request 0: target picks b at the root (sibling), then nothing below.
    # Request 1: target picks a, then c under a, then the bonus 77 at node 3 (flat row 7).
    tree = ([[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 3, -1, -1]] * 2, [[-1, 2, -1, -1]] * 2)
    cand = [[99, 11, 12, 13], [99, 11, 12, 13]]
    target = [[12, 0, 66, 0], [11, 13, 0, 77]]
    predicts, accept, num = _verify(cand, tree, target, 3)
    assert accept == [[0, 2, -1], [4, 5, 7]] and num == [1, 2]
    assert predicts == [12, 0, 66, 0, 11, 13, 0, 77]


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_gather_first():
    k = torch.arange(48, dtype=torch.float32).view(6, 2, 4)
    v = -torch.arange(48, dtype=torch.float32).view(6, 2, 4)
    k0, v0 = k.clone(), v.clone()
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * 4, v.stride(0) * 4])
    # row 2 is both a target and a source: rows are gathered before they are written
    copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 5]))
    for new, old in ((k, k0), (v, v0)):
        assert torch.equal(new[1], old[2]) and torch.equal(new[2], old[5])
        assert torch.equal(new[[0, 3, 4, 5]], old[[0, 3, 4, 5]])


def test_server_env_puts_overlay_first_and_turns_the_cpu_engine_on():
    env = server_env({"PYTHONPATH": "/elsewhere", "HOME": "/h"}, threads=2)
    parts = env["PYTHONPATH"].split(":")
    assert parts[0] == str(OVERLAY) and parts[-1] == "/elsewhere"
    assert (OVERLAY / "sitecustomize.py").is_file() and (OVERLAY / "sgl_kernel").is_dir()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert env["HOME"] == "/h"
    assert "torch_native" in LAUNCH_ARGS
    # no crash diagnostics on CPU (a 5 s sleep at every stop), unless the caller asks for them
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert (
        server_env({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    )


def test_torchvision_schemas_are_declared_once():
    from draftsmith.engines.sglang.cpu.hook import (
        TORCHVISION_SCHEMAS,
        _has_schema,
        declare_torchvision_ops,
    )

    first = declare_torchvision_ops()
    assert all(_has_schema(name) for name in TORCHVISION_SCHEMAS)
    assert set(first) <= set(TORCHVISION_SCHEMAS) and declare_torchvision_ops() == []


def test_mla_registration_answers_sglangs_own_mla_choice():
    """mla.register adds torch_native to a registry shaped like SGLang's DeepSeek dispatch
    (`get_handler` falls back to triton), answering `_dispatch_mla_subtype`; it is idempotent
    and keeps a registration SGLang made itself."""
    from types import SimpleNamespace

    from draftsmith.engines.sglang.cpu import mla

    def fresh():
        class Registry:
            _handlers = {"triton": lambda attn, fb: "MHA"}

            @classmethod
            def register(cls, name, fn):
                cls._handlers[name] = fn

            @classmethod
            def get_handler(cls, name):
                return cls._handlers.get(name, cls._handlers.get("triton"))

        return SimpleNamespace(
            AttentionBackendRegistry=Registry, _dispatch_mla_subtype=lambda attn, fb: "MLA"
        )

    module = fresh()
    assert module.AttentionBackendRegistry.get_handler("torch_native")(None, None) == "MHA"
    mla.register(module)
    handler = module.AttentionBackendRegistry.get_handler("torch_native")
    assert handler(None, None) == "MLA"
    mla.register(module)
    assert module.AttentionBackendRegistry.get_handler("torch_native") is handler
    own = fresh()
    own.AttentionBackendRegistry._handlers["torch_native"] = mine = lambda attn, fb: "OWN"
    mla.register(own)
    assert own.AttentionBackendRegistry.get_handler("torch_native") is mine


def test_the_hook_patches_sglangs_deepseek_dispatch_module():
    from draftsmith.engines.sglang.cpu import hook

    assert hook.MLA_REGISTRY in hook.PATCHED_MODULES
    assert hook.MLA_REGISTRY == "sglang.srt.models.deepseek_common.attention_backend_handler"


def test_the_mla_draft_shares_the_embedding_without_a_cuda_synchronize():
    """SGLang's Eagle3DeepseekV2ForCausalLM calls torch.cuda.synchronize() in set_embed /
    set_embed_and_head, which CPU torch refuses; mla.install_draft runs them without it, once,
    and leaves torch.cuda.synchronize as it was."""
    from types import SimpleNamespace

    from draftsmith.engines.sglang.cpu import hook, mla

    class Draft:
        def set_embed(self, embed):
            self.embed = embed
            torch.cuda.synchronize()

        def set_embed_and_head(self, embed, head):
            self.embed, self.head = embed, head
            torch.cuda.synchronize()

    sync = torch.cuda.synchronize
    module = SimpleNamespace(Eagle3DeepseekV2ForCausalLM=Draft)
    mla.install_draft(module)
    mla.install_draft(module)  # idempotent: wrapped once
    d = Draft()
    d.set_embed(1)
    d.set_embed_and_head(2, 3)
    assert (d.embed, d.head) == (2, 3)
    assert torch.cuda.synchronize is sync
    assert Draft.set_embed.__wrapped__.__name__ == "set_embed"
    assert not hasattr(Draft.set_embed.__wrapped__, "__wrapped__")
    assert hook.MLA_DRAFT in hook.PATCHED_MODULES
    assert hook.MLA_DRAFT == "sglang.srt.models.kimi_k25_eagle3"
