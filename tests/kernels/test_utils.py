"""The launch-time helpers of fastplug.kernels._utils agree with Triton's own."""

import random

import triton

from fastplug.kernels._utils import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    rng = random.Random(0)
    values = [1, 2, 3, 4, 5, 7, 8, 9, 80, 127, 128, 129, 4095, 4096, 4097, 128256] + [
        rng.randrange(1, 1 << 40) for _ in range(200)
    ]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 1024, rng.randrange(1, 1 << 20)):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert cdiv(0, 7) == 0 and next_power_of_2(0) == 1
