"""engine/cpu scalar dequantization vs gguf-py (independent oracle), bit for bit.

Random blocks (random bytes, sane fp16 scales; fp16/bf16/f32 rows get every bit pattern class, NaNs compared as
NaN) and real tensors of the default model. Runs the helper bt_cpu_dequant_tool from $BATON_BUILD_DIR/bin
(default build/ in this checkout). Run: .venv/bin/python -m pytest tests/integration/test_dequant_oracle.py
"""
import functools
import os
import pathlib
import subprocess

import numpy as np
import pytest

import gguf  # noqa: E402  (pinned in tests/requirements.txt: missing means a broken set-up, not a skip)
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

BUILD = pathlib.Path(os.environ.get("BATON_BUILD_DIR", pathlib.Path(__file__).resolve().parents[2] / "build"))
TOOL = BUILD / "bin" / "bt_cpu_dequant_tool"
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of the fp16 scale fields in each block
SCALE_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2],
                "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def default_model():
    env = os.environ.get("BATON_MODEL")
    if env:
        return pathlib.Path(env)
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return cache / "baton" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_tool(tmp_path, type_name, raw: bytes, n_elems: int) -> np.ndarray:
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not built (set BATON_BUILD_DIR)")
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(raw)
    subprocess.run([str(TOOL), "dequant", type_name.lower(), str(n_elems), str(src), str(dst)], check=True)
    return np.fromfile(dst, dtype=np.float32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str):
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, what
    gb, wb = got.view(np.uint32), want.view(np.uint32)
    both_nan = np.isnan(got) & np.isnan(want)
    bad = np.nonzero((gb != wb) & ~both_nan)[0]
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} values differ, first at {bad[0]}: "
                           f"{got[bad[0]]!r} ({gb[bad[0]]:#010x}) vs gguf-py {want[bad[0]]!r} ({wb[bad[0]]:#010x})")


def random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    qt = Q[type_name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS.get(type_name, []):
        mag = rng.uniform(1e-4, 1.0, size=n_blocks) * np.where(rng.random(n_blocks) < 0.5, -1, 1)
        mag[:4] = [0.0, 1.0, 6.1e-5, -3e-6]  # zero, one, near the smallest normal, a subnormal
        raw[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("type_name", TYPES)
def test_random_blocks(tmp_path, type_name):
    rng = np.random.default_rng(1234 + TYPES.index(type_name))
    qt = Q[type_name]
    block_elems, _ = GGML_QUANT_SIZES[qt]
    n_blocks = 4096 if block_elems > 1 else 65536 * 2
    raw = random_blocks(type_name, n_blocks, rng)
    if type_name in ("F16", "BF16"):
        raw = np.arange(65536, dtype=np.uint16).repeat(2).view(np.uint8).reshape(-1, 2)  # every bit pattern
    n = raw.shape[0] * block_elems
    if type_name == "F32":
        want = raw.reshape(-1).view(np.float32)
    else:
        want = gguf.quants.dequantize(raw, qt)
    got = run_tool(tmp_path, type_name, raw.tobytes(), n)
    assert_same_bits(got, want, f"random {type_name}")


@functools.lru_cache(maxsize=1)
def model_reader():
    path = default_model()
    return gguf.GGUFReader(str(path)) if path.exists() else None


def model_tensors():
    reader = model_reader()
    if reader is None:
        return []
    picked, seen = [], {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in TYPES and seen.get(name, 0) < 3:  # a few tensors of each type in the file
            seen[name] = seen.get(name, 0) + 1
            picked.append(t)
        if t.name == "blk.29.ffn_down.weight":
            picked.append(t)
    return picked


@pytest.mark.parametrize("tensor", model_tensors() or [None], ids=lambda t: t.name if t is not None else "none")
def test_model_tensors(tmp_path, tensor):
    if tensor is None:
        pytest.fail("default model not cached (run deploy/fetch-model.sh)")
    raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
    block_elems, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    max_bytes = 8 << 20  # the 49152-row embedding: its first rows are plenty
    if raw.size > max_bytes:
        raw = raw[: max_bytes // block_bytes * block_bytes]
    n = raw.size // block_bytes * block_elems
    if tensor.tensor_type == Q.F32:
        want = raw.view(np.float32)
    else:
        want = gguf.quants.dequantize(raw.reshape(-1, block_bytes), tensor.tensor_type)
    got = run_tool(tmp_path, tensor.tensor_type.name, raw.tobytes(), n)
    assert_same_bits(got, want, f"{tensor.name} ({tensor.tensor_type.name})")


# ---- activation quantization and matmul against numpy ----

ACT32 = np.dtype([("d", "<f4"), ("ds", "<f4"), ("sum", "<i4"), ("reserved", "<i4"), ("qs", "i1", 32)])
ACT16_32 = np.dtype([("d", "<f4"), ("ds", "<f4"), ("sum", "<i4"), ("reserved", "<i4"), ("qs", "<i2", 32)])
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


def np_quantize(x: np.ndarray, block: int, bits: int = 8):
    """The activation quantizer in float32 numpy: d = max|x| / qmax (127 or 32767), q = round-half-even(x * (1 / d))."""
    qmax, qtype = (127, np.int8) if bits == 8 else (32767, np.int16)
    xb = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(qmax)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[:, None]).astype(np.float32)).astype(qtype)
    return d, q


@pytest.mark.parametrize("bits", [8, 16])
def test_act_quantizer_matches_numpy(tmp_path, bits):
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not built (set BATON_BUILD_DIR)")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(32 * 512) * rng.uniform(0.01, 50, 32 * 512)).astype(np.float32)
    x[:32] = 0
    x[32:64] = np.arange(32) - 16.0  # exact ties after scaling (8-bit)
    x[64:96] = (np.arange(32) - 16.0) * 0.25
    x[64] = 16383.5  # d = 0.5: odd multiples of 0.25 are exact ties (16-bit)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    subprocess.run([str(TOOL), "quantize", str(x.size), str(tmp_path / "x.bin"), str(tmp_path / "q.bin"), str(bits)],
                   check=True)
    got = np.fromfile(tmp_path / "q.bin", dtype=ACT32 if bits == 8 else ACT16_32)
    d, q = np_quantize(x, 32, bits)
    assert np.array_equal(got["d"].view(np.uint32), d.view(np.uint32))
    assert np.array_equal(got["qs"], q)
    s = q.astype(np.int32).sum(axis=1)
    assert np.array_equal(got["sum"], s)
    assert np.array_equal(got["ds"].view(np.uint32), (d * s.astype(np.float32)).astype(np.float32).view(np.uint32))


ISAS = ["scalar", "avx2", "avx2-vnni", "avx512"]


def isa_absent(isa):
    """Why this host cannot run isa's kernels (None when it can). BATON_TEST_ISA_MAX=avx2 hides the ISAs above it,
    as the C tests do (tests/unit/engine/test_isa.h)."""
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":")[1].split())
                break
    except OSError:
        pass
    cap = os.environ.get("BATON_TEST_ISA_MAX")
    if cap and ISAS.index(isa) > ISAS.index(cap):
        return f"{isa} kernels: BATON_TEST_ISA_MAX={cap} hides {isa}"
    need = {"scalar": set(), "avx2": {"avx2", "fma", "f16c"}, "avx2-vnni": {"avx2", "fma", "f16c", "avx_vnni"},
            "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}[isa]
    return None if need <= flags else f"{isa} kernels: this host lacks {isa}"


def matmul_cases():
    cases = []
    for t in TYPES:
        cases.append((t, "random"))
    cases.append(("Q4_1", "blk.0.ffn_gate.weight"))
    cases.append(("Q4_1", "blk.3.ffn_down.weight"))
    cases.append(("Q8_0", "token_embd.weight"))
    return cases


def load_model_tensor(name):
    reader = model_reader()
    if reader is None:
        pytest.fail("default model not cached (run deploy/fetch-model.sh)")
    for t in reader.tensors:
        if t.name == name:
            return t
    pytest.fail(f"{name} not in the default model")


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,source", matmul_cases())
def test_matmul_vs_numpy(tmp_path, isa, type_name, source, bits):
    """bt_cpu_matmul (2 threads, forced ISA, 8- or 16-bit activations) vs float64 numpy on the same quantized
    activations: within 2e-6 of sum |w * xq| per output (float accumulation order only). With 16-bit activations
    also vs the unquantized activations: within 5e-5 of sum |w * x| (8-bit is ~1e-2)."""
    if isa_absent(isa):
        pytest.skip(isa_absent(isa))
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not built (set BATON_BUILD_DIR)")
    rng = np.random.default_rng(11)
    qt = Q[type_name]
    block_elems, block_bytes = GGML_QUANT_SIZES[qt]
    if source == "random":
        n_in, n_out = 512, 48
        raw = random_blocks(type_name, n_in * n_out // block_elems, rng)
        if type_name in FLOAT_TYPES:
            vals = rng.uniform(-1, 1, n_in * n_out).astype(np.float32)
            raw = {"F32": vals, "F16": vals.astype(np.float16), "BF16": None}[type_name]
            if raw is None:
                raw = (vals.view(np.uint32) >> 16).astype(np.uint16)
            raw = raw.view(np.uint8).reshape(-1, block_bytes)
    else:
        t = load_model_tensor(source)
        n_in = int(t.shape[0])
        n_out = min(int(t.shape[1]), 2048)
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)[: n_out * n_in // block_elems * block_bytes]
        raw = raw.reshape(-1, block_bytes)
    if type_name == "F32":
        wf = raw.reshape(-1).view(np.float32).astype(np.float64)
    else:
        wf = gguf.quants.dequantize(raw, qt).astype(np.float64)
    wf = wf.reshape(n_out, n_in)
    n_rows = 5
    x = (rng.standard_normal((n_rows, n_in)) * rng.uniform(0.1, 4, (n_rows, n_in))).astype(np.float32)
    if type_name in FLOAT_TYPES:
        xq = x.astype(np.float64)
    else:
        d, q = np_quantize(x.reshape(-1), 256 if type_name in K_TYPES else 32, bits)
        xq = (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(n_rows, n_in)
    (tmp_path / "w.bin").write_bytes(raw.tobytes())
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    env = dict(os.environ, BATON_CPU_ISA=isa)
    subprocess.run([str(TOOL), "matmul", type_name.lower(), str(n_in), str(n_out), str(n_rows),
                    str(tmp_path / "w.bin"), str(tmp_path / "x.bin"), str(tmp_path / "y.bin"), str(bits)],
                   check=True, env=env)
    y = np.fromfile(tmp_path / "y.bin", dtype=np.float32).reshape(n_rows, n_out).astype(np.float64)
    want = xq @ wf.T
    mag = np.abs(xq) @ np.abs(wf).T
    err = np.abs(y - want) / (mag + 1e-30)
    print(f"{type_name} {source} {isa} {bits}-bit: max error {err.max():.3g} of sum |w xq|")
    assert err.max() < 2e-6, f"{type_name} {source} {isa} {bits}-bit: max error {err.max():.3g} of sum |w x|"
    if bits == 16:
        x64 = x.astype(np.float64)
        err_x = np.abs(y - x64 @ wf.T) / (np.abs(x64) @ np.abs(wf).T + 1e-30)
        print(f"{type_name} {source} {isa} 16-bit: max error {err_x.max():.3g} of sum |w x| vs float activations")
        assert err_x.max() < 5e-5, f"{type_name} {source} {isa}: 16-bit error {err_x.max():.3g} of sum |w x|"
