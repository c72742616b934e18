"""One model, four threads: every family's forward gives, under concurrent calls, exactly what the same calls
give one after another (no per-call state on modules). Each family's calls differ from one another (inputs,
sizes, options), so a call that read another call's state would change its result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import deqzoo

THREADS, ROUNDS = 4, 2


def _same_under_threads(jobs) -> None:
    """Run `jobs` (callables returning tensors) serially, then concurrently on 4 threads (twice)."""

    def run(job):
        with torch.no_grad():  # grad mode is per thread: set in each worker, as in the serial calls
            return job()

    serial = [run(job) for job in jobs]
    assert all(torch.equal(a, b) for a, b in zip(serial, [run(job) for job in jobs])), "serial runs differ"
    for _ in range(ROUNDS):
        with ThreadPoolExecutor(THREADS) as pool:
            concurrent = list(pool.map(run, jobs))
        for i, (a, b) in enumerate(zip(serial, concurrent)):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=lambda m, i=i: f"call {i}: {m}")


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism of each call; the concurrency under test is the Python threads'
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_id", ["deqzoo/mdeq-tiny-mnist", "deqzoo/lipschitz-mdeq-tiny-mnist"])
def test_mdeq(model_id):
    model = deqzoo.from_pretrained(model_id).eval()
    g = torch.Generator().manual_seed(0)
    inputs = [torch.rand(1 + i % 3, 1, 28, 28, generator=g) for i in range(8)]
    _same_under_threads([lambda x=x: model(x).logits for x in inputs])


def test_deq_transformer():
    model = deqzoo.from_pretrained("deqzoo/deq-transformer-tiny-pydoc").eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    inputs = [torch.randint(0, vocab, (1 + i % 2, 8 + 3 * i), generator=g) for i in range(8)]

    def call(ids, attentions):
        out = model(ids, output_attentions=attentions, use_cache=False)
        if attentions:  # the recorded attention maps belong to this call only
            return torch.cat([out.logits.flatten(), *(a.flatten() for a in out.attentions)])
        return out.logits

    _same_under_threads([lambda ids=ids, i=i: call(ids, i % 2 == 0) for i, ids in enumerate(inputs)])


def test_ignn():
    model = deqzoo.from_pretrained("deqzoo/ignn-chains").eval()
    g = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(8):  # graphs of different sizes and shapes: different λ_pf, different weight projections
        n = 10 + 7 * i
        x = torch.randn(n, model.config.in_features, generator=g)
        src = torch.arange(n - 1)
        edges = torch.stack([src, src + 1])
        if i % 2:  # add chords: a larger Perron-Frobenius radius
            chords = torch.stack([torch.arange(0, n - 3, 3), torch.arange(3, n, 3)])
            edges = torch.cat([edges, chords], dim=1)
        jobs.append(lambda x=x, e=edges: model(x, e).logits)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _same_under_threads(jobs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "inference changed W"


@pytest.mark.parametrize("model_id", ["deqzoo/deq-flow-cpu-synth", "deqzoo/deq-flow-cpu-raft-baseline"])
def test_deq_flow(model_id):
    model = deqzoo.from_pretrained(model_id).eval()
    g = torch.Generator().manual_seed(0)
    pairs = []
    for i in range(8):
        h, w = 48 + 8 * (i % 3), 64
        a = torch.rand(1, 3, h, w, generator=g)
        b = torch.roll(a, shifts=(i % 3, 1 + i % 4), dims=(2, 3))  # a shift: a non-trivial flow
        pairs.append((a, b))
    _same_under_threads([lambda a=a, b=b: model(a, b).flow for a, b in pairs])


def test_implicit2():
    model = deqzoo.from_pretrained("deqzoo/implicit2-isiren-camera").eval()
    g = torch.Generator().manual_seed(0)
    coords = [torch.rand(64 + 16 * i, model.config.in_features, generator=g) * 2 - 1 for i in range(8)]
    _same_under_threads([lambda c=c: model(c).values for c in coords])


def test_deq_ddim():
    pipe = deqzoo.from_pretrained("deqzoo/ddim-digits-16")
    jobs = [lambda s=s: pipe(batch_size=2, num_inference_steps=5, generator=torch.Generator().manual_seed(s),
                             output_type="pt").images for s in range(8)]
    _same_under_threads(jobs)
