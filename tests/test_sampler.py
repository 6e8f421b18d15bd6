"""The batched Sampler against plain per-row numpy references, on random logits."""

import numpy as np
import pytest
import torch

from tallow.engine.request import Sequence
from tallow.engine.sampler import Sampler, apply_top_p, sampling_logits
from tallow.engine.sampling import SamplingParams

EOS = 2


def make_seq(params: SamplingParams, prompt=(5, 9, 9, 1), output=()) -> Sequence:
    seq = Sequence(list(prompt), params, eos_token_ids={EOS})
    for t in output:
        seq.append_token(t)
    return seq


def step_logits(vocab: int, step: int, key: int) -> torch.Tensor:
    """Logits that depend only on (step, key): the same row in any batch."""
    rng = np.random.default_rng(1000 * step + key)
    return torch.from_numpy(rng.standard_normal(vocab).astype(np.float32))


# ---- plain references ----------------------------------------------------------------------
def ref_processed(row: np.ndarray, seq: Sequence) -> np.ndarray:
    """logit_bias, min_tokens, repetition, frequency, presence, as vLLM, on one row."""
    p = seq.params
    x = row.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if seq.num_output_tokens < p.min_tokens:
        x[list(seq.eos_token_ids | set(p.stop_token_ids))] = -np.inf
    counts = np.bincount(np.array(seq.output_ids, dtype=np.int64), minlength=len(x))
    seen = counts > 0
    seen[seq.prompt_ids] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def ref_kept(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The tokens a sampled row may draw: temperature, top_k, top_p, min_p, one after another."""
    x = row.astype(np.float64) / p.temperature
    keep = np.isfinite(x)
    if p.top_k > 0:
        keep &= x >= np.sort(x)[-min(p.top_k, len(x))]
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
        nucleus = np.zeros_like(keep)
        nucleus[order[:n_keep]] = True
        keep &= nucleus
    if p.min_p > 0.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        keep &= probs >= p.min_p * probs.max()
    return keep


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- greedy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
                                    SamplingParams(temperature=0.7, top_k=1, top_p=0.9)])
def test_greedy_and_top_k_1_are_argmax(params):
    logits = torch.randn(16, 1000)
    original = logits.clone()
    out = Sampler(1000, "cpu")(logits, [make_seq(params) for _ in range(16)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_ids is None
    assert torch.equal(logits, original)


def test_padded_vocab_is_never_sampled():
    logits = torch.randn(4, 106)
    logits[:, 100:] = 50.0
    seqs = [make_seq(SamplingParams(temperature=t)) for t in (0.0, 0.0, 1.0, 2.0)]
    out = Sampler(100, "cpu")(logits, seqs)
    assert (out.token_ids < 100).all()
    assert torch.equal(out.token_ids[:2], logits[:2, :100].argmax(dim=-1))


# ---- truncation -----------------------------------------------------------------------------
TOP_K_BATCH = [SamplingParams(top_k=5), SamplingParams(temperature=0.5, top_k=40),
               SamplingParams(), SamplingParams(top_k=2000), SamplingParams(top_k=3, min_p=0.5)]
TOP_P_BATCH = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.6, top_p=0.5),
               SamplingParams(top_k=50, top_p=0.8), SamplingParams(min_p=0.1),
               SamplingParams(temperature=1.5, top_p=0.95, min_p=0.05), SamplingParams(top_k=7),
               SamplingParams(temperature=1.3)]


@pytest.mark.parametrize("batch", [TOP_K_BATCH, TOP_P_BATCH], ids=["top_k", "top_p"])
def test_truncation_keeps_the_reference_set(batch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(batch), 1000, generator=gen) * 2
    masked = sampling_logits(logits, batch).numpy()
    for row, p, got in zip(logits.numpy(), batch, masked):
        keep = ref_kept(row, p)
        np.testing.assert_array_equal(np.isfinite(got), keep)
        ref = softmax(np.where(keep, row.astype(np.float64) / p.temperature, -np.inf))
        np.testing.assert_allclose(softmax(got.astype(np.float64)), ref, atol=1e-6)


@pytest.mark.parametrize("scale", [8.0, 0.3], ids=["peaked", "flat"])
def test_top_p_from_the_head_or_a_full_sort(scale):
    """Peaked rows: every nucleus fits in a head of 64, read off topk; flat rows: it does not,
    and the full sort takes over. Both keep the reference set."""
    top_p = [0.5, 0.9, 1.0, 0.3, 0.95, 0.99]
    logits = torch.randn(len(top_p), 2000, generator=torch.Generator().manual_seed(2)) * scale
    keeps = [ref_kept(row, SamplingParams(top_p=p)) for row, p in zip(logits.numpy(), top_p)]
    fits = [k.sum() <= 64 for k, p in zip(keeps, top_p) if p < 1.0]
    assert all(fits) if scale > 1 else not any(fits)
    for head in (64, None):
        got = apply_top_p(logits, torch.tensor(top_p), head=head)
        for g, keep in zip(got.numpy(), keeps):
            np.testing.assert_array_equal(np.isfinite(g), keep)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_p=0.7),
                                    SamplingParams(temperature=1.2, top_k=4, min_p=0.2)])
def test_sampled_frequencies_match_the_reference(params):
    """The exponential race draws from softmax of the kept logits."""
    n, row = 10000, np.array([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.2], dtype=np.float32)
    out = Sampler(len(row), "cpu")(torch.from_numpy(row).repeat(n, 1), [make_seq(params) for _ in range(n)])
    keep = ref_kept(row, params)
    expected = softmax(np.where(keep, row.astype(np.float64) / params.temperature, -np.inf))
    freq = np.bincount(out.token_ids.numpy(), minlength=len(row)) / n
    assert (freq[~keep] == 0).all()
    assert np.abs(freq - expected).max() < 0.02  # 4 standard deviations at most


# ---- processors ------------------------------------------------------------------------------
PROCESSOR_PARAMS = {
    "repetition>1": SamplingParams(repetition_penalty=1.5),
    "repetition<1": SamplingParams(repetition_penalty=0.7),
    "frequency": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=-0.5),
    "logit_bias": SamplingParams(logit_bias={3: 5.0, 10: -100.0, 63: 0.5}),
    "min_tokens": SamplingParams(min_tokens=4, stop_token_ids=[7]),
    "all": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3,
                          logit_bias={4: 2.0}, min_tokens=2, stop_token_ids=[11]),
}


@pytest.mark.parametrize("params", PROCESSOR_PARAMS.values(), ids=PROCESSOR_PARAMS.keys())
def test_processed_logits_follow_the_formulas(params):
    """Step by step, the incremental counts give what a full rescan of the history gives."""
    vocab, rng = 64, np.random.default_rng(1)
    sampler = Sampler(vocab, "cpu")
    seqs = [make_seq(params, prompt=rng.integers(0, 20, 6).tolist()),
            make_seq(SamplingParams()),
            make_seq(params, prompt=[30, 31], output=[3, 3, 12])]
    for step in range(6):
        logits = torch.randn(len(seqs), vocab)
        for _ in range(2):  # a second look at the same step counts nothing twice
            got = sampler.process_logits(logits, seqs).numpy()
            for row, seq, g in zip(logits.numpy(), seqs, got):
                np.testing.assert_allclose(g, ref_processed(row, seq), rtol=1e-6, atol=1e-6)
        # one token a step, then a burst (the rows of a recomputed sequence)
        for seq in seqs:
            for t in rng.integers(0, 20, 1 if step < 4 else 3).tolist():
                seq.append_token(t)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_forbids_stopping_early(ignore_eos):
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos)
    seq = make_seq(params)
    sampler = Sampler(50, "cpu")
    for step in range(4):
        logits = torch.randn(1, 50)
        logits[0, EOS], logits[0, 7] = 10.0, 9.0
        token = sampler(logits, [seq]).token_ids.item()
        assert (token not in (EOS, 7)) if step < 3 else (token == EOS)
        seq.append_token(token)


# ---- logprobs ------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_processed_logits():
    batch = [SamplingParams(logprobs=3, repetition_penalty=1.3, logit_bias={0: 3.0}),
             SamplingParams(temperature=0.0),
             SamplingParams(logprobs=0, temperature=0.9, top_p=0.5),
             SamplingParams(logprobs=5, temperature=0.0, frequency_penalty=1.0)]
    seqs = [make_seq(p, output=[0, 4, 4]) for p in batch]
    logits = torch.randn(len(seqs), 300)
    refs = [ref_processed(row, seq) for row, seq in zip(logits.numpy(), seqs)]
    out = Sampler(300, "cpu")(logits, seqs)
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
    for i, ref in enumerate(refs):
        ref_lp = torch.log_softmax(torch.from_numpy(ref), dim=-1)
        assert out.logprobs[i].item() == pytest.approx(ref_lp[out.token_ids[i]].item(), abs=1e-5)
        values, ids = ref_lp.topk(5)
        assert torch.equal(out.top_ids[i], ids)
        np.testing.assert_allclose(out.top_logprobs[i].numpy(), values.numpy(), atol=1e-5)
        assert (out.top_logprobs[i].diff() <= 0).all()


def test_logprobs_absent_unless_asked():
    logits = torch.randn(2, 100)
    out = Sampler(100, "cpu")(logits, [make_seq(SamplingParams(logprobs=0)), make_seq(SamplingParams())])
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_ids is None and out.top_logprobs is None


# ---- seeds and batch independence -----------------------------------------------------------
def run_steps(sampler: Sampler, batch: list[tuple[int, Sequence]], steps: int, vocab: int):
    """batch: (key, seq); each row's logits depend on (step, key) only. Returns per-key outputs."""
    results = {key: [] for key, _ in batch}
    for step in range(steps):
        logits = torch.stack([step_logits(vocab, step, key) for key, _ in batch])
        out = sampler(logits, [seq for _, seq in batch])
        for i, (key, seq) in enumerate(batch):
            token = out.token_ids[i].item()
            lp = None if seq.params.logprobs is None else out.logprobs[i].item()
            k = seq.params.logprobs or 0
            top = None if k == 0 else (out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist())
            results[key].append((token, lp, top))
            seq.append_token(token)
    return results


def test_a_seeded_row_ignores_the_rest_of_the_batch():
    vocab, steps = 500, 6
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = run_steps(Sampler(vocab, "cpu"), [(0, make_seq(params))], steps, vocab)[0]
    batches = [
        [(1, make_seq(SamplingParams())), (0, make_seq(params)), (2, make_seq(SamplingParams(seed=7)))],
        [(2, make_seq(SamplingParams(seed=7))), (3, make_seq(SamplingParams(top_p=0.9))),
         (4, make_seq(SamplingParams(temperature=0.0))), (5, make_seq(SamplingParams())), (0, make_seq(params))],
    ]
    for batch in batches:
        assert run_steps(Sampler(vocab, "cpu"), batch, steps, vocab)[0] == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321)
    assert run_steps(Sampler(vocab, "cpu"), [(0, make_seq(other_seed))], steps, vocab)[0] != alone


def test_mixed_batch_gives_each_row_what_it_gives_alone():
    vocab, steps = 400, 5
    rows = {
        10: SamplingParams(temperature=0.0),
        11: SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=2),
        12: SamplingParams(temperature=0.9, top_p=0.9, seed=1, logprobs=0),
        13: SamplingParams(top_k=20, frequency_penalty=1.5, logit_bias={5: 4.0}, seed=2, logprobs=4),
        14: SamplingParams(temperature=1.2, min_p=0.1, presence_penalty=1.0, seed=3, min_tokens=3),
        15: SamplingParams(temperature=0.5, top_k=50, top_p=0.95, seed=4),
    }

    def fresh(key):
        return make_seq(rows[key], prompt=[key, 3, 5, key], output=[5, 5])

    together = run_steps(Sampler(vocab, "cpu"), [(key, fresh(key)) for key in rows], steps, vocab)
    for key in rows:
        alone = run_steps(Sampler(vocab, "cpu"), [(key, fresh(key))], steps, vocab)[key]
        assert [t for t, _, _ in together[key]] == [t for t, _, _ in alone]
        for (_, lp_t, top_t), (_, lp_a, top_a) in zip(together[key], alone):
            assert (lp_t is None) == (lp_a is None) == (rows[key].logprobs is None)
            assert lp_t is None or lp_t == pytest.approx(lp_a, abs=1e-5)
            assert (top_t is None) == (top_a is None) == (not rows[key].logprobs)
            if top_t is not None:
                assert top_t[0] == top_a[0] and top_t[1] == pytest.approx(top_a[1], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_makes_no_host_sync():
    vocab, steps = 4096, 3
    rows = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3),
            SamplingParams(top_p=0.9, top_k=50, seed=5, logit_bias={1: 2.0}),
            SamplingParams(min_p=0.1, frequency_penalty=0.5, presence_penalty=0.2, min_tokens=2),
            SamplingParams(temperature=0.7, seed=6)]
    gpu_seqs = [make_seq(p, output=[4, 4]) for p in rows]
    cpu_seqs = [make_seq(p, output=[4, 4]) for p in rows]
    sampler_gpu, sampler_cpu = Sampler(vocab, torch.device("cuda")), Sampler(vocab, "cpu")
    for step in range(steps):
        logits = torch.stack([step_logits(vocab, step, key) for key in range(len(rows))])
        logits_gpu = logits.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sampler_gpu(logits_gpu, gpu_seqs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref = sampler_cpu(logits, cpu_seqs)
        assert out.token_ids[0].item() == ref.token_ids[0].item()
        np.testing.assert_allclose(out.top_logprobs.cpu().numpy(), ref.top_logprobs.numpy(), atol=1e-4)
        for gpu_seq, cpu_seq, token in zip(gpu_seqs, cpu_seqs, out.token_ids.tolist()):
            gpu_seq.append_token(token)
            cpu_seq.append_token(token)


# ---- non-finite rows ---------------------------------------------------------------------------
def test_a_nan_row_is_flagged_and_the_other_rows_sample_as_without_it():
    """A row of NaN logits in a batch of greedy, top-p and top-k rows: the sampler does not
    raise, flags that row alone, and every other row draws the token it draws without it."""
    vocab = 64
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.9, seed=4, top_p=0.8),
              SamplingParams(temperature=1.0, seed=5, top_k=3, min_p=0.1)]
    rows = torch.stack([step_logits(vocab, 0, k) for k in range(3)])
    clean = Sampler(vocab, torch.device("cpu"))(rows, [make_seq(p) for p in params])
    poisoned = torch.cat([rows, torch.full((1, vocab), float("nan"))])
    seqs = [make_seq(p) for p in params] + [make_seq(SamplingParams(temperature=0.7, seed=9, top_p=0.5))]
    out = Sampler(vocab, torch.device("cpu"))(poisoned, seqs)
    assert out.invalid.tolist() == [False, False, False, True]
    assert out.token_ids[:3].tolist() == clean.token_ids.tolist()
    assert not clean.invalid.any()


def test_a_row_of_only_minus_inf_is_flagged():
    vocab = 16
    rows = torch.stack([step_logits(vocab, 1, 0), torch.full((vocab,), -float("inf"))])
    out = Sampler(vocab, torch.device("cpu"))(rows, [make_seq(SamplingParams(temperature=0)),
                                                    make_seq(SamplingParams(temperature=0.5, top_p=0.3))])
    assert out.invalid.tolist() == [False, True]


@pytest.mark.parametrize("penalty", [1.2e-38, 1e-30, 3.4e38])
def test_extreme_repetition_penalties_keep_logprobs_finite(penalty):
    """x / r overflows for a tiny r: clamped to the largest float, so the softmax and the
    logprobs stay finite and the row is not flagged."""
    vocab = 32
    row = (step_logits(vocab, 2, 0) * 50).unsqueeze(0)
    for temperature in (0, 0.5):
        p = SamplingParams(temperature=temperature, repetition_penalty=penalty, logprobs=3, seed=1)
        out = Sampler(vocab, torch.device("cpu"))(row, [make_seq(p, prompt=tuple(range(vocab)))])
        assert not out.invalid.any()
        assert torch.isfinite(out.logprobs).all()


def test_top_p_of_a_float32_zero_is_refused_and_keeps_one_token_in_the_sampler():
    with pytest.raises(Exception, match="top_p"):
        SamplingParams(top_p=1e-46)
    x = step_logits(32, 3, 0).unsqueeze(0)
    kept = apply_top_p(x, torch.zeros(1))
    assert torch.isfinite(kept).sum() == 1 and kept.argmax() == x.argmax()
