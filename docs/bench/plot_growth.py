#!/usr/bin/env python3
"""Draws growth.svg from growth.tsv (written by growth.sh): throughput and
p99 of `pairs` against locks held, kunci and Redis, at P=32 and P=1.

Plain SVG written by hand, so it needs nothing beyond Python 3.
Usage: plot_growth.py growth.tsv growth.svg
"""

import math
import sys

WIDTH, HEIGHT = 900, 380
PANEL_W, PANEL_H = 340, 260
LEFT, TOP = 90, 50
GAP = 110
SERIES = [  # (system, pipeline, colour, dash)
    ("kunci", "32", "#1f77b4", ""),
    ("kunci", "1", "#1f77b4", "6,4"),
    ("redis", "32", "#d62728", ""),
    ("redis", "1", "#d62728", "6,4"),
]


def held_label(held):
    held = int(held)
    if held >= 1_000_000:
        return f"{held // 1_000_000} M"
    if held >= 1_000:
        return f"{held // 1_000} k"
    return str(held)


def read_rows(path):
    rows = []
    with open(path, encoding="utf-8") as tsv:
        next(tsv)
        for line in tsv:
            fields = line.rstrip("\n").split("\t")
            if fields[0].isdigit():
                rows.append(fields)
    return rows


def log_ticks(low, high):
    ticks = []
    exponent = math.floor(math.log10(low))
    while 10**exponent <= high * 1.0001:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if low / 1.0001 <= value <= high * 1.0001:
                ticks.append(value)
        exponent += 1
    return ticks


def fmt(value):
    if value >= 1e6:
        return f"{value / 1e6:g} M"
    if value >= 1e3:
        return f"{value / 1e3:g} k"
    return f"{value:g}"


def panel(out, x0, title, unit, sizes, values):
    """values: {(system, pipeline): [value per size]}; log y axis."""
    flat = [v for series in values.values() for v in series if v > 0]
    low = 10 ** math.floor(math.log10(min(flat)))
    high = 10 ** math.ceil(math.log10(max(flat)))

    def y_of(value):
        span = math.log10(high) - math.log10(low)
        return TOP + PANEL_H - (math.log10(value) - math.log10(low)) / span * PANEL_H

    def x_of(i):
        return x0 + (i + 0.5) * PANEL_W / len(sizes)

    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{TOP - 20}" text-anchor="middle" '
               f'font-weight="bold">{title}</text>')
    out.append(f'<rect x="{x0}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" '
               'fill="none" stroke="#444"/>')
    for tick in log_ticks(low, high):
        y = y_of(tick)
        out.append(f'<line x1="{x0}" x2="{x0 + PANEL_W}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(tick)}</text>')
    out.append(f'<text x="{x0 - 60}" y="{TOP + PANEL_H / 2}" text-anchor="middle" '
               f'transform="rotate(-90 {x0 - 60} {TOP + PANEL_H / 2})">{unit}</text>')
    for i, size in enumerate(sizes):
        out.append(f'<text x="{x_of(i):.1f}" y="{TOP + PANEL_H + 18}" '
                   f'text-anchor="middle">{held_label(size)}</text>')
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{TOP + PANEL_H + 38}" '
               'text-anchor="middle">other locks held</text>')
    for system, pipeline, colour, dash in SERIES:
        series = values.get((system, pipeline))
        if not series:
            continue
        points = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(series) if v > 0)
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                   f'stroke-width="2" stroke-dasharray="{dash}"/>')
        for i, v in enumerate(series):
            if v > 0:
                out.append(f'<circle cx="{x_of(i):.1f}" cy="{y_of(v):.1f}" r="3" fill="{colour}"/>')


def main():
    rows = read_rows(sys.argv[1])
    sizes = []
    rate, p99 = {}, {}
    for label, _c, pipeline, k_rps, k_p99, r_rps, r_p99, _ratio in rows:
        if label not in sizes:
            sizes.append(label)
        rate.setdefault(("kunci", pipeline), []).append(float(k_rps))
        rate.setdefault(("redis", pipeline), []).append(float(r_rps))
        p99.setdefault(("kunci", pipeline), []).append(float(k_p99))
        p99.setdefault(("redis", pipeline), []).append(float(r_p99))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    panel(out, LEFT, "pairs throughput (C=50)", "requests/s (log)", sizes, rate)
    panel(out, LEFT + PANEL_W + GAP, "pairs p99 latency (C=50)", "ms (log)", sizes, p99)
    legend_y = HEIGHT - 18
    for n, (system, pipeline, colour, dash) in enumerate(SERIES):
        x = LEFT + n * 190
        out.append(f'<line x1="{x}" x2="{x + 30}" y1="{legend_y}" y2="{legend_y}" '
                   f'stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}"/>')
        name = "kunci" if system == "kunci" else "Redis SET NX PX + Lua"
        out.append(f'<text x="{x + 36}" y="{legend_y + 4}">{name} P={pipeline}</text>')
    out.append("</svg>")
    with open(sys.argv[2], "w", encoding="utf-8") as svg:
        svg.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
