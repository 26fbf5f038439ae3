"""Compile the decode kernels (fastplug.kernels.decode) for an H100 (sm_90) on a machine without a GPU, and compare
two such dumps: a refactor of a kernel shows whether the code the GPU runs changed, and a Triton version shows
whether the kernels compile at all, before any GPU run (the CPU tests run the interpreter, which accepts what the
compiler may not: Triton 3.6 refuses a str field of a constexpr tuple passed on as an argument, for one).

    python scripts/decode_ptx.py dump OUT [--quick]    # one PTX file a launch variant: OUT/NNN_<kernel>.ptx
    python scripts/decode_ptx.py dump OUT --family attention [--quick]   # the training attention kernels
    python scripts/decode_ptx.py compare A B           # identical / same instructions in another order / differ

`dump` stands a driver in for CUDA's (the target sm_90; nothing is launched: each launch compiles and is
skipped), lets the kernels take CPU tensors, and makes the GEMV pick its CUDA tiles (132 SMs), then runs the
launch variants of the decode step: the GEMV (fp32 and bf16, 1/3/8 rows, norm, bias, LoRA, gate/up, residual,
softcap; 4-bit NF4/FP4 weights as tiles and as words, shuffle lookups and inline PTX included), decode attention
(q/k norms, softcap, window, ring, one split or several), add_rms_norm and greedy_emit. The PTX is written without
debug lines. Needs bitsandbytes (4-bit weights) and TRITON_INTERPRET unset; to dump an older tree, put it first on
PYTHONPATH. About 6 minutes on one core (--quick: bf16 only, fewer shapes, about 2). `--family attention` compiles
the flash attention's forward, dQ and dK/dV kernels with the H100's launch configs instead (about 40 minutes on
one core; --quick, bf16 at head dims 64 and 128: about 5).
"""

from __future__ import annotations

import argparse
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

    if family == "attention":
        _attention_launches(quick)
        print(f"{len(written)} launch variants compiled for sm_90 by triton {triton.__version__}: {out}")
        return

    import fastplug.kernels.quant.gemv as quant_gemv
    from fastplug.kernels import decode

    kernels_take_cpu_tensors()
    quant_gemv.num_sms = lambda device: 132
    cuda_config = quant_gemv.gemv_config  # the word-wise tile a GPU gets (shuffle lookups, inline PTX)

    def gemv_config(m, n, k, blocksize, device, **override):
        return cuda_config(m, n, k, blocksize, torch.device("cuda", 0), **override)

    for name, module in list(sys.modules.items()):
        if name.startswith("fastplug.kernels.decode") and hasattr(module, "gemv_config"):
            module.gemv_config = gemv_config

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


def _instructions(text: str) -> Counter:
    """The instructions, registers and parameter numbers left out: what a reordering keeps."""
    found = Counter()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith((".", "$L__tmp")):
            found[re.sub(r"%[a-z]+\d+", "%r", re.sub(r"_param_\d+", "_param", line))] += 1
    return found


def compare(a: Path, b: Path) -> int:
    """0 when every variant of A has the same instructions in B (reordered or not), else 1."""
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
    print(", ".join(f"{n} {what}" for what, n in counts.items()), f"(of {len(files_a)})")
    return 1 if counts["different instructions"] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_dump = sub.add_parser("dump", help="compile every launch variant, one PTX file each")
    p_dump.add_argument("out", type=Path)
    p_dump.add_argument("--quick", action="store_true", help="bf16 only, fewer shapes")
    p_dump.add_argument(
        "--family", choices=("decode", "attention"), default="decode", help="the decode step, or training attention"
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
