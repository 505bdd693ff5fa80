"""sandbox.torch: the kernels as a differentiable PyTorch op, for torch.compile and transformers.

    import sandbox.torch as st
    out = st.attention(q, k, v, causal=True)                 # (B, H, N, d) like SDPA; autograd works
    out = st.attention(q, k, v, variant="fa2-tc-deterministic", dropout_p=0.1, enable_gqa=True)
    st.register_transformers("sandbox")                      # attn_implementation="sandbox"

PyTorch is an optional extra: this module is the only one that imports it at the top.

Two routes, one implementation (`_forward`, `_backward` below, which call sandbox.api and so the plan
path of sandbox/fastpath.py):
- eager calls run a `torch.autograd.Function` where a gradient is needed, and the implementation
  directly where none is: the custom op's Python dispatch costs more per call (bench/host_cost.py
  measures each route beside SDPA);
- under torch.compile (`torch.compiler.is_compiling()`), the custom ops `sandbox::attention_fwd`
  and `sandbox::attention_bwd`, registered through `torch.library` with fake (meta) kernels and an
  autograd formula, so that `torch.compile(fullgraph=True)` traces a model without graph breaks.

Dropout: the seed is drawn from torch's CPU generator (`generator=`, or the default one, so that
`torch.manual_seed` makes runs repeatable) as a CPU int64 tensor, saved for the backward, which
replays the same mask (the RNG contract: offset 0, the seed varies per call). A variant without a
backward raises a ValueError naming it when `backward()` reaches it.
"""
import functools
import json
import math
import weakref
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import api, varlen
from .masks import BlockSparse
from .problem import OptionTypeError

Tensor = torch.Tensor
_SEED_HIGH = 2**63 - 1


# ---- the shared implementation: plain-API calls on torch tensors

def _spec(variant: str, params: str):
    return (variant or None), (json.loads(params) if params else {})


def _block_mask(layout: Optional[Tensor], block_q: int, block_k: int):
    if layout is None:
        return None
    return BlockSparse(layout.cpu().numpy().astype(bool), (block_q, block_k))


def _window(has_window: bool, left: Optional[int], right: Optional[int]):
    return (left, right) if has_window else None


def _forward_result(q, k, v, seed, variant, params, causal, scale, dropout_p, has_window, left, right,
                    layout, block_q, block_k, score_mod=None, mask_mod=None) -> api.Result:
    name, prm = _spec(variant, params)
    return api.forward(q, k, v, name, causal, scale, dropout_p, int(seed.item()) if seed is not None else 0, 0,
                       _window(has_window, left, right), _block_mask(layout, block_q, block_k), score_mod, mask_mod,
                       **prm)


def _forward(*args):
    res = _forward_result(*args)
    return res.out, res.lse


def _aligned(dout):
    """dout as the kernels read it (unit stride along d, rows of 16-byte multiples, a 16-byte aligned base):
    autograd may hand an expanded, strided or offset gradient, which is copied."""
    if dout.stride(-1) != 1 or dout.stride(-2) % 8 or dout.data_ptr() % 16:
        return dout.contiguous()
    return dout


def _backward(dout, q, k, v, out, lse, seed, variant, params, causal, scale, dropout_p, has_window, left,
              right, layout, block_q, block_k, score_mod=None, mask_mod=None):
    name, prm = _spec(variant, params)
    rng = (int(seed.item()) if seed is not None else 0, 0)
    dout = _aligned(dout)
    return api.backward(dout, None, name, q=q, k=k, v=v, out=out, lse=lse, rng=rng, causal=causal, scale=scale,
                        dropout_p=dropout_p, window=_window(has_window, left, right),
                        block_mask=_block_mask(layout, block_q, block_k), score_mod=score_mod, mask_mod=mask_mod,
                        **prm)


# ---- the custom ops (torch.compile)

@torch.library.custom_op("sandbox::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, seed: Optional[Tensor], variant: str, params: str,
                  causal: bool, scale: float, dropout_p: float, has_window: bool, left: Optional[int],
                  right: Optional[int], layout: Optional[Tensor], block_q: int,
                  block_k: int) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, seed, variant, params, causal, scale, dropout_p, has_window, left, right, layout,
                    block_q, block_k)


@attention_fwd.register_fake
def _(q, k, v, seed, variant, params, causal, scale, dropout_p, has_window, left, right, layout, block_q,
      block_k):
    B, H, N, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("sandbox::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Optional[Tensor],
                  variant: str, params: str, causal: bool, scale: float, dropout_p: float, has_window: bool,
                  left: Optional[int], right: Optional[int], layout: Optional[Tensor], block_q: int,
                  block_k: int) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_backward(dout, q, k, v, out, lse, seed, variant, params, causal, scale, dropout_p, has_window,
                           left, right, layout, block_q, block_k))


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, seed, *rest):
    c = torch.contiguous_format
    return (torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c),
            torch.empty_like(v, memory_format=c))


def _setup_context(ctx, inputs, output):
    q, k, v, seed, *options = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], seed)
    ctx.options = options
    ctx.mark_non_differentiable(output[1])


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, seed, *ctx.options)
    return dq, dk, dv, None, *([None] * len(ctx.options))


attention_fwd.register_autograd(_op_backward, setup_context=_setup_context)


# ---- the eager route

class _Attention(torch.autograd.Function):
    """The eager route with a gradient: `options` the custom ops' plain values as one tuple (one argument for
    apply to walk instead of eleven: about 2-3 us less per call on the host), `mods` (score_mod, mask_mod), the
    sandbox/modifiers.py objects the custom ops' schema cannot carry, or ()."""

    @staticmethod
    def forward(ctx, q, k, v, seed, options, mods):
        res = _forward_result(q, k, v, seed, *options, *mods)
        out, lse = res.out, res.lse
        ctx.save_for_backward(q, k, v, out, lse, seed)
        ctx.options, ctx.mods = options, mods
        # the fastpath plan the forward ran on (None on the generic path) and its rng: the backward launches from
        # it without resolving the call again (fast_backward)
        ctx.plan, ctx.rng = (res.plan, res.rng) if not res.saved else (None, None)
        ctx.mark_non_differentiable(lse)
        # lse takes no gradient: autograd would otherwise make a zero tensor for it (an allocation and a memset
        # kernel per backward); dout is None where nothing flowed back through out
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable             # the backward is not itself differentiable: a double backward says so
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None, None
        q, k, v, out, lse, seed = ctx.saved_tensors
        grads = _fast_backward(ctx.plan, ctx.rng, dout, q, k, v, out, lse) if ctx.plan is not None else None
        if grads is None:
            grads = _backward(dout, q, k, v, out, lse, seed, *ctx.options, *ctx.mods)
        dq, dk, dv = grads
        return dq, dk, dv, None, None, None


def _fast_backward(plan, rng, dout, q, k, v, out, lse):
    """The backward from the forward's fastpath plan (api.backward's plan route without resolving the call
    again: the plan holds the bound variant and the checked problem), or None where the plan has no backward
    launch for dout's layout (the generic path then runs)."""
    from . import fastpath
    # the plan's launches are made for the forward's q, k, v strides; a saved-tensor hook (save_on_cpu, activation
    # offloading) may give them back in another layout, which the generic path takes
    st = plan.strides
    if (tuple(q.stride()), tuple(k.stride()), tuple(v.stride())) != (st["q"], st["k"], st["v"]):
        return None
    dout = _aligned(dout)
    if dout.dtype != q.dtype or dout.device != q.device:
        return None                   # the generic path says what is wrong
    launch = fastpath.backward_launch(plan, plan.bound, dout, out)
    if launch is None:
        return None
    return fastpath.run_backward(launch, fastpath.problem_for(plan, *rng), dout, q, k, v, out, lse.contiguous())


# ---- the public entry point

def attention(q, k, v, *, variant=None, causal=False, scale=None, dropout_p=0.0, window=None, block_mask=None,
              enable_gqa=False, generator=None, score_mod=None, mask_mod=None, return_lse=False, **params):
    """softmax(mask(scale q k^T)) v with dropout, differentiable, in SDPA's (B, H, N, d) convention.

    variant: a registered name (None: sandbox.api.default_variant, fa3 for fp16 / bf16 on an sm_90 GPU, else
    fa2-tc, fa2 for fp32); `**params` its parameters.
    enable_gqa: as in SDPA, needed when k and v have fewer heads than q.
    generator: a CPU torch.Generator for the dropout seed (default: torch's default CPU generator).
    score_mod / mask_mod: sandbox.modifiers.ScoreMod / MaskMod (issue 18) for variants whose capabilities
    list them (fa2-tc compiles them into its kernels); eager only: the torch.compile custom ops take
    plain values, so under torch.compile they raise a ValueError.
    Returns out (B, Hq, Nq, d) in q's dtype; with return_lse=True (out, lse), lse (B, Hq, Nq) float32 in
    natural log (not differentiable: no gradient flows back through it).
    """
    if not isinstance(return_lse, bool):
        raise OptionTypeError(f"return_lse must be a bool, got {return_lse!r}")
    if not isinstance(enable_gqa, bool):
        raise OptionTypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True for GQA/MQA (as in SDPA)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(variant, str) or variant is None:
        name = variant or ""
    else:
        raise OptionTypeError(f"variant must be a registered variant's name, got {type(variant).__name__}")
    seed = None
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise OptionTypeError(f"dropout_p must be a real number, got {dropout_p!r}")
    if dropout_p > 0:
        if generator is not None and generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator: the dropout seed is drawn on the host "
                             "(a CUDA generator would need a device synchronisation)")
        seed = torch.randint(0, _SEED_HIGH, (), generator=generator, dtype=torch.int64)
    if params.get("dropout_store", "replay") != "replay":
        raise ValueError("sandbox.torch replays dropout masks from the seed: dropout_store='packed' is for the "
                         "plain API (sandbox.forward / sandbox.backward)")
    has_window = window is not None
    left, right = window if has_window else (None, None)
    layout, bq, bk = None, 0, 0
    if block_mask is not None:
        if not isinstance(block_mask, BlockSparse):
            raise OptionTypeError(f"block_mask must be sandbox.masks.BlockSparse, got {type(block_mask).__name__}")
        layout, (bq, bk) = torch.from_numpy(block_mask.layout.astype(bool)), block_mask.block
    options = (name, json.dumps(params, sort_keys=True) if params else "", causal, float(scale), float(dropout_p),
               has_window, left, right, layout, int(bq), int(bk))
    if score_mod is not None or mask_mod is not None:
        if torch.compiler.is_compiling():
            raise ValueError("score_mod / mask_mod run on the eager route only: the torch.compile custom ops "
                             "(sandbox::attention_fwd) take plain values, not modifier objects")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _Attention.apply(q, k, v, seed, options, (score_mod, mask_mod))
        else:
            out, lse = _forward(q, k, v, seed, *options, score_mod, mask_mod)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():
        out, lse = attention_fwd(q, k, v, seed, *options)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _Attention.apply(q, k, v, seed, options, ())
    else:                               # nothing to differentiate: no autograd node to build
        out, lse = _forward(q, k, v, seed, *options)
    return (out, lse) if return_lse else out


# ---- packed variable-length batches (sandbox/varlen.py)

class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, options):
        out, lse = varlen.forward(q, k, v, cu_q, cu_k, **options)
        # offsets given as tensors are saved as tensors: an in-place change before the backward (a loader reusing
        # its buffer) is then autograd's version error, not gradients of other sequences
        cus = tuple(c if torch.is_tensor(c) else None for c in (cu_q, cu_k))
        ctx.save_for_backward(q, k, v, out, lse, *cus)
        ctx.cu, ctx.options = tuple(None if t is not None else c for c, t in zip((cu_q, cu_k), cus)), options
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)       # as _Attention: no zero gradient made for lse
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None, None
        q, k, v, out, lse, *cus = ctx.saved_tensors
        cu = tuple(t if t is not None else c for t, c in zip(cus, ctx.cu))
        dq, dk, dv = varlen.backward(dout.contiguous(), q, k, v, out, lse, *cu, **ctx.options)
        return dq, dk, dv, None, None, None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, variant=None,
                     causal=False, scale=None, window=None, return_lse=False, **params):
    """Attention over packed sequences in flash-attn's varlen layout, differentiable: q (total_q, Hq, d),
    k and v (total_k, Hkv, d), cu_seqlens_q / cu_seqlens_k offsets (S + 1) on the host, or on the GPU (the
    single launch's forward reads them there with no wait when max_seqlen_q is given; the backward of packed
    self-attention, one offsets array for both, runs as one call under a document mask made on the device, no
    wait; other GPU offsets are copied to the host, a wait: sandbox/varlen.py). Returns out like q, or
    with return_lse=True (out, lse), lse (Hq, total_q) float32 (flash-attn's varlen layout; no gradient).
    Every option applies within each sequence (sandbox/varlen.py: one launch for the batch with fa2-tc's
    kernel on CUDA fp16 / bf16, else one per sequence, `single_launch=False` forcing that; the backward one call
    for packed self-attention with one GPU offsets array and as many q as k rows, else per sequence; no dropout)."""
    if isinstance(variant, str) or variant is None:
        options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, variant=variant, causal=causal,
                       scale=scale, window=window, **params)
    else:
        raise OptionTypeError(f"variant must be a registered variant's name, got {type(variant).__name__}")
    if not isinstance(return_lse, bool):
        raise OptionTypeError(f"return_lse must be a bool, got {return_lse!r}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _Varlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    else:
        out, lse = varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    return (out, lse) if return_lse else out


# ---- transformers

def register_transformers(name: str = "sandbox", variant=None, inspect_masks: bool = False, **params) -> str:
    """Register the kernels as a transformers attention implementation: afterwards
    `AutoModel.from_config(cfg, attn_implementation=name)` (or `model.set_attn_implementation(name)`)
    runs attention through `attention(...)`. The mask function registered beside it is SDPA's, which
    gives None when the mask is plain causal; any boolean mask it does build (padding, packed documents, a
    sliding window) becomes the `dense` mask modifier, read by the kernels where it lies on the GPU, with no
    wait for the stream (`_mask_spec`; an additive float mask is checked once per mask tensor, which waits;
    eager calls only). `inspect_masks=True` reads each boolean mask tensor once (one wait per mask) to run a
    plain causal or sliding-window mask as the kernels' causal / window options, which are faster than the
    dense mask (fa3, N = 4k causal: 0.68 against 0.77 ms forward at d = 64, 0.51 against 0.53 at d = 128, 2.85
    against 3.29 ms forward + backward at d = 64; H100, session 13); padding masks are dense either way.
    What a model passes beside the mask is honoured or refused, never dropped: `softcap` (Gemma 2) becomes
    the soft-cap score modifier (eager calls), `sliding_window` (Mistral, Gemma 2) a causal window of that
    many keys when the mask says the same (or when there is no mask and more keys than that), and the
    keyword arguments below that would change the result (`s_aux` sinks, a head mask) are a ValueError.
    """
    from transformers import AttentionInterface

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                          softcap=None, sliding_window=None, **kwargs):
        for k in _CHANGES_RESULT:
            if kwargs.get(k) is not None:
                raise ValueError(f"sandbox attention does not take the model's {k}={kwargs[k]!r}: it would change "
                                 "the result")
        nq, nk = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
        window, extra = None, dict(params)
        if attention_mask is not None:
            causal, window, dense = _mask_spec(attention_mask, nq, nk, sliding_window, inspect_masks)
            if dense is not None:
                _add_modifier(extra, "mask_mod", dense)
        elif sliding_window is not None and nk > int(sliding_window):
            if not causal:
                raise ValueError(f"sliding_window={sliding_window} without a mask on a non-causal call: "
                                 "sandbox attention takes the window from a causal call or from the mask")
            window = (int(sliding_window) - 1, 0)     # transformers skips the mask only where the window binds not
        if softcap:
            _add_modifier(extra, "score_mod", _softcap_mod(float(softcap)))
        out = attention(query, key, value, variant=variant, causal=causal and nq > 1, scale=scaling,
                        dropout_p=float(dropout), window=window, enable_gqa=query.shape[1] != key.shape[1], **extra)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:        # older transformers: masks are built per model as before
        pass
    return name


_CHANGES_RESULT = ("s_aux", "sinks", "attention_bias", "head_mask")


def _add_modifier(extra, name, mod):
    if extra.get(name) is not None:
        raise ValueError(f"the model asks for a {name} ({mod.name}) and register_transformers was given one too")
    extra[name] = mod


@functools.lru_cache(maxsize=16)
def _softcap_mod(cap: float):
    """One ScoreMod per cap value (modifiers are compared by identity: one compiled module and cache entry)."""
    from . import modifiers
    return modifiers.softcap(cap)


class TensorDerived:
    """Values derived from a torch tensor's contents (a host copy, a mask's translation), kept while that
    tensor lives and is unchanged: keyed by its address, in-place version (inference tensors keep none:
    identity alone), shape, dtype, device and the caller's `extra`, and valid only while a weak reference
    still points at the same tensor (a freed tensor's address comes back with other values). At most
    `size` entries, oldest out first."""

    def __init__(self, size: int):
        self.entries: dict = {}
        self.size = size

    def get(self, t, make, extra: tuple = ()):
        version = -1 if t.is_inference() else t._version
        key = (t.data_ptr(), version, tuple(t.shape), str(t.dtype), str(t.device)) + tuple(extra)
        hit = self.entries.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        value = make()
        self.entries.pop(key, None)
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = (weakref.ref(t), value)
        weakref.finalize(t, self.entries.pop, key, None)      # a large value (a device mask copy) goes with t
        return value


def _mask_spec(mask, nq, nk, sliding_window=None, inspect=False):
    """A model's 4-D attention mask -> (causal, window, dense mask modifier or None). The answer is kept per mask
    tensor (a model hands every layer the same one).
    - A boolean mask (what transformers builds for this implementation: sdpa_mask, registered beside it) on the
      GPU becomes modifiers.dense of it as it is, read in place without a gradient (else copied on the caller's
      stream: _translate): nothing waits for the device and nothing crosses to the host, so a new mask per step costs no
      synchronisation (and a causal mask still runs causal work only: the GPU tile classifier finds the empty
      tiles). Telling a causal or sliding-window mask apart from a padding mask would need its values on the
      host: `inspect` (register_transformers' inspect_masks) reads them, as for a float mask below.
    - An additive float mask is checked for a folded bias (a wait on the stream, once per mask), and then a
      plain causal or sliding-window mask becomes the kernels' options (_causal_from_mask), anything else the
      dense mask modifier of its visible pairs. A mask on the CPU takes the same route, with no wait."""
    in_place = not torch.is_grad_enabled() and not mask.is_inference()
    return _MASK_SPECS.get(mask, lambda: _translate(mask, nq, nk, sliding_window, inspect, in_place),
                           (nq, nk, sliding_window, bool(inspect), in_place))


def _translate(mask, nq, nk, sliding_window, inspect=False, in_place=False):
    """_mask_spec's answer. `in_place`: read a boolean GPU mask in place (no gradient is being recorded and the
    tensor has a version counter, so a later in-place change makes a new entry and no backward reads the old
    one); otherwise a device copy on the caller's stream, so that a change between a forward and its backward
    (or to an inference tensor, which keeps no version) cannot reach a modifier already in use."""
    from . import modifiers
    allowed = _visible_pairs(mask, nq, nk)
    full = allowed.expand(*allowed.shape[:2], nq, nk)
    if not (mask.dtype == torch.bool and mask.is_cuda and not inspect):
        try:
            return (*_causal_from_allowed(allowed, nq, nk, sliding_window), None)
        except ValueError:
            pass
    if not full.is_cuda:
        return False, None, modifiers.dense(full.numpy())
    # through a tensor that shares the storage but is no view of `mask` (a view keeps its base's Python object alive,
    # and then the entry here would never go with it, TensorDerived)
    held = full.detach()
    return False, None, modifiers.dense(held, copy=not in_place)


_MASK_SPECS = TensorDerived(8)


def _visible_pairs(mask, nq, nk):
    """bool (B or 1, H or 1, nq or 1, nk) of a transformers 4-D mask: boolean, or additive with 0 where visible and
    a large negative value (at most finfo.min / 2, or -inf) where not. The keys are the first nk columns, as
    transformers' own attention functions take them (a mask may be wider: cache room); the rows must be nq (or
    1, broadcast). A float mask that carries any other value (a bias folded into it) is refused: dropping the
    bias would be a silent wrong result."""
    if mask.dim() != 4:
        raise ValueError(f"sandbox attention takes 4-D attention masks, got shape {tuple(mask.shape)}")
    if mask.shape[-2] not in (nq, 1) or mask.shape[-1] < nk:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not cover {nq} queries x {nk} keys")
    m = mask[..., :nk]
    if m.dtype == torch.bool:
        return m
    masked = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | masked).all()):
        raise ValueError("sandbox attention got an additive attention mask with values other than 0 and a large "
                         "negative number (a bias folded into the mask?): the kernels would drop the bias")
    return ~masked


def _causal_from_mask(mask, nq, nk, sliding_window=None):
    """A 4-D attention mask -> (causal, window) where it is all-visible (False, None), plain causal bottom-right
    aligned (True, None) or causal within the last `sliding_window` keys (True, (sliding_window - 1, 0): key j
    is seen from query i iff i' - sliding_window < j <= i', i' = i + nk - nq, transformers' sliding window);
    ValueError for anything else (which _mask_spec sends to the dense mask modifier)."""
    return _causal_from_allowed(_visible_pairs(mask, nq, nk), nq, nk, sliding_window)


def _causal_from_allowed(allowed, nq, nk, sliding_window=None):
    i = torch.arange(nq, device=allowed.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=allowed.device)[None, :]
    if bool(allowed.all()):
        return False, None
    if bool((allowed == (j <= i)).all()):
        return True, None
    if sliding_window is not None and bool((allowed == ((j <= i) & (j > i - int(sliding_window)))).all()):
        return True, (int(sliding_window) - 1, 0)
    raise ValueError("attention mask neither causal nor all-visible (nor the model's sliding window)")
