"""Dtype casts of raw little-endian tensor bytes with numpy, bit-identical to torch's `.to()` on
every non-NaN value, for the merge's writer that runs before torch is imported (`np_writer`).

fp32 -> bf16 is round-to-nearest-even on the bit pattern, as torch's CPU cast does; fp32 -> fp16
is numpy's IEEE cast, which rounds (and overflows, and makes subnormals) as torch's does.
NaN is where the two differ: torch's vectorised cast writes 0xFFFF for any NaN, its scalar one
0x7FC0, and other CPUs may differ again. A chunk with a NaN raises `HasNaN`, and the caller has
torch do the whole tensor. (Tested against torch in tests/unit/test_np_writer.py.)

No torch here, by design.
"""

from __future__ import annotations

import numpy as np

from ..format.names import TORCH_ITEMSIZE, TORCH_NAME_OF_CHOICE

# the merge's --dtype choices, as torch names those dtypes (the sources' dtypes are spelled that way)
OUT_DTYPES = {choice: "torch." + name for choice, name in TORCH_NAME_OF_CHOICE.items()}
WIDTH = {"torch." + name: TORCH_ITEMSIZE[name] for name in TORCH_NAME_OF_CHOICE.values()}
BLOCK = 64 * 1024  # fp32 elements per step of the bf16 rounding (256 KiB, plus as much scratch)


class HasNaN(Exception):
    """A chunk holds a NaN, which torch casts in its own CPU-dependent way."""


def supported(src_dtype: str, out: str) -> bool:
    """Whether `cast` does this pair (the pairs a verl checkpoint merge meets)."""
    dst = OUT_DTYPES.get(out)
    return dst is not None and (
        src_dtype == dst
        or (src_dtype == "torch.float32" and dst != src_dtype)
        or (src_dtype == "torch.bfloat16" and dst == "torch.float32")
    )


class Caster:
    """Casts chunks of one (source, output) dtype pair, reusing its scratch buffer."""

    def __init__(self, src_dtype: str, out: str) -> None:
        if not supported(src_dtype, out):
            raise ValueError(f"no numpy cast from {src_dtype} to {out}")
        self.src, self.dst = src_dtype, OUT_DTYPES[out]
        self.src_width, self.out_width = WIDTH[self.src], WIDTH[self.dst]
        self._scratch = np.empty(0, np.uint32)

    def out_nbytes(self, src_nbytes: int) -> int:
        return src_nbytes // self.src_width * self.out_width

    def cast(self, src: memoryview, out: memoryview) -> None:
        """`src` (bytes of the source dtype) into `out` (exactly `out_nbytes(len(src))` bytes)."""
        if self.src == self.dst:
            out[:] = src
            return
        if self.src == "torch.bfloat16":  # -> fp32: the bf16 bits are the fp32's high half, exactly
            np.left_shift(np.frombuffer(src, np.uint16), 16, out=np.frombuffer(out, np.uint32), dtype=np.uint32)
            return
        f = np.frombuffer(src, np.float32)
        # a sum is NaN when any element is (and, rarely, when infinities of both signs meet): one
        # pass without the boolean temporary of isnan, which then only runs on a suspect chunk
        if np.isnan(np.add.reduce(f)) and np.isnan(f).any():
            raise HasNaN
        if self.dst == "torch.float16":
            with np.errstate(over="ignore"):  # beyond fp16's range is inf, as in torch
                np.copyto(np.frombuffer(out, np.float16), f, casting="unsafe")
            return
        u = f.view(np.uint32)
        o = np.frombuffer(out, np.uint16)
        if self._scratch.size < min(u.size, BLOCK):
            self._scratch = np.empty(min(u.size, BLOCK), np.uint32)
        # five passes per block, each block small enough that they all run in the core's cache
        # (faster than whole-chunk passes; measured: BENCHMARKS.md, Figures quoted in the code)
        for a in range(0, u.size, BLOCK):
            b = u[a : a + BLOCK]
            t = self._scratch[: b.size]
            # round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half
            np.right_shift(b, 16, out=t)
            np.bitwise_and(t, 1, out=t)
            t += 0x7FFF
            t += b
            np.right_shift(t, 16, out=o[a : a + BLOCK], casting="unsafe")
