"""sandbox.distributed: context-parallel attention over torch.distributed (docs/DISTRIBUTED.md).

    import sandbox.distributed as sd
    q_loc, k_loc, v_loc = (sd.shard(x, rank, world, causal=True) for x in (q, k, v))
    out_loc = sd.ring_attention(q_loc, k_loc, v_loc, causal=True)       # autograd works
    out_loc = sd.ulysses_attention(q_loc, k_loc, v_loc, causal=True)    # heads % world == 0
    out = sd.unshard(gathered_out_shards, causal=True)                  # the full sequence back

Every rank holds a shard of the sequence, (B, H, N_local, d); the sequence is N = world * N_local.

- Ring attention (Liu et al. 2023): the local query shard stays put and the K/V shards travel
  around the ring (send to rank + 1, receive from rank - 1, `batch_isend_irecv`); the transfer of
  the next K/V shard is issued before the attention of the one in hand. Each block's (out, lse) is
  merged into float32 accumulators by log-sum-exp. The backward is a second ring: each rank computes
  dq (kept) and dk, dv of the K/V shard in hand from the *global* out and lse, and the dk/dv
  accumulators travel with the K/V shards so that they arrive home after `world` hops.
- Causal ring attention uses the zig-zag layout by default: the sequence is cut into 2W chunks and
  rank r holds chunks r and 2W-1-r, so every rank does the same work. With equal chunks, query
  chunk a against key chunk b is fully visible if a > b, plain causal if a == b, skipped if a < b.
- Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all turns sequence sharding into head
  sharding (H / W heads of all N tokens per rank), ordinary attention runs, and all-to-all turns
  the output back; the backward does the same in reverse.

Streams: on CUDA, NCCL runs P2P and all-to-all on its own internal stream, ordered after the
caller's current stream when issued; `Work.wait()` makes the caller's current stream wait for it
(no host synchronisation). Every kernel goes to the caller's current stream (sandbox.api), and
nothing here synchronises the device. On CPU (gloo) the transfers run on gloo's threads and
`wait()` blocks until the buffer is there.

Known gap: dropout. The RNG contract keys each element by its global (row, column); the kernels
take no row / column offsets, so a block would replay the wrong mask. dropout_p > 0 is refused.

PyTorch is an optional extra; this module imports it at the top and `import sandbox` does not
import this module.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api
from .philox import OptionTypeError, as_real
from .problem import make_problem
from .registry import BoundVariant, get_variant

__all__ = ["ring_attention", "ulysses_attention", "shard", "unshard", "chunk_ids", "merge_partials",
           "step_blocks", "classify", "Block", "LAYOUTS"]

LAYOUTS = ("zigzag", "contiguous")
FULL, DIAGONAL, SKIP = "full", "causal", "skip"
_KV_TAG, _DKV_TAG = 0, 1        # gloo matches P2P messages by tag; NCCL orders them by issue


# ---- sequence layouts

def _layout(layout, causal) -> str:
    """The layout name; None means zig-zag for causal attention, contiguous otherwise."""
    if layout is None:
        return "zigzag" if causal else "contiguous"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (or None), got {layout!r}")
    return layout


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices a rank holds, in local order: contiguous cuts the sequence into W
    chunks and rank r holds chunk r; zig-zag cuts it into 2W and rank r holds r and 2W-1-r."""
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank)
    if layout == "contiguous":
        return (rank,)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _n_chunks(world: int, layout: str) -> int:
    return 2 * world if layout == "zigzag" else world


def shard(x, rank: int, world: int, causal: bool = False, layout=None, dim: int = 2):
    """The rank's shard of a full tensor along the sequence dim (`dim`, 2 in (B, H, N, d)): its
    chunks (see chunk_ids) concatenated in local order. layout=None: zig-zag if causal, else
    contiguous, the same default as ring_attention and ulysses_attention."""
    layout = _layout(layout, causal)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    n, parts = x.shape[dim], _n_chunks(world, layout)
    if n % parts:
        raise ValueError(f"sequence length {n} is not divisible by {parts}, the number of {layout} chunks "
                         f"for world size {world}")
    chunks = torch.chunk(x, parts, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, layout)], dim=dim)


def unshard(shards, causal: bool = False, layout=None, dim: int = 2):
    """The full tensor from every rank's shard (a sequence, index = rank): the inverse of shard."""
    layout = _layout(layout, causal)
    world = len(shards)
    pieces = {}
    for rank, part in enumerate(shards):
        ids = chunk_ids(rank, world, layout)
        if part.shape[dim] % len(ids):
            raise ValueError(f"shard of rank {rank} has length {part.shape[dim]}, not divisible by {len(ids)}")
        pieces.update(zip(ids, torch.chunk(part, len(ids), dim=dim)))
    return torch.cat([pieces[c] for c in range(_n_chunks(world, layout))], dim=dim)


# ---- which blocks of a ring step to compute

def classify(a: int, b: int) -> str:
    """Causal visibility of query chunk a against key chunk b (equal chunk sizes): every key of b
    precedes every query of a if a > b (FULL), the diagonal block is plain causal if a == b
    (DIAGONAL), and no key is visible if a < b (SKIP)."""
    return FULL if a > b else DIAGONAL if a == b else SKIP


@dataclass(frozen=True)
class Block:
    """One kernel call of a ring step: local query chunks [rows[0], rows[1]) against the K/V shard's
    local chunks [cols[0], cols[1]), causal (the diagonal) or fully visible."""

    rows: tuple
    cols: tuple
    causal: bool

    def row_slice(self, chunk: int) -> slice:
        return slice(self.rows[0] * chunk, self.rows[1] * chunk)

    def col_slice(self, chunk: int) -> slice:
        return slice(self.cols[0] * chunk, self.cols[1] * chunk)


@functools.lru_cache(maxsize=None)
def step_blocks(q_chunks: tuple, kv_chunks: tuple, causal: bool) -> tuple[Block, ...]:
    """The kernel calls for local query chunks `q_chunks` against a K/V shard holding `kv_chunks`
    (global chunk ids), as few as the visibility pattern allows:

    - not causal: one call, everything visible;
    - the pattern of causal attention on the concatenated shards (FULL below, DIAGONAL on, SKIP
      above the diagonal: a rank's own zig-zag shard, or any contiguous diagonal): one causal call;
    - every visible pair FULL, forming one rectangle of chunk ranges: one non-causal call (zig-zag's
      other steps: all queries against the first K/V chunk, or the second query chunk against all);
    - otherwise one call per visible (query chunk, key chunk) pair.
    """
    nq, nk = len(q_chunks), len(kv_chunks)
    if not causal:
        return (Block((0, nq), (0, nk), False),)
    kinds = [[classify(a, b) for b in kv_chunks] for a in q_chunks]
    diagonal = [[classify(i, j) for j in range(nk)] for i in range(nq)]
    if nq == nk and kinds == diagonal:
        return (Block((0, nq), (0, nk), True),)
    visible = [(i, j) for i in range(nq) for j in range(nk) if kinds[i][j] != SKIP]
    if not visible:
        return ()
    rows = sorted({i for i, _ in visible})
    cols = sorted({j for _, j in visible})
    rectangle = (len(visible) == len(rows) * len(cols) and rows == list(range(rows[0], rows[-1] + 1))
                 and cols == list(range(cols[0], cols[-1] + 1)))
    if rectangle and all(kinds[i][j] == FULL for i, j in visible):
        return (Block((rows[0], rows[-1] + 1), (cols[0], cols[-1] + 1), False),)
    return tuple(Block((i, i + 1), (j, j + 1), kinds[i][j] == DIAGONAL) for i, j in visible)


# ---- log-sum-exp merge of partial results

def _merge_(out_acc, lse_acc, out_part, lse_part) -> None:
    """Merge one partial (out, lse) over some keys into the accumulators (float32 in the ring), in place:
    lse = logaddexp(lse_acc, lse_part), out = exp(lse_acc - lse) out_acc + exp(lse_part - lse) out_part.
    A row that has seen no key yet has lse -inf and weight 0 (never exp(-inf - -inf) = NaN)."""
    lse_part = lse_part.to(lse_acc.dtype)
    lse_new = torch.logaddexp(lse_acc, lse_part)
    ref = torch.where(torch.isfinite(lse_new), lse_new, torch.zeros_like(lse_new))
    w_acc = torch.exp(lse_acc - ref).unsqueeze(-1)
    w_part = torch.exp(lse_part - ref).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(w_part * out_part.to(out_acc.dtype))
    lse_acc.copy_(lse_new)


def merge_partials(outs, lses):
    """(out, lse) of attention over the union of disjoint key sets, from each set's (out_i, lse_i):
    out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i, in float32 (float64 stays)."""
    dtype = torch.promote_types(lses[0].dtype, torch.float32)
    out = torch.zeros(outs[0].shape, dtype=dtype, device=outs[0].device)
    lse = torch.full(lses[0].shape, -math.inf, dtype=dtype, device=lses[0].device)
    for o, s in zip(outs, lses):
        _merge_(out, lse, o.to(dtype), s.to(dtype))
    return out, lse


# ---- arguments, checked before any communication

@dataclass(frozen=True)
class _Config:
    """A validated call: the process group and this rank's place in it, the bound variant and the
    options every block call repeats."""

    group: object
    world: int
    rank: int
    bound: BoundVariant
    causal: bool
    scale: float
    layout: str


def _check_tensors(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise OptionTypeError(f"{name} must be a torch.Tensor (a local shard (B, H, N_local, d)), "
                                  f"got {type(x).__name__}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def _check_dropout(dropout_p) -> None:
    p = as_real(dropout_p, "dropout_p")
    if p != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r}: dropout is not supported by sandbox.distributed (only 0): "
                         "the RNG contract keys the mask by global row and column indices, which the kernels "
                         "do not take, so a block would replay the wrong mask (docs/DISTRIBUTED.md)")


def _group_info(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                           "on every rank before ring_attention / ulysses_attention")
    return dist.get_world_size(group), dist.get_rank(group)


def _configure(q, k, v, group, causal, scale, dropout_p, variant, params, layout, method) -> _Config:
    """Validate a call on this rank's shards (types, shapes, options, the variant's capabilities,
    divisibility by the world size) and bind the variant; raises before any communication."""
    _check_tensors(q, k, v)
    problem = make_problem(q, k, v, causal, scale)       # shapes, dtype, causal / scale types
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k/v shards must have the same sequence length (N_local); got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    _check_dropout(dropout_p)
    layout = _layout(layout, problem.causal)
    # variant=None: api.default_variant, as the one-GPU entry points (fa3 for fp16 / bf16 on sm_90, run on two H100s
    # in session 12: tests/test_distributed_gpu.py), else the dtype's DEFAULT_VARIANTS entry
    bound = get_variant(api.default_variant(q, params) if variant is None else variant, **params)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    bound.check(problem, "both" if needs_grad else "forward")   # dtype, head dim, causal, GQA, backward
    world, rank = _group_info(group)
    n_local = q.shape[2]
    if layout == "zigzag" and n_local % 2:
        raise ValueError(f"layout='zigzag' needs the sequence length N = world * N_local = {world * n_local} "
                         f"divisible by 2 * world = {2 * world} (each rank holds two equal chunks); got "
                         f"N_local = {n_local}")
    if method == "ulysses":
        for name, heads in (("query heads (q.shape[1])", q.shape[1]), ("K/V heads (k.shape[1])", k.shape[1])):
            if heads % world:
                raise ValueError(f"ulysses_attention needs the {name} = {heads} divisible by the world size "
                                 f"{world}: each rank computes heads / world of them")
    return _Config(group, world, rank, bound, problem.causal, problem.scale, layout)


# ---- ring communication

class _Pending:
    """A started transfer: `wait()` returns the received buffer once it may be used (on CUDA, the
    caller's current stream is made to wait for it; on CPU, the host waits)."""

    def __init__(self, works, received, sent):
        self.works, self.received, self.sent = works, received, sent   # `sent` alive until done

    def wait(self):
        for w in self.works:
            w.wait()
        self.sent = None
        return self.received


class _Ring:
    """Neighbour exchange on a process group: send to group rank + 1, receive from rank - 1."""

    def __init__(self, cfg: _Config):
        self.world, self.rank, self.group = cfg.world, cfg.rank, cfg.group
        self.send_to = self._global((cfg.rank + 1) % cfg.world)
        self.recv_from = self._global((cfg.rank - 1) % cfg.world)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def shift(self, tensor, tag: int) -> _Pending:
        """Start sending `tensor` (contiguous) to the next rank and receiving the previous rank's."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.send_to, self.group, tag),
               dist.P2POp(dist.irecv, received, self.recv_from, self.group, tag)]
        return _Pending(dist.batch_isend_irecv(ops), received, tensor)


# ---- ring attention

def _ring_forward(q, k, v, cfg: _Config, ring):
    """This rank's (out, lse) of attention over the whole sequence: K/V shards go once around the
    ring, each step's blocks merged by log-sum-exp into float32 accumulators."""
    mine = chunk_ids(ring.rank, ring.world, cfg.layout)
    chunk = q.shape[2] // len(mine)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))                 # one buffer, one message per hop
    for step in range(ring.world):
        pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.world else None     # before the compute
        theirs = chunk_ids((ring.rank - step) % ring.world, ring.world, cfg.layout)
        for blk in step_blocks(mine, theirs, cfg.causal):
            rows, cols = blk.row_slice(chunk), blk.col_slice(chunk)
            res = api.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], variant=cfg.bound,
                              causal=blk.causal, scale=cfg.scale)
            _merge_(out[:, :, rows], lse[:, :, rows], res.out, res.lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, cfg: _Config, ring):
    """(dq, dk, dv) of this rank's shards. Each block's gradients come from the explicit backward
    with the global out and lse, which makes them exact pieces of the global gradient
    (P = exp(scale S - lse), D = rowsum(dO * O)); dq stays, the float32 dk/dv accumulator of each
    K/V shard travels with it and is home after `world` hops."""
    mine = chunk_ids(ring.rank, ring.world, cfg.layout)
    chunk = q.shape[2] // len(mine)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    dkv_pending = None              # the accumulator of the K/V shard in hand, on its way here
    for step in range(ring.world):
        kv_pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.world else None
        theirs = chunk_ids((ring.rank - step) % ring.world, ring.world, cfg.layout)
        grads = [(blk, _block_backward(blk, chunk, dout, q, kv, out, lse, cfg))
                 for blk in step_blocks(mine, theirs, cfg.causal)]
        dkv = dkv_pending.wait() if dkv_pending is not None else torch.zeros(kv.shape, dtype=torch.float32,
                                                                              device=kv.device)
        for blk, (dq_b, dk_b, dv_b) in grads:
            rows, cols = blk.row_slice(chunk), blk.col_slice(chunk)
            dq[:, :, rows].add_(dq_b)
            dkv[0][:, :, cols].add_(dk_b)
            dkv[1][:, :, cols].add_(dv_b)
        # after `world` shifts it is back with its owner (one rank: it is home already)
        dkv_pending = ring.shift(dkv, _DKV_TAG) if ring.world > 1 else _Pending([], dkv, None)
        if kv_pending is not None:
            kv = kv_pending.wait()
    dkv = dkv_pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _block_backward(blk: Block, chunk: int, dout, q, kv, out, lse, cfg: _Config):
    rows, cols = blk.row_slice(chunk), blk.col_slice(chunk)
    return api.backward(dout[:, :, rows], q=q[:, :, rows], k=kv[0][:, :, cols], v=kv[1][:, :, cols],
                        out=out[:, :, rows], lse=lse[:, :, rows], causal=blk.causal, scale=cfg.scale,
                        variant=cfg.bound)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _ring_forward(q, k, v, cfg, _Ring(cfg))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.cfg, _Ring(ctx.cfg))
        return dq, dk, dv, None


def ring_attention(q, k, v, group=None, causal=False, scale=None, variant=None, layout=None, dropout_p=0.0,
                   **params):
    """Ring attention over `group` (default: the world): q (B, Hq, N_local, d), k and v
    (B, Hkv, N_local, d) are this rank's shards in `layout` (None: zig-zag if causal, else
    contiguous; build them with `shard`); returns this rank's output shard, differentiable in
    q, k, v. `variant` and `**params` pick the kernel as in sandbox.attention (None: by dtype).
    Every argument error is raised before any communication."""
    cfg = _configure(q, k, v, group, causal, scale, dropout_p, variant, params, layout, "ring")
    return _RingAttention.apply(q, k, v, cfg)


# ---- Ulysses (all-to-all)

def _all_to_all(send, cfg: _Config):
    """all_to_all over the first dim of `send` (W, ...): piece g goes to rank g; piece r of the
    result came from rank r."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=cfg.group)
    return received


def _seq_to_heads(x, cfg: _Config):
    """(B, H, N_local, d) sequence shard -> (B, H/W, N, d): this rank's heads of the whole sequence,
    in sequence order (the layout undone)."""
    B, H, n, d = x.shape
    send = x.reshape(B, cfg.world, H // cfg.world, n, d).transpose(0, 1).contiguous()
    received = _all_to_all(send, cfg)
    return unshard(list(received.unbind(0)), layout=cfg.layout, dim=2).contiguous()


def _heads_to_seq(y, cfg: _Config):
    """(B, H/W, N, d) head shard -> (B, H, N_local, d): the inverse of _seq_to_heads."""
    send = torch.stack([shard(y, r, cfg.world, layout=cfg.layout) for r in range(cfg.world)])
    received = _all_to_all(send, cfg)           # piece g: head group g of this rank's tokens
    W, B, h, n, d = received.shape
    return received.transpose(0, 1).reshape(B, W * h, n, d)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        qh, kh, vh = (_seq_to_heads(x, cfg) for x in (q, k, v))
        res = api.forward(qh, kh, vh, variant=cfg.bound, causal=cfg.causal, scale=cfg.scale)
        ctx.save_for_backward(qh, kh, vh, res.out, res.lse)
        ctx.cfg = cfg
        return _heads_to_seq(res.out, cfg)

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        grads = api.backward(_seq_to_heads(dout, cfg), q=qh, k=kh, v=vh, out=out, lse=lse, causal=cfg.causal,
                             scale=cfg.scale, variant=cfg.bound)
        return (*(_heads_to_seq(g, cfg) for g in grads), None)


def ulysses_attention(q, k, v, group=None, causal=False, scale=None, variant=None, layout=None, dropout_p=0.0,
                      **params):
    """DeepSpeed-Ulysses attention over `group`: the same arguments and shards as ring_attention;
    the query heads and the K/V heads must be divisible by the world size. Returns this rank's
    output shard, differentiable in q, k, v. Errors are raised before any communication."""
    cfg = _configure(q, k, v, group, causal, scale, dropout_p, variant, params, layout, "ulysses")
    return _UlyssesAttention.apply(q, k, v, cfg)
