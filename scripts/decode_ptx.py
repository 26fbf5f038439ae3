"""Compile the decode kernels (fastplug.kernels.decode) for an H100 (sm_90) on a machine without a GPU, and compare
two such dumps: a refactor of a kernel shows whether the code the GPU runs changed, and a Triton version shows
whether the kernels compile at all, before any GPU run (the CPU tests run the interpreter, which accepts what the
compiler may not: Triton 3.6 refuses a str field of a constexpr tuple passed on as an argument, for one).

    python scripts/decode_ptx.py dump OUT [--quick]    # one PTX file a launch variant: OUT/NNN_<kernel>.ptx
    python scripts/decode_ptx.py dump OUT --family attention [--quick]   # the training attention kernels
    python scripts/decode_ptx.py dump OUT --family rope|moe [--quick]    # RoPE; the MoE grouped GEMMs
    python scripts/decode_ptx.py dump OUT --family gemv4bit [--quick]    # gemv_4bit (the GEMV on one weight)
    python scripts/decode_ptx.py compare A B           # identical / same instructions in another order / differ

`dump` stands a driver in for CUDA's (the target sm_90; nothing is launched: each launch compiles and is
skipped), lets the kernels take CPU tensors, and makes the GEMV pick its CUDA tiles (132 SMs), then runs the
launch variants of the decode step: the GEMV (fp32 and bf16, 1/3/8 rows, norm, bias, LoRA, gate/up, residual,
softcap; 4-bit NF4/FP4 weights as tiles and as words, shuffle lookups and inline PTX included), decode attention
(q/k norms, softcap, window, ring, one split or several), add_rms_norm and greedy_emit. The PTX is written without
debug lines. Needs bitsandbytes (4-bit weights) and TRITON_INTERPRET unset; to dump an older tree, put it first on
PYTHONPATH. About 6 minutes on one core (--quick: bf16 only, fewer shapes, about 2). `--family attention` compiles
the flash attention's forward, dQ and dK/dV kernels with the H100's launch configs instead (about 40 minutes on
one core; --quick, bf16 at head dims 64 and 128: about 5). `--family rope` compiles RoPE's kernel, forward and
backward (under a minute); `--family moe` the grouped GEMMs of the experts MLP and of `grouped_gemm`, forward and
backward, with pointer loads and with tensor descriptors (about 5 minutes on one core; --quick: bf16 only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections import Counter
from pathlib import Path


def stand_in_sm90_driver():
    """Triton's driver made to compile for an H100 (sm_90) on a machine without one (scripts/host_step_without_gpu.py
    uses it too)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Sm90:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Sm90())


def kernels_take_cpu_tensors() -> None:
    """Every imported fastplug kernel module launches its Triton kernel on CPU tensors (no interpreter)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fastplug.kernels") and hasattr(module, "use_triton"):
            module.use_triton = lambda *tensors: True


def _record_launches(out: Path) -> list:
    """Every launch compiles (warmup) and writes its PTX once; returns the list of files written."""
    from triton.runtime.jit import JITFunction

    run, seen = JITFunction.run, {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        text = "\n".join(line for line in kernel.asm["ptx"].splitlines() if not re.match(r"\s*(\.loc|\.file|//)", line))
        text = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", text, flags=re.S)
        if (self.fn.__name__, text) not in seen:
            seen[self.fn.__name__, text] = path = out / f"{len(seen):03d}_{self.fn.__name__}.ptx"
            path.write_text(text)
        return kernel

    JITFunction.run = compile_only
    return seen


def _packed(out: int, k: int, nested: bool, quant_type: str):
    import bitsandbytes as bnb
    import torch

    w = bnb.nn.Params4bit(
        torch.randn(out, k) / 8, requires_grad=False, quant_type=quant_type, compress_statistics=nested, blocksize=64
    )
    try:
        return w._quantize("cpu")
    except RuntimeError:  # bitsandbytes < 0.49 packs nf4 only on CPU; the kernels see the same constexprs
        w.quant_type = "nf4"
        return w._quantize("cpu")


def dump(out: Path, quick: bool, family: str = "decode") -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the dump compiles for the GPU")
    out.mkdir(parents=True, exist_ok=True)
    stand_in_sm90_driver()
    written = _record_launches(out)
    import torch
    import triton

    if family not in ("decode", "gemv4bit"):
        {"attention": _attention_launches, "rope": _rope_launches, "moe": _moe_launches}[family](quick)
        print(f"{len(written)} launch variants compiled for sm_90 by triton {triton.__version__}: {out}")
        return

    import fastplug.kernels.quant.gemv_tile as tile
    from fastplug.kernels import decode

    kernels_take_cpu_tensors()
    tile.num_sms = lambda device: 132
    cuda_config = tile.default_gemv_config.__wrapped__  # the word-wise tile a GPU gets (shuffle lookups, inline PTX)

    def gemv_config(m, n, k, blocksize, device):
        return cuda_config(m, n, k, blocksize, torch.device("cuda", 0))

    for name, module in list(sys.modules.items()):
        if name.startswith("fastplug.kernels.decode") and hasattr(module, "default_gemv_config"):
            module.default_gemv_config = gemv_config
    if family == "gemv4bit":
        _gemv_4bit_launches(quick, tile)
        print(f"{len(written)} launch variants compiled for sm_90 by triton {triton.__version__}: {out}")
        return

    torch.manual_seed(0)
    gemv = decode.gemv
    for dtype in (torch.bfloat16,) if quick else (torch.float32, torch.bfloat16):

        def rand(*shape):
            return torch.randn(*shape, dtype=dtype)

        for m in (1, 3) if quick else (1, 3, 8):
            k = 4096 if m == 1 else 1024
            x, nw = rand(m, k), torch.rand(k, dtype=dtype)
            qkv = [rand(n, k) for n in (64, 32, 32)]
            lora = (rand(m, 8), [rand(64, 4), None, rand(32, 4)], [2.0, 0.0, 0.5])
            gemv(x, qkv, norm=(nw, 1e-6, 0.0), biases=[rand(n) for n in (64, 32, 32)], lora=lora)
            gemv(x, qkv, norm=(nw, 1e-6, 1.0))
            gemv(x, [rand(128, k) for _ in range(2)], activation="silu")
            gemv(x, [rand(128, k) for _ in range(2)], activation="gelu_tanh", norm=(nw, 1e-6, 0.0))
            gemv(x, [rand(k, k)], residual=rand(m, k))
            gemv(x, [rand(1000, k)], out_dtype=torch.float32, softcap=30.0, norm=(nw, 1e-6, 1.0))
        for m in (1, 3):
            for nested, quant_type in ((True, "nf4"),) if quick else ((True, "nf4"), (False, "fp4")):
                k = 1024
                x, nw = rand(m, k), torch.rand(k, dtype=dtype)
                ws = [_packed(n, k, nested, quant_type) for n in (64, 32, 32)]
                lora = (rand(m, 8), [rand(64, 4), None, rand(32, 4)], [2.0, 0.0, 0.5])
                for words in (False, True) if m == 1 else (True,):
                    biases = [rand(n) for n in (64, 32, 32)]
                    gemv(x, ws, norm=(nw, 1e-6, 0.0), biases=biases, lora=lora, words=words)
                    gemv(x, [_packed(128, k, nested, quant_type) for _ in range(2)], activation="silu", words=words)
                    gemv(x, [_packed(k, k, nested, quant_type)], residual=rand(m, k), words=words)
        shapes = ((1, 2, 512, 128, 8), (3, 1, 64, 64, 2), (2, 2, 1024, 256, 4))
        for b, hkv, length, d, heads in shapes[:1] if quick else shapes:
            qkv, kc = rand(b, (heads + 2 * hkv) * d), rand(b, hkv, length, d)
            vc, valid = torch.randn_like(kc), torch.ones(b, length, dtype=torch.bool)
            slot, pos, cos, sin = (
                torch.tensor([length // 2]),
                torch.arange(b),
                torch.randn(2048, d),
                torch.randn(2048, d),
            )
            qk = (torch.rand(d, dtype=dtype), torch.rand(d, dtype=dtype), 1e-6)
            for kw in (
                dict(),
                dict(softcap=50.0, window=128),
                dict(qk_norm=(*qk, 0.0)),
                dict(qk_norm=(*qk, 1.0)),
                dict(ring=True, window=length),
                dict(chunk=length),
            ):
                decode.decode_attention(qkv, kc, vc, valid, slot, pos, cos, sin, heads=heads, scaling=d**-0.5, **kw)
        h = rand(3, 2048)
        decode.add_rms_norm(h, torch.randn_like(h), (torch.rand(2048, dtype=dtype), 1e-6, 0.0))
        decode.add_rms_norm(h, torch.randn_like(h), (torch.rand(2048, dtype=dtype), 1e-6, 1.0))
    b, long = 4, torch.long
    decode.greedy_emit(
        torch.randn(b, 32000),
        torch.zeros(b, dtype=torch.bool),
        torch.zeros(b, dtype=long),
        torch.zeros(1, dtype=long),
        torch.tensor([2, 5]),
        torch.tensor([0]),
        torch.zeros(b, 10, dtype=long),
        torch.zeros(b, 1, dtype=long),
        torch.zeros(b, dtype=long),
    )
    print(f"{len(written)} launch variants compiled for sm_90 by triton {triton.__version__}: {out}")


def _gemv_4bit_launches(quick: bool, tile) -> None:
    """gemv_4bit (the decode GEMV on one 4-bit weight) at 1, 2, 3 and 8 rows of x, at Llama-1B's projection shapes
    and one that splits K, NF4 with double quantization and FP4 without, with the tile a GPU gets."""
    import torch

    from fastplug.kernels.quant import gemv_4bit

    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    shapes = ((2048, 2048), (512, 2048)) if quick else ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192))
    for m in (1, 3) if quick else (1, 2, 3, 8):
        for n, k in shapes:
            for nested, quant_type in ((True, "nf4"),) if quick else ((True, "nf4"), (False, "fp4")):
                w, x = _packed(n, k, nested, quant_type), torch.randn(m, k, dtype=torch.bfloat16)
                gemv_4bit(x, w, tile.gemv_config(m, n, k, 64, cuda))


def _attention_launches(quick: bool) -> None:
    """The training flash attention's forward and both backward kernels, with the H100's launch configs (TMA
    where the tables ask for it), over the options that specialise them: causal or not, sliding window, softcap,
    GQA, packed rows (document bounds), sinks, head dims 64, 80 (padded), 128 and 256, bf16 and fp16 (fp32: IEEE
    dots)."""
    import torch

    from fastplug.kernels import tuning
    from fastplug.kernels.attention import attention_config, flash_attention, packed_bounds

    kernels_take_cpu_tensors()
    cuda = torch.device("cuda", 0)
    tuning.override("attention", lambda kernel, block_d, device, **kw: attention_config(kernel, block_d, cuda))
    config = sys.modules["fastplug.kernels.attention.config"]
    precision = config._precision
    config._precision = lambda dtype, interpret: precision(dtype, False)  # the GPU's dots, not the interpreter's
    torch.manual_seed(0)
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    dims = (64, 128) if quick else (64, 80, 128, 256)
    for dtype in dtypes:
        for d in dims:
            for kw in (
                dict(causal=True),
                dict(causal=False),
                dict(causal=True, sliding_window=64, softcap=50.0),
                dict(causal=True, sinks=True),
                dict(causal=True, packed=True),
            ):
                kw = dict(kw)
                q = torch.randn(2, 4, 256, d, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(2, 2, 256, d, dtype=dtype, requires_grad=True) for _ in range(2))
                if kw.pop("sinks", False):
                    kw["sinks"] = torch.randn(4, dtype=dtype, requires_grad=True)
                if kw.pop("packed", False):
                    position_ids = torch.cat((torch.arange(100), torch.arange(156))).expand(2, 256)
                    kw["doc_start"], kw["doc_end"] = packed_bounds(position_ids)
                flash_attention(q, k, v, **kw).sum().backward()
    tuning.clear("attention")


def _rope_launches(quick: bool) -> None:
    """RoPE's one kernel, forward and backward (autograd), in place and into given rows (`rope_projections`), over
    the options that specialise it: partial rotary dims, GQA head counts, cos/sin per batch or broadcast, one
    program per head block or one walking every head, bf16 and fp32 (fp32 cos/sin with bf16 q and k: fp32 out)."""
    import torch

    from fastplug.kernels import tuning
    from fastplug.kernels.rope import rope, rope_config, rope_projections

    kernels_take_cpu_tensors()
    torch.manual_seed(0)
    for split in (True,) if quick else (True, False):
        tuning.override("rope", lambda *a, **kw: dataclasses.replace(rope_config(*a, **kw), split_heads=split))
        for dtype, cs_dtype in (
            ((torch.bfloat16, torch.bfloat16),)
            if quick
            else (
                (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32),
                (torch.float32, torch.float32),
            )
        ):
            for hq, hk, d, rot, per_batch in ((8, 2, 128, 128, False), (4, 4, 64, 32, True), (6, 1, 80, 80, False)):
                q = torch.randn(2, 48, hq, d, dtype=dtype).transpose(1, 2).requires_grad_()
                k = torch.randn(2, 48, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
                cos, sin = (torch.randn(2 if per_batch else 1, 48, rot, dtype=cs_dtype) for _ in range(2))
                q_rot, k_rot = rope(q, k, cos, sin)
                (q_rot.sum() + k_rot.sum()).backward()
                if cs_dtype == dtype and not quick:  # in place on fresh projections, then into column blocks
                    q2, k2 = (t.detach().clone().requires_grad_() * 1 for t in (q, k))
                    sum(t.sum() for t in rope(q2, k2, cos, sin, inplace=True)).backward()
                    yq, yk = torch.randn(96, hq * d, dtype=dtype), torch.randn(96, hk * d, dtype=dtype)
                    out = torch.empty(96, (hq + hk) * d, dtype=dtype)
                    rope_projections(yq, yk, cos, sin, 2, d, out=(out[:, : hq * d], out[:, hq * d :]))
                    rope_projections(yq, yk, cos, sin, 2, d, backward=True, inplace=True)
    tuning.clear("rope")


# The H100 launch configs the MoE dump takes (tuning's candidates): its defaults (pointer loads), and one tensor
# descriptor config per kernel.
_MOE_CONFIGS = {
    "ptr": {"fwd": (128, 128, 64, 8, 3, "ptr"), "dw": (64, 128, 128, 8, 3, "ptr"), "glu": (128, 64, 64, 4, 4, "ptr")},
    "tma": {"fwd": (128, 128, 64, 8, 4, "tma"), "dw": (64, 128, 128, 8, 3, "tma"), "glu": (128, 128, 64, 8, 3, "tma")},
}


def _moe_launches(quick: bool) -> None:
    """The MoE grouped GEMMs (`_grouped_mm`, `_grouped_mm_glu`, `_grouped_mm_dw`) through the experts MLP and the
    grouped GEMM, forward and backward, with the H100's configs (`_MOE_CONFIGS`: pointer loads, and tensor
    descriptors where the strides allow them), over the options that specialise them: LoRA on gate_up and down,
    biases, routing weights, gathered and scattered rows, the GLU's activations and layouts (gu stored or not),
    the dW kernels, bf16 and fp32. Nothing is timed: the configs stand in for the autotuner's."""
    import torch

    from fastplug.kernels.moe import ExpertLoRA, grouped_gemm, moe_experts, routing_metadata_reference, tuning

    kernels_take_cpu_tensors()
    gemm, experts = (sys.modules[f"fastplug.kernels.moe.{name}"] for name in ("grouped_gemm", "experts"))
    precision, config_for, metadata = gemm._precision, tuning.config_for, experts.routing_metadata
    gemm._precision = lambda dtype, device: precision(dtype, torch.device("cuda", 0))  # the GPU's dots
    # the routing's own kernel is compiled, not run: the GEMMs' launchers index with what the reference gives
    experts.routing_metadata = routing_metadata_reference
    torch.manual_seed(0)
    T, H, I, E, k, r = 64, 256, 128, 4, 2, 8
    for impl in ("ptr", "tma"):
        tuning.config_for = lambda kind, *args, **kw: tuning.as_config(_MOE_CONFIGS[impl][kind])
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):

            def rand(*shape, grad=True):
                return (torch.randn(*shape, dtype=dtype) / 8).requires_grad_(grad)

            index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
            cases = (
                dict(lora=True, biases=True),
                dict(biases=True, activation="clamped_swiglu", interleaved=True, swiglu_alpha=1.7, swiglu_limit=7.0),
                dict(),  # down trained: one node; gu stored
                dict(frozen_down=True),  # the split path (ExpertsUp, ExpertsDown)
                dict(frozen_down=True, lora=True, activation="gelu_tanh"),
            )
            for kw in cases[:2] if dtype == torch.float32 else cases:  # fp32: the launches that differ in dtype
                kw = dict(kw)
                x, weights = rand(T, H), torch.rand(T, k, dtype=dtype, requires_grad=True)
                gate_up, down = rand(E, 2 * I, H), rand(E, H, I, grad=not kw.pop("frozen_down", False))
                if kw.pop("lora", False):
                    kw["gate_up_lora"] = ExpertLoRA(rand(E, r, H), rand(E, 2 * I, r), 2.0)
                    if down.requires_grad:
                        kw["down_lora"] = ExpertLoRA(rand(E, r, I), rand(E, H, r), 0.5)
                if kw.pop("biases", False):
                    kw["gate_up_bias"], kw["down_bias"] = rand(E, 2 * I), rand(E, H)
                moe_experts(x, gate_up, down, index, weights, **kw).sum().backward()
            offsets = torch.tensor([40, 40, 100, 128], dtype=torch.int32)  # an empty expert
            gather, scatter = torch.randint(0, T, (128,)), torch.randperm(128)
            x, w, rw = rand(T, H), rand(E, I, H), rand(128)
            grouped_gemm(x, w, offsets, gather_index=gather, scatter_index=scatter, row_weights=rw).sum().backward()
            if dtype != torch.float32:
                grouped_gemm(rand(128, H), w, offsets).sum().backward()
                with torch.no_grad():  # gu not stored
                    moe_experts(x, gate_up, down, index, weights)
    tuning.config_for, gemm._precision, experts.routing_metadata = config_for, precision, metadata


def _instructions(text: str) -> Counter:
    """The instructions, registers and parameter numbers left out: what a reordering keeps."""
    found = Counter()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith((".", "$L__tmp")):
            found[re.sub(r"%[a-z]+\d+", "%r", re.sub(r"_param_\d+", "_param", line))] += 1
    return found


def _registers(path: Path) -> int | None:
    """The registers ptxas gives the kernel for sm_90a: Triton's own ptxas-blackwell (it reads the PTX versions Triton
    3.9 writes) or ptxas; None where neither runs."""
    import subprocess

    import triton

    for name in ("ptxas-blackwell", "ptxas"):
        exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if exe.exists():
            done = subprocess.run([exe, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
            used = re.search(r"Used (\d+) registers", done.stderr)
            if used:
                return int(used.group(1))
    return None


def compare(a: Path, b: Path) -> int:
    """0 when every variant of A has the same instructions in B (reordered or not), else 1. Registers that differ
    are printed too (a kernel's occupancy follows them)."""
    files_a, files_b = sorted(a.glob("*.ptx")), sorted(b.glob("*.ptx"))
    if [f.name for f in files_a] != [f.name for f in files_b]:
        print(f"different launch variants: {len(files_a)} in {a}, {len(files_b)} in {b}")
        return 1
    counts = Counter()
    for fa, fb in zip(files_a, files_b):
        # labels of inlined scopes ($L__tmpN) are numbered by the source's structure
        ta, tb = (re.sub(r"^\$L__tmp\d+:\n", "", f.read_text(), flags=re.M) for f in (fa, fb))
        if ta == tb:
            counts["identical"] += 1
        elif _instructions(ta) == _instructions(tb):
            counts["same instructions, another order or parameter order"] += 1
            print(f"  reordered  {fa.name}")
        else:
            counts["different instructions"] += 1
            print(f"  DIFFERENT  {fa.name}")
        if ta != tb and (ra := _registers(fa)) != (rb := _registers(fb)):
            print(f"  registers  {fa.name}: {ra} -> {rb}")
    print(", ".join(f"{n} {what}" for what, n in counts.items()), f"(of {len(files_a)})")
    return 1 if counts["different instructions"] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_dump = sub.add_parser("dump", help="compile every launch variant, one PTX file each")
    p_dump.add_argument("out", type=Path)
    p_dump.add_argument("--quick", action="store_true", help="bf16 only, fewer shapes")
    p_dump.add_argument(
        "--family",
        choices=("decode", "gemv4bit", "attention", "rope", "moe"),
        default="decode",
        help="the decode step, gemv_4bit alone, or the training kernels: attention, rope, moe",
    )
    p_cmp = sub.add_parser("compare", help="compare two dumps")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.quick, args.family)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
