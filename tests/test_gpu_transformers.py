"""GPU suite: real models calling the kernels through transformers (issue 15).

A small Llama-architecture model (GQA) and a GPT-2 model are built from configs in code (random
weights, nothing downloaded), with `attn_implementation` set to the sandbox's registration and to
"sdpa". Logits and gradients are compared against the same model in float32 with SDPA, under the
tolerance rule (within 2x / 3x SDPA's own 16-bit error plus the dtype's rounding), and a 50-step
training run's losses must track SDPA's.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

import sandbox.torch as st  # noqa: E402

TC_VARIANTS = ["fa2-tc", "fa2-tc-deterministic"]
# the Hopper rung too where the GPU is sm_90 (collected on any machine: no CUDA call without a GPU)
ALL_VARIANTS = TC_VARIANTS + (["fa3"] if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                              else [])
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EPS = {"bfloat16": 2**-7, "float16": 2**-10}


def _register(variant):
    return st.register_transformers(f"sandbox-{variant}", variant=variant)


def _config(arch):
    if arch == "llama":
        return transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.GPT2Config(vocab_size=512, n_embd=256, n_layer=2, n_head=4, n_positions=512,
                                   attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


def _model(arch, impl, dtype, seed=0):
    torch.manual_seed(seed)
    cfg = _config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    return model.cuda().to(dtype)


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None
             and ("attn" in n or "self_attn" in n)}
    return out.logits.detach().double(), grads


def _assert_tracks(ours, base, ref, eps, label):
    """(logits, attention gradients) of ours against the float32 reference ref, within 2x (logits) / 3x
    (gradients) of the 16-bit baseline's own error plus the dtype's rounding of ref's scale."""
    assert ref[1].keys() == ours[1].keys() and ref[1]
    pairs = [("logits", ours[0], base[0], ref[0], 2.0)] + [(n, ours[1][n], base[1][n], ref[1][n], 3.0) for n in ref[1]]
    for what, o, b, r, factor in pairs:
        err = (o - r).abs().max().item()
        tol = factor * (b - r).abs().max().item() + eps * r.abs().max().item()
        assert err <= tol, f"{label} {what}: err {err:.3g} > tol {tol:.3g}"


@pytest.mark.parametrize("variant", TC_VARIANTS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_logits_and_gradients_match_sdpa(arch, dtype, variant):
    impl = _register(variant)
    ids = torch.randint(0, 512, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref = _logits_and_grads(_model(arch, "sdpa", torch.float32), ids)
    sdpa = _logits_and_grads(_model(arch, "sdpa", DTYPES[dtype]), ids)
    ours = _logits_and_grads(_model(arch, impl, DTYPES[dtype]), ids)
    _assert_tracks(ours, sdpa, ref, EPS[dtype], f"{arch} {dtype} {variant}")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_losses_track_sdpa(arch):
    """50 AdamW steps in bf16 from the same initial weights and batches: the loss curves agree to
    within 2% of SDPA's (measured step by step; both fall well below the start)."""
    impl = _register("fa2-tc")
    losses = {}
    for name in ("sdpa", impl):
        model = _model(arch, name, torch.bfloat16, seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator("cuda").manual_seed(7)
        seq = []
        for _ in range(50):
            ids = torch.randint(0, 64, (4, 128), device="cuda", generator=gen)   # a small vocabulary: learnable
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seq.append(loss.item())
        losses[name] = seq
    a, b = losses["sdpa"], losses[impl]
    assert b[-1] < 0.8 * b[0], f"training did not progress: {b[0]:.3f} -> {b[-1]:.3f}"
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst < 0.02, f"losses diverge from sdpa's by {worst:.3%} (sdpa {a[-1]:.4f}, sandbox {b[-1]:.4f})"


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_left_padded_batch_matches_sdpa(variant):
    """A left-padded batch (batched inference) with its attention mask: the mask becomes a dense mask modifier.
    Logits at the real tokens and the attention weights' gradients (padded labels ignored) against SDPA in
    float32 with the same mask, within 2x / 3x SDPA's own bf16 error."""
    impl = _register(variant)
    ids = torch.randint(0, 512, (2, 96), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def run(name, dt):
        model = _model("llama", name, dt)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None
                 and "self_attn" in n}
        return out.logits.detach().double()[mask.bool()], grads
    ref, sdpa = run("sdpa", torch.float32), run("sdpa", torch.bfloat16)
    _assert_tracks(run(impl, torch.bfloat16), sdpa, ref, EPS["bfloat16"], f"padded {variant}")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemma2_softcap_and_sliding_window_match_eager(dtype, variant):
    """Gemma 2 passes softcap and sliding_window beside the mask: a small cap that binds (a model that dropped it
    would be far off: checked) and a window shorter than the sequence on every other layer. Logits and the
    attention weights' gradients against eager attention in float32, within 2x / 3x eager's own 16-bit error."""
    cfg = transformers.Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=48,
                                    attn_logit_softcapping=0.05, final_logit_softcapping=None,
                                    query_pre_attn_scalar=64, max_position_embeddings=512)
    impl = _register(variant)

    def model(name, dt, cap=0.05):
        torch.manual_seed(0)
        c = cfg.__class__(**{**cfg.to_dict(), "attn_logit_softcapping": cap})
        return transformers.AutoModelForCausalLM.from_config(c, attn_implementation=name).cuda().to(dt)
    ids = torch.randint(0, 512, (2, 160), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    ref = _logits_and_grads(model("eager", torch.float32), ids)
    uncapped, _ = _logits_and_grads(model("eager", torch.float32, cap=None), ids)
    assert (uncapped - ref[0]).abs().max() > 10 * (ref[0].abs().max() * EPS[dtype])    # the cap binds
    eager = _logits_and_grads(model("eager", DTYPES[dtype]), ids)
    ours = _logits_and_grads(model(impl, DTYPES[dtype]), ids)
    _assert_tracks(ours, eager, ref, EPS[dtype], f"gemma2 {dtype} {variant}")
