"""Shard storage modes: how a shard lays out the aux and final states, encoded on write, decoded on read.

Two independent choices (config `capture.storage`, recorded in the manifest's `storage`):

aux (the draft's input: K aux states per token, K = len(aux_layer_ids), 3 by default):
    dtype         `aux_hidden_states [T, KH]` in `capture.dtype` (the exact reference)
    float8_e4m3   `aux_hidden_states [T, KH]` float8 e4m3 plus `aux_scales [T, KH / B]` float32:
                  one scale per token and block of B channels (B = `scale_block`, default the
                  hidden size: one scale per token and aux layer), scale = amax / 448; on read
                  a state is `fp8 * scale` in float32.
final (the teacher: only its distribution over the draft vocabulary at trained positions matters):
    states        `last_hidden_states [T, H]` post-norm, every token (the exact reference)
    trained       `last_hidden_states [P, H]`, only the P trained positions (token order)
    topk          `teacher_topk_ids [P, k]` (uint16 if the target vocabulary fits, else int32) and
                  `teacher_topk_logprobs [P, k]` float16: the k largest log-probabilities of the
                  target's full-vocabulary softmax, descending, at the P trained positions.
                  With `topk_vocab: draft`: the k largest of the teacher itself (the target's
                  softmax restricted to the draft vocabulary), in draft ids (uint16 if the draft
                  vocabulary fits), plus `teacher_in_vocab [P]` uint8, whether the target's
                  full-vocabulary argmax is in the draft vocabulary.

A trained position q is one whose next token q+1 is in the same row and has loss_mask 1: the
positions whose teacher training reads (the prediction made at q+1 ... is trained toward the
target's distribution at q; see draftsmith/algorithms/eagle3/ttt.py). They follow from `loss_mask` and
`row_offsets` alone, so a shard needs no index tensor.

`topk_vocab: target` (the default): the top-k ids are target ids, not draft ids: the shard does
not depend on the draft vocabulary (a new `draft.vocab_size` does not make shards stale).
Training keeps the entries inside the draft vocabulary and renormalizes them (the teacher mass
outside the k entries is lost), and the argmax-in-draft-vocabulary flag is `t2d` of the top-1
id, exactly what the full lm_head gives.

`topk_vocab: draft`: the k entries are the teacher's own largest, so none is spent on a token
outside the draft vocabulary, and their log-probabilities are exact (normalized over the draft
vocabulary): the mass they leave, 1 - sum(p), is known. Training keeps it as one bucket, the
unlisted tokens together (draftsmith/algorithms/eagle3/ttt.py). The shard depends on the draft vocabulary: the
manifest records its fingerprint (`draft_vocab_fingerprint`), training refuses another one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AUX_MODES = ("dtype", "float8_e4m3")
FINAL_MODES = ("states", "trained", "topk")
TOPK_VOCABS = ("target", "draft")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
FP8 = torch.float8_e4m3fn
DTYPE_TAGS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
TAG_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "U16": 2, "U8": 1, "F8_E4M3": 1}


class StorageError(ValueError):
    """A storage setting that cannot apply to this shard; the message names the key."""


@dataclass(frozen=True)
class Storage:
    aux: str = "dtype"
    final: str = "states"
    scale_block: int = 0  # channels per fp8 scale; 0 = the hidden size
    topk: int = 32
    topk_vocab: str = "target"  # top-k of the full-vocabulary softmax, or of the draft teacher

    def __post_init__(self):
        if self.aux not in AUX_MODES:
            raise StorageError(f"capture.storage.aux {self.aux!r} is not one of {AUX_MODES}")
        if self.final not in FINAL_MODES:
            raise StorageError(f"capture.storage.final {self.final!r} is not one of {FINAL_MODES}")
        if self.topk_vocab not in TOPK_VOCABS:
            raise StorageError(
                f"capture.storage.topk_vocab {self.topk_vocab!r} is not one of {TOPK_VOCABS}"
            )
        if self.scale_block < 0 or self.topk < 1:
            raise StorageError(
                f"capture.storage: scale_block {self.scale_block} must be >= 0, "
                f"topk {self.topk} >= 1"
            )

    @classmethod
    def from_config(cls, section: dict | None) -> Storage:
        """From `capture.storage` (keys aux, final, scale_block, topk, topk_vocab; missing ones
        default)."""
        section = dict(section or {})
        unknown = set(section) - {"aux", "final", "scale_block", "topk", "topk_vocab"}
        if unknown:
            raise StorageError(f"capture.storage: unknown keys {sorted(unknown)}")
        return cls(**section)

    @classmethod
    def from_manifest(cls, manifest: dict) -> Storage:
        """The mode a manifest records; a manifest without `storage` is the reference layout."""
        rec = manifest.get("storage") or {}
        try:
            return cls(
                aux=rec.get("aux", "dtype"),
                final=rec.get("final", "states"),
                scale_block=int(rec.get("scale_block", 0)),
                topk=int(rec.get("topk", 32)),
                topk_vocab=rec.get("topk_vocab", "target"),
            )
        except (StorageError, TypeError, ValueError) as e:
            raise StorageError(f"manifest storage {rec!r}: {e}") from None

    def block(self, hidden: int) -> int:
        b = self.scale_block or hidden
        if self.aux == "float8_e4m3" and hidden % b:
            raise StorageError(
                f"capture.storage.scale_block {b} does not divide the hidden size {hidden}"
            )
        return b

    def name(self, dtype: str) -> str:
        """Short name of the mode, e.g. `bfloat16` (the reference) or `float8_e4m3+topk32`."""
        aux = dtype if self.aux == "dtype" else self.aux
        if self.aux == "float8_e4m3" and self.scale_block:
            aux += f"/b{self.scale_block}"
        final = {"states": "", "trained": "+trained", "topk": f"+topk{self.topk}"}[self.final]
        if self.draft_topk:
            final += "-draft"
        return aux + final

    @property
    def draft_topk(self) -> bool:
        """The teacher is stored as its own top-k over the draft vocabulary."""
        return self.final == "topk" and self.topk_vocab == "draft"

    def record(
        self,
        dtype: str,
        hidden: int,
        vocab: int | None,
        trained: int,
        draft_ids: torch.Tensor | None = None,
    ) -> dict:
        """The manifest's `storage` entry: the mode and every parameter a reader needs.

        draft_ids [K]: the target id of each draft id (`topk_vocab: draft` only)."""
        rec = {"mode": self.name(dtype), "aux": self.aux, "final": self.final}
        if self.aux == "float8_e4m3":
            rec["scale_block"] = self.block(hidden)
        if self.final != "states":
            rec["trained_positions"] = int(trained)
        if self.final == "topk":
            if not vocab:
                raise StorageError("capture.storage.final topk needs the target vocabulary size")
            rec.update(topk=self.topk, vocab_size=int(vocab), ids=topk_id_tag(vocab))
        if self.draft_topk:
            if draft_ids is None:
                raise StorageError("capture.storage.topk_vocab draft needs the draft vocabulary")
            if self.topk > draft_ids.numel():
                raise StorageError(
                    f"capture.storage.topk {self.topk} exceeds the draft vocabulary "
                    f"{draft_ids.numel()}"
                )
            rec.update(
                topk_vocab="draft",
                draft_vocab_size=int(draft_ids.numel()),
                draft_vocab_fingerprint=draft_vocab_fingerprint(draft_ids),
                ids=topk_id_tag(draft_ids.numel()),
            )
        return rec


def draft_vocab_fingerprint(draft_ids: torch.Tensor) -> str:
    """sha256 (16 hex digits) of the draft vocabulary: the target id of each draft id, in order."""
    data = draft_ids.to(torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def check_draft_vocab(manifest: dict, draft_ids: torch.Tensor) -> None:
    """Raise StorageError if a shard's teacher was stored over another draft vocabulary."""
    rec = manifest.get("storage") or {}
    if rec.get("topk_vocab") != "draft":
        return
    if rec.get("draft_vocab_fingerprint") != draft_vocab_fingerprint(draft_ids):
        raise StorageError(
            f"its top-k teacher is over another draft vocabulary ({rec.get('draft_vocab_size')} "
            f"tokens, fingerprint {rec.get('draft_vocab_fingerprint')}; this one: "
            f"{draft_ids.numel()} tokens, {draft_vocab_fingerprint(draft_ids)}): recapture the "
            "shards for this vocabulary (a new vocab file makes them stale in the workflow)"
        )


def topk_id_tag(vocab: int) -> str:
    return "U16" if vocab <= 65536 else "I32"


def trained_mask(loss_mask: torch.Tensor, row_offsets: torch.Tensor) -> torch.Tensor:
    """[T] bool: positions q whose next token is in the same row and has loss_mask 1."""
    t = loss_mask.numel()
    out = torch.zeros(t, dtype=torch.bool)
    out[:-1] = loss_mask[1:].bool()
    ends = row_offsets[1:].long() - 1  # the last token of each row predicts nothing in its row
    out[ends] = False
    return out


def layout(
    storage: Storage,
    t: int,
    r: int,
    h: int,
    dtype: str,
    p: int,
    vocab: int | None,
    draft_vocab: int | None = None,
    n_aux: int = 3,
):
    """(name, safetensors dtype tag, shape) of every tensor, in file order.

    vocab: the target's vocabulary size; draft_vocab: the draft's (`topk_vocab: draft`);
    n_aux: the aux states per token (one per capture.aux_layer_ids entry)."""
    tag = DTYPE_TAGS[dtype]
    out = [("input_ids", "I64", [t]), ("row_offsets", "I64", [r + 1])]
    if storage.aux == "dtype":
        out.append(("aux_hidden_states", tag, [t, n_aux * h]))
    else:
        out.append(("aux_hidden_states", "F8_E4M3", [t, n_aux * h]))
        out.append(("aux_scales", "F32", [t, n_aux * h // storage.block(h)]))
    if storage.final == "states":
        out.append(("last_hidden_states", tag, [t, h]))
    elif storage.final == "trained":
        out.append(("last_hidden_states", tag, [p, h]))
    else:
        k = storage.topk
        if vocab is not None and k > vocab:
            raise StorageError(f"capture.storage.topk {k} exceeds the target vocabulary {vocab}")
        if storage.draft_topk:
            if draft_vocab is not None and k > draft_vocab:
                raise StorageError(
                    f"capture.storage.topk {k} exceeds the draft vocabulary {draft_vocab}"
                )
            out.append(("teacher_topk_ids", topk_id_tag(draft_vocab or 0), [p, k]))
        else:
            out.append(("teacher_topk_ids", topk_id_tag(vocab or 0), [p, k]))
        out.append(("teacher_topk_logprobs", "F16", [p, k]))
        if storage.draft_topk:
            out.append(("teacher_in_vocab", "U8", [p]))
    out.append(("loss_mask", "U8", [t]))
    return out


def nbytes(tag: str, shape: list[int]) -> int:
    n = TAG_BYTES[tag]
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------- encode (write)


def encode_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, W] -> (fp8 [n, W], float32 scales [n, W / block]); x ~= fp8 * scale per block."""
    n, w = x.shape
    xb = x.float().reshape(n, w // block, block)
    scale = xb.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not bool(torch.isfinite(scale).all()):
        raise StorageError("aux states hold inf or nan: they cannot be stored in float8")
    q = (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, w), scale


def decode_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [n, W], scales [n, W / B] -> float32 [n, W]."""
    n, w = q.shape
    nb = scale.shape[-1]
    return (q.float().reshape(n, nb, w // nb) * scale.float()[..., None]).reshape(n, w)


@torch.no_grad()
def encode_topk(last: torch.Tensor, lm_head: torch.Tensor, k: int, chunk: int = 512):
    """Post-norm states [n, H] -> (target ids [n, k] int64, log-probs [n, k] float32), top first.

    The full-vocabulary logits `last @ lm_head.T` exist `chunk` rows at a time, in float32, on
    lm_head's device.
    """
    ids = torch.empty(last.shape[0], k, dtype=torch.int64)
    vals = torch.empty(last.shape[0], k, dtype=torch.float32)
    for s in range(0, last.shape[0], chunk):
        logits = last[s : s + chunk].to(lm_head.device, torch.float32) @ lm_head.T
        v, i = F.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids[s : s + chunk], vals[s : s + chunk] = i.cpu(), v.cpu()
    return ids, vals


@torch.no_grad()
def encode_draft_topk(
    last: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, k: int, chunk: int = 512
):
    """Post-norm states [n, H] -> (draft ids [n, k] int64, log-probs [n, k] float32, in_vocab [n]
    bool): the k largest entries of the teacher, the target's log-softmax over the draft
    vocabulary (draft_ids [K]: target id of each draft id), and whether the target's
    full-vocabulary argmax is in the draft vocabulary. Logits in float32 on lm_head's device.
    """
    n = last.shape[0]
    ids = torch.empty(n, k, dtype=torch.int64)
    vals = torch.empty(n, k, dtype=torch.float32)
    ok = torch.empty(n, dtype=torch.bool)
    hot = draft_ids.to(lm_head.device, torch.long)
    in_draft = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
    in_draft[hot] = True
    for s in range(0, n, chunk):
        logits = last[s : s + chunk].to(lm_head.device, torch.float32) @ lm_head.T
        ok[s : s + chunk] = in_draft[logits.argmax(-1)].cpu()
        v, i = F.log_softmax(logits[:, hot], dim=-1).topk(k, dim=-1)
        ids[s : s + chunk], vals[s : s + chunk] = i.cpu(), v.cpu()
    return ids, vals, ok


# ----------------------------------------------------------------------------- decode (read)


def topk_teacher(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    draft_index: torch.Tensor | None,
    draft_vocab: int,
) -> torch.Tensor:
    """Dense [..., K] teacher log-probs over the draft vocabulary from top-k entries.

    ids [..., k] (-1 = no entry), logprobs [..., k], on one device.
    draft_index [V], the draft id of each target id (-1 outside the draft vocabulary): ids are
    target ids (`topk_vocab: target`); the entries inside the draft vocabulary are kept and
    renormalized, the rest get probability 0 (-inf).
    draft_index None: ids are draft ids and the log-probs exact (`topk_vocab: draft`); they are
    placed as they are, unlisted tokens get -inf, so the row sums to 1 - (the mass the top-k
    leaves), which the loss keeps as one bucket (draftsmith.algorithms.eagle3.ttt).
    A position with no entry (untrained, padding) gets the uniform distribution; training never
    reads it.
    """
    if draft_index is None:
        d = ids
    else:
        d = torch.where(ids >= 0, draft_index[ids.clamp(min=0)], -1)
    d = torch.where(d >= 0, d, draft_vocab)  # dropped entries land in a spare column
    out = torch.full((*ids.shape[:-1], draft_vocab + 1), float("-inf"), device=ids.device)
    out = out.scatter(-1, d, logprobs.float())[..., :draft_vocab]  # top-k ids are distinct
    norm = torch.logsumexp(out, dim=-1, keepdim=True)
    empty = torch.isinf(norm)
    uniform = torch.full_like(out, -math.log(draft_vocab))
    if draft_index is None:
        return torch.where(empty, uniform, out)
    return torch.where(empty, uniform, out - norm.masked_fill(empty, 0.0))


def check_layout(manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Raise StorageError unless every tensor is as the manifest's storage mode lays it out."""
    storage = Storage.from_manifest(manifest)
    rec = manifest.get("storage") or {}
    try:
        t, h, dtype = manifest["tokens"], manifest["hidden_size"], manifest["dtype"]
        have = {name: [e["dtype"], e["shape"]] for name, e in manifest["tensors"].items()}
    except (KeyError, TypeError) as e:
        raise StorageError(f"manifest lacks a size or tensor field ({e})") from None
    trained = int(trained_mask(tensors["loss_mask"], tensors["row_offsets"]).sum())
    if storage.final != "states" and rec.get("trained_positions") != trained:
        raise StorageError(
            f"manifest says {rec.get('trained_positions')} trained positions, the loss mask "
            f"gives {trained}"
        )
    if storage.aux == "float8_e4m3" and rec.get("scale_block") != storage.block(h):
        raise StorageError(f"manifest storage {rec} has no valid scale_block for hidden {h}")
    if storage.final == "topk" and not isinstance(rec.get("vocab_size"), int):
        raise StorageError(f"manifest storage {rec} has no vocab_size")
    if storage.draft_topk and not (
        isinstance(rec.get("draft_vocab_size"), int) and rec.get("draft_vocab_fingerprint")
    ):
        raise StorageError(f"manifest storage {rec} has no draft_vocab_size / fingerprint")
    r = tensors["row_offsets"].numel() - 1
    want = layout(
        storage,
        t,
        r,
        h,
        dtype,
        trained,
        rec.get("vocab_size"),
        rec.get("draft_vocab_size"),
        aux_count(manifest),
    )
    if have != {name: [tag, shape] for name, tag, shape in want}:
        raise StorageError(
            f"tensors {have} are not the layout of storage mode {storage.name(dtype)!r}: {want}"
        )


def aux_count(manifest: dict) -> int:
    """Aux states per token of a shard: one per entry of its manifest's aux_layer_ids (3 where a
    manifest predates the key: every shard then held EAGLE-3's three)."""
    ids = manifest.get("aux_layer_ids")
    return len(ids) if isinstance(ids, list) and ids else 3


class StoredStates:
    """Decoding of a shard's tensors, the same calls in every storage mode (base of Shard)."""

    def __init__(self, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.manifest = manifest
        self.storage = Storage.from_manifest(manifest)
        self.input_ids = tensors["input_ids"]
        self.loss_mask = tensors["loss_mask"]
        self.row_offsets = tensors["row_offsets"]
        self.aux_hidden_states = tensors["aux_hidden_states"]
        self.aux_scales = tensors.get("aux_scales")
        self.last_hidden_states = tensors.get("last_hidden_states")
        self.teacher_topk_ids = tensors.get("teacher_topk_ids")
        self.teacher_topk_logprobs = tensors.get("teacher_topk_logprobs")
        self.teacher_in_vocab = tensors.get("teacher_in_vocab")
        self.trained = trained_mask(self.loss_mask, self.row_offsets)
        self._slot = self.trained.long().cumsum(0) - 1  # token -> row of the [P, ...] tensors

    @property
    def n_tokens(self) -> int:
        return self.input_ids.numel()

    def aux(self, a: int, b: int) -> torch.Tensor:
        """[b - a, 3H] float32 aux states of tokens [a, b)."""
        if self.aux_scales is None:
            return self.aux_hidden_states[a:b].float()
        return decode_fp8(self.aux_hidden_states[a:b], self.aux_scales[a:b])

    def compact(self, a: int, b: int) -> tuple[torch.Tensor, int, int]:
        """(trained positions in [a, b), relative to a; their rows s0:s1 of the [P] tensors)."""
        rel = self.trained[a:b].nonzero().flatten()
        s0 = int(self._slot[a - 1]) + 1 if a > 0 else 0
        return rel, s0, s0 + rel.numel()

    def teacher(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """What the teacher of tokens [a, b) is computed from, by storage mode:

        states, trained: {"last": [n, H]} post-norm states (trained: zeros where untrained);
        topk: {"topk_ids": [n, k] int64 target ids (-1 where untrained),
               "topk_logprobs": [n, k] float32 (-inf where untrained)};
        topk over the draft vocabulary: the same with "draft_topk_ids" (draft ids) in place of
               "topk_ids".
        Training never reads a position outside `trained`.
        """
        if self.storage.final == "states":
            return {"last": self.last_hidden_states[a:b]}
        rel, s0, s1 = self.compact(a, b)
        if self.storage.final == "trained":
            last = self.last_hidden_states
            out = torch.zeros(b - a, last.shape[1], dtype=last.dtype)
            out[rel] = last[s0:s1]
            return {"last": out}
        k = self.teacher_topk_ids.shape[1]
        ids = torch.full((b - a, k), -1, dtype=torch.int64)
        logp = torch.full((b - a, k), float("-inf"))
        ids[rel] = self.teacher_topk_ids[s0:s1].long()
        logp[rel] = self.teacher_topk_logprobs[s0:s1].float()
        return {
            "draft_topk_ids" if self.storage.draft_topk else "topk_ids": ids,
            "topk_logprobs": logp,
        }
