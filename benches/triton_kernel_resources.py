"""What Triton makes of the MLA decode kernel for a Hopper GPU, on a machine without one:
registers and spills a thread, shared memory a program, and which tensor-core instructions
and asynchronous copies the compiled kernel issues.

    python benches/triton_kernel_resources.py                 # every tiling of MLA_TILINGS
    python benches/triton_kernel_resources.py --tilings h32-k16-w4-s5-pf h64-k32-w8-s2

It compiles :func:`helix_kv.executor._triton_kernels.mla_decode_attention_kernel` for the
target ``cuda:90`` (an H100 / H200) with the integer arguments a DeepSeek-V3 call
specializes on (pointers, strides and dims divisible by 16, as Triton's launcher marks
them), and reads the cubin with the ``cuobjdump`` that Triton ships. It needs triton, not a
GPU, so a tiling can be ruled out before device time is spent on it: a device run is still
what times it (``benches/gpu_mla_attention.py``). ``wgmma`` counts warpgroup MMAs (Hopper's),
``mma.sync`` warp-level ones; ``cp.async`` is the pipeliner's asynchronous copies (none: the
loads are not pipelined); ``buffers`` the shared-memory buffers of the cache rows (one: each
key block waits for its own copy); ``per SM`` the programs an SM holds by registers and
shared memory (228 KB an SM, 1 KB reserved a program; 64 K registers).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from helix_kv.executor import _triton_kernels, paged_attention

#: DeepSeek-V3's latent and RoPE widths.
LATENT, ROPE = 512, 64
#: The arguments whose value a DeepSeek-V3 call has divisible by 16 (Triton's launcher then
#: specializes on it, and the loads vectorize).
DIVISIBLE_BY_16 = {
    "q_ptr",
    "cache_ptr",
    "table_ptr",
    "lens_ptr",
    "out_ptr",
    "lse_ptr",
    "tokens_per_block",
    "latent_dim",
    "rope_dim",
    "stride_q_row",
    "stride_q_head",
    "stride_cache_slot",
    "stride_out_row",
    "stride_out_head",
    "stride_out_split",
}
POINTER_TYPES = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*fp32", "lse_ptr": "*fp32"}


def compile_kernel(tiling: paged_attention.MLATiling) -> triton.compiler.CompiledKernel:
    """The MLA decode kernel compiled for ``cuda:90`` at one tiling (bf16, tensor-core dots)."""
    kernel = _triton_kernels.mla_decode_attention_kernel
    constants = {
        "BLOCK_H": tiling.block_heads,
        "BLOCK_N": tiling.block_keys,
        "BLOCK_L": LATENT,
        "BLOCK_R": ROPE,
        "ACC_FP64": False,
        "USE_DOT": True,
        "PREFETCH": tiling.prefetch,
    }
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*i32")
        elif name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(kernel.arg_names)
        if name in DIVISIBLE_BY_16
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tiling.num_warps, "num_stages": tiling.num_stages},
    )


def resources(compiled: triton.compiler.CompiledKernel) -> dict[str, int]:
    """Registers, stack (spills) and shared memory of a compiled kernel, and its instruction
    counts."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage[-500:]}")
    ptx = compiled.asm["ptx"]
    buffers = re.search(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x512x", compiled.asm["ttgir"])
    registers, shared = int(match.group(1)), compiled.metadata.shared
    warps = compiled.metadata.num_warps
    per_warp = -(-registers // 8) * 8 * 32  # registers are allocated 8 a thread at a time
    return {
        "registers": registers,
        "stack": int(match.group(2)),
        "shared": shared,
        "buffers": int(buffers.group(1)) if buffers else 0,
        "per SM": min(65536 // (per_warp * warps), (228 << 10) // (shared + 1024), 64 // warps),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma.sync": ptx.count("mma.sync"),
        "cp.async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
    }


def main() -> None:
    """Parse, compile every tiling asked for, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tilings", nargs="+", default=list(paged_attention.MLA_TILINGS), help="tiling names"
    )
    args = parser.parse_args()
    print(f"# triton {triton.__version__}, target cuda:90, latent {LATENT} + rope {ROPE}, bf16")
    columns = ["registers", "stack", "shared", "buffers", "per SM", "wgmma", "mma.sync", "cp.async"]
    print(f"{'tiling':>26} " + " ".join(f"{c:>9}" for c in columns))
    for name in args.tilings:
        found = resources(compile_kernel(paged_attention.MLATiling.from_name(name)))
        print(f"{name:>26} " + " ".join(f"{found[c]:>9}" for c in columns), flush=True)


if __name__ == "__main__":
    main()
