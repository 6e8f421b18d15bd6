"""tallow's own CPU kernels (tallow/ops/cpu/kernels.c) against torch references: the block-
quantized linear layers (Q4Linear, Q8Linear) emulated exactly in float64, batch invariance,
the GGUF's Q4_1 weights held bit for bit, the elementwise ops, and the fallback to torch's
kernels when the native ones cannot be built."""

from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from model_utils import activation_levels, block_activations
from torch import nn

from tallow.models import quant
from tallow.models.quant import Int4Linear, Int8Linear, Q4Linear, Q8Linear, quantize_model_
from tallow.ops import cpu_build, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.lib() is None,
                                reason=f"no CPU kernels: {cpu_native.unavailable_reason()}")


@pytest.fixture(autouse=True, params=cpu_native.supported_variants() or ["none"])
def kernels(request, monkeypatch):
    """Every test once per instruction set this CPU runs (an AVX-512 machine checks the AVX2
    build too): the layers built inside take the variant's kernels and weight layout."""
    if cpu_native.lib() is None:
        pytest.skip("no CPU kernels")
    lib = cpu_native.load(request.param)
    monkeypatch.setattr(cpu_native, "_lib", lib)
    monkeypatch.setattr(cpu_native, "_tried", True)
    return lib


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g) * 0.1


# The GGUF type whose kernel each layer runs: its activations are rounded as activation_levels says.
KERNEL_TYPE = {Q4Linear: "Q4_1", Q8Linear: "Q8_0"}


def emulated(layer, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded per block of 32 as the kernel rounds it
    (block_activations at the layer's activation_levels) times the layer's dequantized weights."""
    xq = block_activations(x, activation_levels(KERNEL_TYPE[type(layer)]))
    y = xq @ layer.dequantized_weight().double().T
    return (y if layer.bias is None else y + layer.bias.double()).float()


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
@pytest.mark.parametrize("rows", [1, 3, 4, 37, 300], ids=["gemv", "few", "tiled", "many", "chunks"])
def test_linear_matches_exact_emulation(cls, rows):
    g = torch.Generator().manual_seed(rows)
    w, bias = random_weight(96, 160), torch.randn(96, generator=g)
    layer = cls(w, bias)
    x = torch.randn(rows, 160, generator=g) * torch.logspace(-3, 1, 160)  # blocks of very different scales
    y = layer(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    ref = emulated(layer, x)
    # float32 accumulation: an error of a few ulps of the sum of the products' magnitudes
    scale = (x.abs() @ layer.dequantized_weight().abs().T).max().item()
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_linear_close_to_float_weights(cls):
    w = random_weight(64, 256)
    x = torch.randn(5, 256)
    err = ((cls(w)(x) - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert err < {Q4Linear: 0.1, Q8Linear: 0.01}[cls]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_linear_rows_do_not_depend_on_the_batch(cls, threads):
    """Rows alone, in small and large batches, and across the AVX2 build's row chunks (64 KB of
    int16 activations: 168 rows of 192 here): bit for bit equal."""
    layer = cls(random_weight(128, 192), torch.randn(128))
    x = torch.randn(400, 192)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for rows in (1, 2, 3, 4, 5, 16, 33, 170, 400):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[7:8]), full[7:8])
        assert torch.equal(layer(x[200:203]), full[200:203])
    finally:
        torch.set_num_threads(old)


def test_tiles_of_threads_that_never_start_are_taken_by_the_others(kernels):
    """A layer's tiles are handed out in one range per thread asked for (many rows). Under
    OMP_THREAD_LIMIT=1 with four threads asked for, the one thread that runs claims its own range
    from the front a quarter of what is left at a time (70 tiles: 17 or 18 a range) and takes the
    other three ranges one tile at a time from their ends: every output equals the one-thread
    call's bit for bit (a tile skipped would leave stale memory, one taken twice would not change
    it: the emulation tests cover the arithmetic)."""
    code = f"""
import torch
from tallow.models import gguf_linear as gl
from tallow.models.quant import Q4Linear, Q8Linear
import numpy as np, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from gguf_files import random_blocks
import gguf
g = torch.Generator().manual_seed(0)
w = torch.randn(16 * 70, 192, generator=g)
raw = random_blocks("Q4_K", 16 * 70, 512, np.random.default_rng(0))
layers = [(Q4Linear(w), 192), (Q8Linear(w), 192), (gl.linear_from_raw(raw, gguf.GGMLQuantizationType.Q4_K, 512), 512)]
for layer, k in layers:
    x = torch.randn(33, k, generator=g)
    torch.set_num_threads(4)
    assert torch.get_num_threads() == 4
    many = layer(x)
    torch.set_num_threads(1)
    one = layer(x)
    assert torch.equal(many, one), type(layer).__name__
print("ok", len(layers))
"""
    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "TALLOW_CPU_KERNELS": cpu_native.variant()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["ok", "3"], out.stderr[-3000:]


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_the_two_builds_compute_the_same_floats(cls, kernels):
    """One weight layout and one float arithmetic in both builds (linear_avx2.h reads
    linear_avx512.h's tiles 8 channels to a register): the same packed weights give every row
    the same bits from the AVX2 build as from the AVX-512 one. Runs where the CPU has both."""
    if set(cpu_native.supported_variants()) < {"avx2", "avx512"} or kernels is not cpu_native.load("avx512"):
        pytest.skip("needs a CPU with AVX-512 VNNI (both builds), checked once")
    n, k = 100, 192  # a partial last tile
    layer = cls(random_weight(n, k, seed=5), torch.randn(n))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 1, k)
    for m in (1, 2, 3, 4, 5, 37, 300):
        ys = []
        for variant in ("avx2", "avx512"):
            y = torch.empty(m, n)
            fn = getattr(cpu_native.load(variant), cls._kernel)
            assert fn(x[:m].data_ptr(), m, k, n, *layer._ptrs, y.data_ptr(), 2) == 0
            ys.append(y)
        assert torch.equal(ys[0], ys[1]), m


def test_linear_zero_rows_and_zero_blocks():
    layer = Q4Linear(random_weight(16, 64))
    assert layer(torch.empty(0, 64)).shape == (0, 16)
    x = torch.zeros(2, 64)
    x[1, 40] = 3.0  # one zero block and one block with a single value
    torch.testing.assert_close(layer(x), emulated(layer, x), rtol=1e-5, atol=1e-6)


def test_q4_holds_its_grid_exactly():
    """Weights already on a Q4_1 grid (d * q + m per group, q in 0..15) come back exactly,
    a constant group (d = 0) included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 64), generator=g)
    q[:, 0], q[:, 1] = 0, 15
    d = torch.rand(8, 2, generator=g).half().float()
    m = torch.randn(8, 2, generator=g).half().float()
    w = (q.view(8, 2, 32) * d[..., None] + m[..., None]).view(8, 64)
    w[:, 32:] = 0.5
    assert torch.equal(Q4Linear(w).dequantized_weight(), w)


def test_q4_holds_gguf_q4_1_weights_exactly():
    from test_quant import gguf_rows

    import gguf

    tensors = gguf_rows(["blk.0.attn_q.weight", "blk.7.ffn_down.weight"], rows=64)
    for name, (kind, w) in tensors.items():
        assert kind == gguf.GGMLQuantizationType.Q4_1, name
        assert torch.equal(Q4Linear(w).dequantized_weight(), w), name


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_weight_layout_round_trips_and_pads_the_last_tile(cls, kernels):
    """The tiles hold each weight once (dequantized_weight undoes the layout), a width that is
    not a whole number of tiles is padded with zero channels the kernel computes but never
    stores, and outputs next to the padding are right."""
    tile = cpu_native.tile_channels(kernels)
    assert tile == 16  # both builds' layout
    n = 3 * tile + 4  # a partial last tile
    w = random_weight(n, 96, seed=3)
    layer = cls(w, torch.randn(n))
    assert layer.tile == tile and layer.qweight.shape[0] == -(-n // tile)
    deq = layer.dequantized_weight()
    assert deq.shape == (n, 96)
    assert (deq - w).abs().max() <= (0.5 if cls is Q4Linear else 0.05) * w.abs().max()  # quantization error only
    assert not layer.d[-1, :, n % tile:].any()  # padded channels: zero scales, so zero weights
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    assert y.shape == (6, n)
    scale = (x.abs() @ deq.abs().T).max().item()
    # Q8's int32 block sums can pass float's 24 bits (rounded when scaled); Q4's cannot
    torch.testing.assert_close(y, emulated(layer, x), rtol=0, atol=(1e-6 if cls is Q4Linear else 1e-5) * scale)


@pytest.mark.parametrize("cls,shape", [(Q4Linear, (16, 48)), (Q4Linear, (18, 80)), (Q8Linear, (16, 40))])
def test_rejects_shapes_the_kernel_cannot_take(cls, shape):
    with pytest.raises(ValueError):
        cls(torch.randn(shape))


# ---- elementwise ops ---------------------------------------------------------------------

def test_exp8_accuracy():
    x = torch.linspace(-100, 80, 4096)
    y = torch.empty_like(x)
    cpu_native.lib().tl_exp(x.data_ptr(), y.data_ptr(), x.numel())
    ref = x.double().exp()
    rel = ((y.double() - ref).abs() / ref.clamp_min(1e-300))[x > -87]
    assert rel.max() < 1e-6
    assert (y[x < -87.4] == 0).all()


def test_add_rms_norm_matches_torch():
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    out, new_res = cpu_native.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + res, (64,), w, 1e-5), rtol=1e-6, atol=1e-6)
    alone, same = cpu_native.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(alone, F.rms_norm(x, (64,), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_matches_torch(kernels):
    x = torch.randn(7, 96) * 4
    torch.testing.assert_close(cpu_native.silu_and_mul(x), F.silu(x[:, :48]) * x[:, 48:], rtol=1e-6, atol=1e-6)
    # the AVX-512 build's 16-lane loop (32 of each row's 48 here) gives the AVX2 build's bits
    if set(cpu_native.supported_variants()) >= {"avx2", "avx512"} and kernels is cpu_native.load("avx512"):
        x = torch.randn(40, 2 * 1536) * 8
        outs = []
        for variant in ("avx2", "avx512"):
            out = torch.empty(40, 1536)
            cpu_native.load(variant).tl_silu_and_mul(x.data_ptr(), 40, 1536, out.data_ptr(), 2)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])


def test_gelu_tanh_and_mul_matches_a_float64_reference():
    """Gemma's GeGLU: gelu with the tanh approximation (transformers' gelu_pytorch_tanh), over
    gates from -40 (exp's clamp) to 40, in float64 as the reference."""
    x = torch.cat((torch.randn(6, 192) * 4, torch.linspace(-40, 40, 96).repeat(1, 2)))
    gate, up = x.double()[:, :96], x.double()[:, 96:]
    ref = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
    torch.testing.assert_close(cpu_native.gelu_tanh_and_mul(x).double(), ref, rtol=2e-6, atol=1e-6)


def test_head_rms_norm_normalizes_each_head_of_strided_rows_in_place():
    """Qwen3's / Gemma 3's q/k norm on a view of the qkv rows (rows wider than the heads): each
    head as F.rms_norm would, the columns outside the view untouched."""
    qkv = torch.randn(5, 7 * 32)
    heads, rest = qkv[:, :6 * 32].view(5, 6, 32), qkv[:, 6 * 32:].clone()
    w = torch.randn(32)
    ref = F.rms_norm(heads.double(), (32,), w.double(), 1e-6)
    cpu_native.head_rms_norm_(heads, w, 1e-6)
    torch.testing.assert_close(heads.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 6 * 32:], rest)


@pytest.mark.parametrize("vocab", [1, 7, 8, 13, 49152])
def test_rows_max_is_torch_max(vocab):
    """The greedy pick (tallow.ops.reduce.rows_max): each row's largest value and its first place
    as torch.max(dim=-1) gives them, for rows with ties (across lanes and within one), a NaN
    (torch's value and place: the first NaN's), +inf, all -inf, logits rounded to few values,
    in rows of a wider tensor (a stride) and lengths around the vector width."""
    from tallow.ops.reduce import rows_max

    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(12, vocab + 5, generator=g)
    x = wide[:, :vocab]  # rows at a stride
    x[1] = torch.round(x[1] * 2) / 2  # many ties
    x[2] = float("-inf")
    x[3, -1] = float("nan")
    x[4, vocab // 2] = float("inf")
    x[5] = 7.0  # every place ties
    x[6, vocab // 3] = float("nan")
    x[6, -1] = float("nan")
    x[7, :] = torch.where(torch.rand(vocab, generator=g) < 0.5, float("-inf"), x[7])
    for rows in (x, x[:1], x[3:4]):
        values, places = rows_max(rows)
        ref_values, ref_places = rows.max(dim=-1)
        torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(places, ref_places), (places, ref_places)


@pytest.mark.parametrize("head_dim", [64, 24], ids=["vector", "scalar-tail"])
def test_rotary_matches_the_torch_reference(head_dim):
    from tallow.models.layers import RotaryEmbedding, apply_rope

    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 255])
    qkv = torch.randn(4, 7 * head_dim + 3)  # rows at a stride, as q and k are views of qkv
    x = qkv[:, : 6 * head_dim].view(4, 6, head_dim)
    ref = apply_rope(x.clone(), *rope(positions, torch.float32))
    cpu_native.rotary_(x, positions, rope.cos_sin_cache)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)


# ---- model-level wiring and fallback -----------------------------------------------------------

def test_quantize_model_uses_the_native_layers_and_falls_back(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 16))
    assert quantize_model_(model, "int4") == "int4"
    assert [type(m) for m in model] == [Q4Linear, Q4Linear, quant.Bf16Linear]
    model = nn.Sequential(nn.Linear(64, 32))
    assert quantize_model_(model, "int8") == "int8" and type(model[0]) is Q8Linear
    # Without the kernels (no compiler, an older CPU), the same schemes use torch's kernels.
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", True)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24))
    assert quantize_model_(model, "int4") == "int4"
    assert [type(m) for m in model] == [Int4Linear, Int8Linear]


def test_scales_beyond_float16_are_refused_and_the_model_falls_back():
    """The native layers hold scales in float16 (as GGUF does): a block whose minimum or scale
    is beyond its range is refused with the reason, and quantize_model_ gives that layer to
    torch's kernels instead of failing the load."""
    w = random_weight(32, 64)
    w[3, :32] += 1e5  # one block's minimum beyond float16
    with pytest.raises(ValueError, match="beyond float16"):
        Q4Linear(w)
    with pytest.raises(ValueError, match="beyond float16"):
        Q8Linear(w * 300)  # scales beyond float16 (|w| / 127 > 65504)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 32))
    with torch.no_grad():
        model[1].weight.copy_(w)
    assert quantize_model_(model, "int4") == "int4"
    assert type(model[0]) is Q4Linear and type(model[1]) is Int4Linear


def test_float16_scales_hold_q8_0_weights_exactly():
    """A weight whose blocks are float16 scales times integers (a GGUF Q8_0 tensor) is held
    exactly."""
    g = torch.Generator().manual_seed(5)
    d = (torch.rand(16, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (16, 4, 32), generator=g).float()
    q[:, :, 0] = 127  # each block reaches the grid's end, as Q8_0's quantizer makes it
    w = (d * q).view(16, 128)
    assert torch.equal(Q8Linear(w).dequantized_weight(), w)


def test_kernels_link_torchs_openmp_runtime():
    """The kernels bind the OpenMP runtime torch loaded, not a second one (whose threads would
    compete with torch's pool for the cores): a fresh process maps one libgomp, torch's (the
    kernels name none: tests/test_cpu_native_build.py)."""
    code = ("import torch; from tallow.ops import cpu_native; assert cpu_native.lib() is not None; "
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    mapped = ast.literal_eval(out.strip().splitlines()[-1])
    assert len(mapped) == 1 and mapped[0].startswith(os.path.dirname(torch.__file__)), mapped
    assert ctypes.CDLL(cpu_native.lib()._name).tl_abi_version() == cpu_native.ABI_VERSION
    # what make install prints
    assert cpu_native.report() == f"tallow CPU kernels: {cpu_native.lib()._name} ({cpu_native.kernels_in_use()})"


# ---- the fused decoder layer (tl_llama_layer) against the module path -------------------------

# qwen2: biases on q/k/v; qwen3: q/k norms; gemma3: q/k and sandwich norms, GeGLU, sliding-window
# layers (a window of 6 positions: the steps' sequences pass it) with their own rotary table;
# phi3: a window of 6 on every layer, with the model's one rotary table
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_fused_layers_equal_the_module_path(family, tmp_path, monkeypatch):
    """LlamaModel's one-call-per-layer path gives bit for bit the logits of running its modules
    over the same kernels: prefill chunks with cached prefixes, mixed and decode steps."""
    from model_utils import PagedBatches, tiny_hf_model

    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models import cpu_fused
    from tallow.models.loader import load_model

    tiny_hf_model(family).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu")).model
    assert quantize_model_(model, "int4") == "int4"
    set_attention_backend(model, CpuAttentionBackend())

    def run(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cpu_fused.FusedCpuLayers, "supported", staticmethod(lambda m: fused))
        model.model.__dict__.pop("_fused", None)
        paged = PagedBatches(model.config, num_blocks=48, block_size=4)
        g = torch.Generator().manual_seed(1)
        ids = lambda n: torch.randint(0, 96, (n,), generator=g).tolist()  # noqa: E731
        steps = [[("a", ids(9)), ("b", ids(5))], [("a", ids(1)), ("b", ids(6)), ("c", ids(13))],
                 [("a", ids(1)), ("b", ids(1)), ("c", ids(1))], [("c", ids(1)), ("a", ids(1))]]
        outs = []
        with torch.no_grad():
            for chunks in steps:
                input_ids, positions, meta = paged.step(chunks)
                outs.append(model.compute_logits(model(input_ids, positions, paged.kv_caches, meta)))
        assert (model.model.__dict__["_fused"][1] is not None) == fused
        return outs

    fused, modules = run(True), run(False)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_fused_layers_need_the_native_pieces(tmp_path):
    """torch's layers or the torch attention backend: the module path (Qwen3's q/k norms and
    Gemma 3's options run fused)."""
    from model_utils import tiny_hf_model

    from tallow.attention.cpu_backend import CpuAttentionBackend
    from tallow.engine.runner import set_attention_backend
    from tallow.models.cpu_fused import FusedCpuLayers
    from tallow.models.loader import load_model

    for family, scheme, backend, ok in [("llama", "int4", CpuAttentionBackend, True),
                                        ("qwen3", "int4", CpuAttentionBackend, True),
                                        ("gemma3", "int4", CpuAttentionBackend, True),
                                        ("llama", "int4-torch", CpuAttentionBackend, False),
                                        ("llama", "int4", None, False)]:
        path = tmp_path / f"{family}-{scheme}-{ok}"
        tiny_hf_model(family).save_pretrained(path)
        model = load_model(str(path), dtype=torch.float32, device=torch.device("cpu")).model
        quantize_model_(model, scheme)
        if backend is not None:
            set_attention_backend(model, backend())
        assert FusedCpuLayers.supported(model.model) == ok, (family, scheme, backend)


# ---- AMX tiles ------------------------------------------------------------------------------------

def _amx_on() -> bool:
    return cpu_native.amx_state() == "on"


@pytest.mark.parametrize("cls", [Q4Linear, Q8Linear])
def test_the_amx_kernel_computes_the_floats_of_the_vnni_one(cls, kernels):
    """Where the CPU runs AMX tiles (its probe passed), rows of 5 (Q4) or 12 (Q8) and more go to
    the tile kernel (linear_amx.h): every row's result equals, bit for bit, the one the AVX-512
    VNNI kernel gives with the tiles turned off, so which one runs (the batch decides) never
    moves an output. Blocks of very different scales (the activations' high parts in use, down
    to Q4's most negative, -128 x 16), a partial last tile, a bias, row counts across the
    16-row tile groups and 64-row chunks."""
    if kernels is not cpu_native.load("avx512") or not _amx_on():
        pytest.skip(f"AMX not in use here ({cpu_native.amx_state()})")
    n, k = 100, 256
    layer = cls(random_weight(n, k, seed=7), torch.randn(n))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 2, k)
    try:
        x[3, :32] = -x[3, :32].abs()  # a block of negatives: its largest rounds to -2047 / -32767
        for m in (5, 7, 12, 16, 17, 31, 64, 65, 300):
            kernels.tl_amx_set(0)
            vnni = layer(x[:m])
            kernels.tl_amx_set(1)
            assert torch.equal(layer(x[:m]), vnni), m
        ref = emulated(layer, x)
        scale = (x.abs() @ layer.dequantized_weight().abs().T).max().item()
        torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-6 * scale)
    finally:
        kernels.tl_amx_set(1)


@pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler")
def test_the_tile_probe_runs_in_a_child_that_may_die(tmp_path):
    """The probe's child runs the library's tl_amx_enable: one that faults (as a CPU that lists
    AMX but traps on it does: ud2 raises the same SIGILL) or answers wrong sums leaves this
    process running and the tiles off."""
    libs = {}
    for name, body in (("fault", '__asm__ volatile("ud2"); return 1;'), ("wrong", "return 0;"), ("right", "return 1;")):
        src, so = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
        src.write_text(f"int tl_amx_enable(void) {{ {body} }}\n")
        subprocess.run([cpu_build.compiler(), "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
        libs[name] = str(so)
    assert cpu_native._tile_probe_survives(libs["fault"]) is False
    assert cpu_native._tile_probe_survives(libs["wrong"]) is False
    assert cpu_native._tile_probe_survives(libs["right"]) is True
    assert cpu_native._tile_probe_survives(str(tmp_path / "missing.so")) is False
    if {"amx_tile", "amx_int8"} <= cpu_native.cpu_flags() and "avx512" in cpu_native.supported_variants():
        # the real probe agrees with what load() decided
        assert cpu_native._tile_probe_survives(cpu_native.load("avx512")._name) == _amx_on()


@pytest.mark.parametrize("env, expect", [("0", "off: TALLOW_AMX=0"), ("", None)])
def test_tallow_amx_0_keeps_the_tiles_off(env, expect):
    code = "from tallow.ops import cpu_native; cpu_native.lib(); print(cpu_native.variant(), cpu_native.amx_state())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TALLOW_AMX": env}).stdout.strip().splitlines()[-1]
    variant, state = out.split(" ", 1)
    if expect is None:  # by default: on exactly where the CPU lists the tiles and the probe passes
        listed = {"amx_tile", "amx_int8"} <= cpu_native.cpu_flags() and variant == "avx512"
        expect = "on" if listed and cpu_native._tile_probe_survives(cpu_native.load("avx512")._name) else state
        assert listed or state.startswith("off: ")
    assert state == expect
