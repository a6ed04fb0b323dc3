"""Prints the decode-time expert kernel benchmark (weight GB/s vs read bandwidth) as a markdown table."""

from __future__ import annotations

from moed.experts.kernel_bench import bench_kernels, format_table

__all__ = ["bench_kernels", "main"]


def main() -> None:
    print(format_table(bench_kernels()))


if __name__ == "__main__":
    main()
