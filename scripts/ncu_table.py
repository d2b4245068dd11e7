"""Pair ncu's per-launch Duration/registers/occupancy with the launch order of profile_kernels.py."""

import re
import sys

text = open(sys.argv[1]).read()
names = [ln.strip() for ln in open(sys.argv[2]) if ln.strip()]
blocks = re.split(r"\n  (?=\S+ \(\d+, \d+, \d+\)x\()", text)[1:]


def metric(block, name):
    m = re.search(rf"{re.escape(name)}\s+\S+\s+([\d,.]+)", block) or re.search(rf"{re.escape(name)}\s+([\d,.]+)", block)
    return m.group(1).replace(",", "") if m else "?"


print("| variant | kernel | grid | duration us | DRAM % | SM % | regs | occupancy % |")
print("|---|---|---|---|---|---|---|---|")
for name, block in zip(names, blocks):
    if "(warm-up)" in name:
        continue
    head = block.split("\n", 1)[0]
    kernel, grid = head.split(" ", 1)[0], head.split(" ", 1)[1].split(",")[0:3]
    print(f"| {name} | {kernel} | {','.join(grid).split('x')[0]} | {metric(block, 'Duration')} | "
          f"{metric(block, 'DRAM Throughput')} | {metric(block, 'Compute (SM) Throughput')} | "
          f"{metric(block, 'Registers Per Thread')} | {metric(block, 'Achieved Occupancy')} |")
if len(blocks) != len(names):
    print(f"\n(warning: {len(blocks)} profiled launches, {len(names)} expected)")
