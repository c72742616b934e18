"""LoopedLM: stock looped LMs (transformers' HRM-Text, a Huginn-style fixture) through deqzoo's solvers.

References are independent of the adapter: the stock models' own forward and generate(), and for the fixed
point the stock loop run hundreds of steps."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import HrmTextConfig, HrmTextForCausalLM

from deqzoo.core import DEQConvergenceError
from deqzoo.integrations.looped_lm import HrmTextCore, LoopedCore, LoopedLM, UnsupportedLoopedModelError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from huginn_fixture import TinyHuginnConfig, TinyHuginnForCausalLM  # noqa: E402


def hrm(H=2, L=2, layers=1, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = HrmTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, head_dim=8, H_cycles=H, L_cycles=L,
                        max_position_embeddings=128,
                        **kw)  # fmt: skip
    return HrmTextForCausalLM(cfg).to(dtype).eval()


def huginn(steps=4, dtype=torch.float32, seed=0, scale=1.0):
    torch.manual_seed(seed)
    m = TinyHuginnForCausalLM(TinyHuginnConfig(mean_recurrence=steps)).to(dtype).eval()
    if scale != 1.0:  # weights scaled up: the core no longer contracts
        with torch.no_grad():
            for mod in [m.adapter, *m.core_block.modules()]:
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.mul_(scale)
    return m


def ids(batch=2, seq=7, seed=1):
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ the model's own loop


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("H,L,layers", [(2, 2, 1), (3, 2, 2), (4, 1, 1)])
def test_hrm_own_loop_reproduces_stock_logits(dtype, atol, H, L, layers):
    model, x = hrm(H, L, layers, dtype), ids()
    with torch.no_grad():
        ref = model(x).logits
        out = LoopedLM.own_loop(model)(x)
    assert (out.logits - ref).abs().max().item() <= atol
    assert out.nfe.shape == (2, 7) and bool((out.nfe == H).all())  # exactly the model's own steps
    assert out.solver_stats.solver == "fixed_point" and out.solver_stats.nfe == H


def test_hrm_own_loop_with_padding_mask():
    model, x = hrm(3, 2), ids()
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding in the first row
    with torch.no_grad():
        ref = model(x, attention_mask=mask).logits
        out = LoopedLM.own_loop(model)(x, attention_mask=mask).logits
    assert (out - ref)[1].abs().max().item() <= 1e-5 and (out - ref)[0, 3:].abs().max().item() <= 1e-5


def test_hrm_own_loop_with_prefix_lm_token_types():
    """HRM-Text's prefix-LM mask (token_type_ids == 1: a bidirectional block) goes through prepare."""
    model, x = hrm(3, 2), ids()
    types = torch.zeros_like(x)
    types[:, :4] = 1
    with torch.no_grad():
        ref = model(x, token_type_ids=types).logits
        out = LoopedLM.own_loop(model)(x, token_type_ids=types).logits
        causal = model(x).logits
    assert (out - ref).abs().max().item() <= 1e-5
    assert (ref - causal).abs().max().item() > 1e-3  # the mask matters here


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("steps", [1, 4, 7])
def test_huginn_own_loop_reproduces_stock_logits(dtype, atol, steps):
    model, x = huginn(steps, dtype), ids()
    with torch.no_grad():
        ref = model(x).logits
        out = LoopedLM.own_loop(model)(x)
    assert (out.logits - ref).abs().max().item() <= atol
    assert bool((out.nfe == steps).all())


@pytest.mark.parametrize("make", [lambda: hrm(3, 2, 2), lambda: huginn(4)], ids=["hrm_text", "huginn"])
def test_generate_token_for_token(make):
    model, x = make(), ids(seq=5)
    ref = model.generate(x, max_new_tokens=10, do_sample=False, pad_token_id=0)
    own = LoopedLM.own_loop(model, log_stats=True)
    got = own.generate(x, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)
    assert len(own.stats_log) == 10 and own.stats_log[1]["nfe"].shape == (2, 1)  # prefill, then one per token


def test_generate_left_padded_batch():
    model, x = hrm(3, 2), ids(seq=6)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(LoopedLM.own_loop(model).generate(x, **kw), model.generate(x, **kw))


def test_beam_search_matches_stock():
    model, x = hrm(3, 2), ids(seq=5)
    kw = {"max_new_tokens": 6, "do_sample": False, "num_beams": 3, "pad_token_id": 0}
    assert torch.equal(LoopedLM.own_loop(model).generate(x, **kw), model.generate(x, **kw))


def test_one_step_gradient_and_loss():
    """With labels and autograd: the loss equals the stock model's, and the gradient is the one-step gradient
    (autograd through the last step only, from the detached state before it), written out by hand here."""
    model, x = huginn(3, torch.float64), ids()
    looped = LoopedLM.own_loop(model)
    out = looped(x, labels=x, use_cache=False)
    with torch.no_grad():
        stock = model.loss_function(logits=model(x).logits, labels=x, vocab_size=64)  # the stock loss
    assert abs(out.loss.item() - stock.item()) < 1e-12
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    core = looped.core
    ctx = core.prepare(x, None, None, None, None)
    with torch.no_grad():
        z = core.initial_state(ctx)
        for k in range(core.num_steps - 1):
            z = core.step(z, ctx, None, k)
    ctx = core.prepare(x, None, None, None, None)  # the embedding with its graph
    z = core.step(tuple(t.detach() for t in z), ctx, None, core.num_steps - 1)
    logits = model.lm_head(core.head(z, ctx, None))
    model.loss_function(logits=logits, labels=x, vocab_size=64).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want) and {"adapter.weight", "lm_head.weight", "wte.weight"} <= set(got)
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-12), n


def test_save_pretrained_saves_the_stock_model(tmp_path):
    model, x = hrm(2, 2), ids()
    LoopedLM.own_loop(model).save_pretrained(tmp_path)
    again = HrmTextForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


@pytest.mark.parametrize("make", [lambda: hrm(3, 2), lambda: huginn(4)], ids=["hrm_text", "huginn"])
def test_cached_decoding_matches_full_recompute(make):
    """Each decode step through the adapter's cache view equals the stock model on the whole sequence."""
    model, x = make(), ids(seq=5)
    own = LoopedLM.own_loop(model)
    with torch.no_grad():
        out = own(x, use_cache=True)
        seq = x
        for _ in range(4):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            out = own(nxt, past_key_values=out.past_key_values, use_cache=True)
            full = model(seq, use_cache=False).logits[:, -1]
            assert (out.logits[:, -1] - full).abs().max().item() <= 1e-5


def test_pipeline_text_generation():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w63")
    model = hrm(3, 2)
    prompt = "w5 w17 w3 w40"
    kw = {"max_new_tokens": 6, "do_sample": False}
    ref = pipeline("text-generation", model=model, tokenizer=tok)(prompt, **kw)[0]["generated_text"]
    got = pipeline("text-generation", model=LoopedLM.own_loop(model), tokenizer=tok)(prompt, **kw)
    assert got[0]["generated_text"] == ref and ref.startswith("w5 w17 w3 w40") and len(ref) > len(prompt)


# ------------------------------------------------------------------------------ solving to the fixed point


def test_fixed_point_is_where_the_long_loop_goes():
    """Anderson's per-token fixed point gives the logits of the stock model looped 400 times (float64), for a
    sequence on which the plain loop contracts (every token's residual ratio <= 0.92 under fixed_point)."""
    x = ids()[1:]
    long = huginn(400, torch.float64)
    with torch.no_grad():
        ref = long(x).logits
        out = LoopedLM.from_model(huginn(4, torch.float64), solver="anderson", max_iter=100, tol=1e-10,
                                  solver_kwargs={"m": 10})(x)  # fmt: skip
    assert bool(out.converged.all()) and float(out.residual.max()) < 1e-10
    assert (out.logits - ref).abs().max().item() < 1e-8
    assert int(out.nfe.max()) < 100 and bool((out.residual_ratio < 1).all())


def test_per_token_nfe_and_halting():
    """Tokens stop on their own: NFE differs between tokens and each one's residual is below tol; a token
    whose plain iteration oscillates (residual ratio 1) is flagged, not truncated."""
    x = ids()
    with torch.no_grad():
        out = LoopedLM.from_model(
            huginn(4), solver="anderson", max_iter=100, tol=1e-4, solver_kwargs={"m": 10}
        )(x)
        plain = LoopedLM.from_model(huginn(4), solver="fixed_point", max_iter=300, tol=1e-4)(x)
    assert bool(out.converged.all()) and float(out.residual.max()) < 1e-4
    assert out.nfe.unique().numel() > 1 and int(out.nfe.max()) < 100
    assert bool((out.residual_ratio < 1).all())
    # plain iteration: row 1 contracts (ratio < 1, converged), the last token of row 0 does not
    assert bool(plain.converged[1].all()) and bool((plain.residual_ratio[1] < 0.95).all())
    assert not bool(plain.converged[0, -1]) and int(plain.nfe[0, -1]) >= 300
    assert float(plain.residual[0, -1]) > 1e-4 and float(plain.residual_ratio[0, -1]) > 0.99


def test_a_sequence_does_not_depend_on_its_batch_mates():
    """Per-token stopping is the engine's per-sample stopping: a sequence solved beside another gets the same
    per-token NFE, flags and logits as solved alone (float64)."""
    x = ids(batch=3)
    looped = LoopedLM.from_model(huginn(4, torch.float64), solver="anderson", max_iter=60, tol=1e-6,
                                 solver_kwargs={"m": 5})  # fmt: skip
    with torch.no_grad():
        together = looped(x)
        for b in range(3):
            alone = looped(x[b : b + 1])
            assert torch.equal(alone.nfe[0], together.nfe[b])
            assert torch.equal(alone.converged[0], together.converged[b])
            assert (alone.logits[0] - together.logits[b]).abs().max().item() < 1e-10


@pytest.mark.parametrize("make", [lambda: huginn(4, scale=20.0), lambda: hrm(2, 2, initializer_range=1.0)],
                         ids=["huginn_x20", "hrm_text_init1"])  # fmt: skip
def test_drifting_core_reported_per_token(make):
    model, x = make(), ids()
    deq = LoopedLM.from_model(model, solver="fixed_point", max_iter=30, tol=1e-4)
    with torch.no_grad():
        out = deq(x)
    assert not bool(out.converged.any())
    assert bool((out.residual > 1e-4).all()) and bool((out.nfe >= 30).all())  # every step spent, flagged
    assert float(out.residual_ratio.median()) > 0.95  # no contraction
    with pytest.warns(UserWarning, match="14 of 14 tokens did not converge"), torch.no_grad():
        LoopedLM.from_model(model, solver="fixed_point", max_iter=30, tol=1e-4, on_nonconvergence="warn")(x)
    with pytest.raises(DEQConvergenceError) as err, torch.no_grad():
        LoopedLM.from_model(model, solver="fixed_point", max_iter=30, tol=1e-4, on_nonconvergence="raise")(x)
    assert err.value.stats.converged.numel() == 14


def test_warm_start_in_generation():
    """Warm start: each decode step's solve starts from the previous token's fixed point (HRM-Text: its z_L;
    z_H carries the token), the first call of a cache starts cold, and the tokens still converge."""
    from huginn_fixture import TinyHuginnCore

    from deqzoo.integrations.looped_lm import HrmTextCore

    seen = []

    class Spy:  # records what each warm start was given, then defers to the real core
        def __init__(self, core):
            self.core = core

        def __getattr__(self, name):
            return getattr(self.core, name)

        def warm_state(self, ctx, previous):
            seen.append(previous)
            return self.core.warm_state(ctx, previous)

    for model, core in [
        (huginn(4, torch.float64), TinyHuginnCore),
        (hrm(2, 2, dtype=torch.float64), HrmTextCore),
    ]:
        seen.clear()
        looped = LoopedLM(model, Spy(core(model)), solver="anderson", max_iter=80, tol=1e-3, warm_start=True,
                          solver_kwargs={"m": 10})  # fmt: skip
        with torch.no_grad():
            out = looped(ids(seq=5), use_cache=True)
            assert out.solver_stats.extra["warm_start"] is False and not seen  # a new cache: cold
            for _ in range(3):
                prev = out
                out = looped(
                    out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True
                )
                assert out.solver_stats.extra["warm_start"] is True
                for got, want in zip(seen[-1], prev.state):
                    assert torch.equal(got, want[:, -1:])
            if core is TinyHuginnCore:
                assert bool(out.converged.all())
            other = looped(ids(seq=3), use_cache=True)  # another cache: cold again
            assert other.solver_stats.extra["warm_start"] is False


def _dense_jacobian(looped, token, cache, state, b):
    """f's Jacobian for row b of a one-token decode step, built column by column by autograd (reference)."""
    from deqzoo.integrations.looped_lm import _SolveView

    core = looped.core
    ctx = core.prepare(token, None, None, None, cache)
    view = _SolveView(cache, core)
    view.step = core.num_steps - 1
    sizes = [t.shape[-1] for t in state]

    def f(flat):
        parts = flat.split(sizes, -1)
        st = tuple(torch.cat([s[:b], p[None, None], s[b + 1 :]], 0) for s, p in zip(state, parts))
        return torch.cat([t[b, 0] for t in core.step(st, ctx, view, core.num_steps - 1)], -1)

    return torch.autograd.functional.jacobian(f, torch.cat([t[b, 0] for t in state], -1))


@pytest.mark.parametrize("make", [lambda: huginn(4, torch.float64), lambda: hrm(2, 2, dtype=torch.float64)],
                         ids=["huginn", "hrm_text"])  # fmt: skip
def test_jacobian_estimates_per_token(make):
    """jacobian_norm and spectral_radius against the dense Jacobian's 2-norm and largest |eigenvalue|, per
    token of a decode step. The random-init HRM-Text sits at the margin: spectral radius 1."""
    import copy

    model = make()
    looped = LoopedLM.from_model(model, solver="anderson", max_iter=80, tol=1e-10, solver_kwargs={"m": 10})
    with torch.no_grad():
        out = looped(ids(seq=5), use_cache=True)
        token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        before = copy.deepcopy(cache)
        assert bool(out.jacobian_norm.isnan().all())  # not asked for
        looped.jacobian_steps = 150
        step = looped(token, past_key_values=cache, use_cache=True)
    for b in range(2):
        J = _dense_jacobian(looped, token, copy.deepcopy(before), step.state, b)
        norm, rho = torch.linalg.matrix_norm(J, 2).item(), torch.linalg.eigvals(J).abs().max().item()
        if bool(step.converged[b, 0]):  # J at the answer = J at the reported state
            assert abs(step.jacobian_norm[b, 0].item() - norm) < 1e-3 * norm
            assert abs(step.spectral_radius[b, 0].item() - rho) < 2e-2 * rho
            assert rho < 1  # converged, and contracting there
        else:
            assert abs(step.spectral_radius[b, 0].item() - 1) < 0.02 and abs(rho - 1) < 0.02


# ------------------------------------------------------------------------------------ bad input


def test_model_without_recurrent_core_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(
        UnsupportedLoopedModelError, match=r"GPT2LMHeadModel has no recurrent core.*looped_core"
    ):
        LoopedLM.from_model(gpt2)

    class Incomplete:
        num_steps = 2

        def step(self, *a):
            pass

    gpt2.looped_core = lambda: Incomplete()
    with pytest.raises(UnsupportedLoopedModelError, match=r"Incomplete.*'prepare'.*'head'"):
        LoopedLM.from_model(gpt2)


def test_core_writing_outside_its_slots_is_refused():
    from huginn_fixture import TinyHuginnCore

    class Short(TinyHuginnCore):  # claims one cache layer fewer than its step writes
        def step_slots(self, k):
            r = super().step_slots(k)
            return range(r.start, r.stop - 1)

    model = huginn(4)
    looped = LoopedLM.own_loop(model, core=Short(model))
    with pytest.raises(UnsupportedLoopedModelError, match=r"Short.step\(0\) wrote cache layer 2, outside"):
        looped(ids(), use_cache=True)


def test_unsupported_caches_are_refused():
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, StaticCache

    model = hrm(2, 2)
    looped = LoopedLM.own_loop(model)
    static = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(UnsupportedLoopedModelError, match=r"StaticCache.*DynamicCache"):
        looped(ids(), past_key_values=static, use_cache=True)
    sliding = DynamicCache()
    sliding.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    with pytest.raises(UnsupportedLoopedModelError, match=r"DynamicSlidingWindowLayer"):
        looped(ids(), past_key_values=sliding, use_cache=True)
    offloading = DynamicCache()
    offloading.offloading = True  # as DynamicCache(offloading=True) sets it (whose constructor needs a GPU)
    with pytest.raises(UnsupportedLoopedModelError, match="offloading DynamicCache"):
        looped(ids(), past_key_values=offloading, use_cache=True)
    with pytest.raises(UnsupportedLoopedModelError, match="StaticCache"):
        looped.generate(ids(), max_new_tokens=2, cache_implementation="static", pad_token_id=0)


def test_bad_settings_named():
    model = hrm()
    with pytest.raises(ValueError, match="unknown solver 'newton'"):
        LoopedLM.from_model(model, solver="newton")
    with pytest.raises(ValueError, match="max_iter"):
        LoopedLM.from_model(model, max_iter=0)
    with pytest.raises(ValueError, match=r"does not take \['m'\]"):
        LoopedLM.from_model(model, solver="fixed_point", solver_kwargs={"m": 5})
    with pytest.raises(ValueError, match="answer"):
        LoopedLM.from_model(model, answer="first")
    with pytest.raises(ValueError, match="jacobian_steps"):
        LoopedLM.from_model(model, jacobian_steps=-1)
    with pytest.raises(ValueError, match="output_hidden_states"):
        LoopedLM.own_loop(model)(ids(), output_hidden_states=True)


def test_both_cores_follow_the_protocol():
    assert isinstance(HrmTextCore(hrm()), LoopedCore)
    assert isinstance(huginn().looped_core(), LoopedCore)


def test_wrapping_leaves_the_model_alone():
    model, x = hrm(3, 2), ids()
    attn = model.config._attn_implementation
    with torch.no_grad():
        before = model(x).logits
        LoopedLM.from_model(model, solver="anderson", max_iter=5)(x)
        after = model(x).logits
    assert torch.equal(before, after) and model.config._attn_implementation == attn


def test_training_state_round_trip(tmp_path):
    """examples/looped_lm/train.py: the resumable state restores weights, AdamW moments and both RNGs."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "examples" / "looped_lm" / "train.py"
    spec = importlib.util.spec_from_file_location("looped_lm_train", script)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)

    def setup():
        model = hrm(2, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model.train(), opt, torch.Generator().manual_seed(3)

    def one_step(model, opt, gen):
        rows = torch.randint(0, 64, (2, 6), generator=gen)
        opt.zero_grad()
        model(rows, labels=rows, use_cache=False).loss.backward()
        opt.step()

    model, opt, gen = setup()
    one_step(model, opt, gen)
    train.save_state(tmp_path, model, opt, gen, 1, [{"step": 1}], 2.5, 7.0)
    torch.manual_seed(11)
    one_step(model, opt, gen)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, gen2 = setup()
    assert train.load_state(tmp_path, model2, opt2, gen2) == (1, [{"step": 1}], 2.5, 7.0)  # CPU s, wall s
    torch.manual_seed(11)
    one_step(model2, opt2, gen2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
