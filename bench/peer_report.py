"""bench/peer.py's report: the Markdown tables with the ratios and target misses, and the plot."""

from __future__ import annotations

from pathlib import Path

TARGETS = {
    "tok_s_vs_peer": 0.5,  # eaas output tok/s >= 0.5x vLLM's
    "itl_p99_over_p50": 3.0,  # ITL p99 <= 3x ITL p50
    "ttft_p50_vs_peer": 2.0,  # TTFT p50 <= 2x vLLM's
    "eaas_vs_single": 0.85,  # eaas tok/s >= 0.85x single-process
    "vllm_eaas_vs_vllm": 0.9,  # vllm+eaas tok/s >= 0.9x vLLM alone (the price of the split)
    "vllm_eaas_vs_eaas": 1.0,  # vllm+eaas tok/s >= eaas serve's
}

# ---- report ----------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or x != x else fmt.format(x)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) and a == a and b == b else None


def _pair_line(systems: dict, wname: str, num: str, den: str) -> tuple[str, float | None]:
    """The table row ``num / den`` of output tok/s (all rounds, and per round when there are
    several) and the ratio; ``("", None)`` when either system has no result."""
    a = systems.get(num, {}).get("workloads", {}).get(wname)
    b = systems.get(den, {}).get("workloads", {}).get(wname)
    if not (a and b):
        return "", None
    r = _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"])
    per = [
        _ratio(x, y)
        for x, y in zip(a.get("rounds_tok_s", []), b.get("rounds_tok_s", []), strict=True)
    ]
    rounds = " (rounds: " + ", ".join(_f(x, "{:.2f}") for x in per) + ")" if len(per) > 1 else ""
    return f"| {wname} | {num} / {den} | {_f(r, '{:.2f}x')}{rounds} | | | | | | | | |", r


def report(res: dict, args) -> tuple[str, list[str]]:
    """Markdown tables and the list of target misses."""
    lines: list[str] = []
    misses: list[str] = []
    ref = "vllm" if args.vllm else ("peer" if args.peer_url else None)
    for dtype, systems in res.items():
        lines.append(f"\n### {dtype}\n")
        lines.append(
            "| workload | system | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "ITL p99/p50 | text ITL p99/p50 | TPOT p50 / p99 (ms) | tok/s vs "
            + (ref or "peer")
            + " | TTFT p50 vs "
            + (ref or "peer")
            + " | failed |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for wname in args.workloads.split(","):
            peer_r = systems.get(ref, {}).get("workloads", {}).get(wname) if ref else None
            for kind, r in systems.items():
                w = r.get("workloads", {}).get(wname)
                if w is None:
                    misses.append(f"{dtype} {wname}: {kind} failed")
                    lines.append(
                        f"| {wname} | {kind} | failed: {r.get('error', '?')} | | | | | | | | |"
                    )
                    continue
                tps = _ratio(w["output_tokens_per_s"], peer_r and peer_r["output_tokens_per_s"])
                ttft = _ratio(w["ttft_p50_ms"], peer_r and peer_r["ttft_p50_ms"])
                spread = _ratio(w["itl_p99_ms"], w["itl_p50_ms"])
                text_spread = _ratio(w.get("text_itl_p99_ms"), w.get("text_itl_p50_ms"))
                lines.append(
                    f"| {wname} | {kind} | {_f(w['output_tokens_per_s'])} | "
                    f"{_f(w['ttft_p50_ms'], '{:.0f}')} / {_f(w['ttft_p99_ms'], '{:.0f}')} | "
                    f"{_f(w['itl_p50_ms'])} / {_f(w['itl_p99_ms'])} | {_f(spread, '{:.2f}')} | "
                    f"{_f(text_spread, '{:.2f}')} | "
                    f"{_f(w.get('tpot_p50_ms'))} / {_f(w.get('tpot_p99_ms'))} | "
                    f"{_f(tps, '{:.2f}x') if kind != ref else ''} | "
                    f"{_f(ttft, '{:.2f}x') if kind != ref else ''} | {w['failed']} |"
                )
                if kind == "eaas":
                    if spread is not None and spread > TARGETS["itl_p99_over_p50"]:
                        misses.append(f"{dtype} {wname}: ITL p99/p50 {spread:.2f} > 3")
                    if tps is not None and tps < TARGETS["tok_s_vs_peer"]:
                        misses.append(f"{dtype} {wname}: tok/s {tps:.2f}x {ref} < 0.5")
                    if ttft is not None and ttft > TARGETS["ttft_p50_vs_peer"]:
                        misses.append(f"{dtype} {wname}: TTFT p50 {ttft:.2f}x {ref} > 2")
            for num, den, key in (
                ("vllm+eaas", "vllm", "vllm_eaas_vs_vllm"),
                ("vllm+eaas", "eaas", "vllm_eaas_vs_eaas"),
            ):
                line, r_pair = _pair_line(systems, wname, num, den)
                if line:
                    lines.append(line)
                if r_pair is not None and r_pair < TARGETS[key]:
                    misses.append(f"{dtype} {wname}: {num}/{den} {r_pair:.2f} < {TARGETS[key]}")
            e = systems.get("eaas", {}).get("workloads", {}).get(wname)
            s = systems.get("single", {}).get("workloads", {}).get(wname)
            if e and s:
                r_es = _ratio(e["output_tokens_per_s"], s["output_tokens_per_s"])
                per = [
                    _ratio(a, b)
                    for a, b in zip(
                        e.get("rounds_tok_s", []), s.get("rounds_tok_s", []), strict=True
                    )
                ]
                rounds = (
                    " (rounds: " + ", ".join(_f(x, "{:.2f}") for x in per) + ")"
                    if len(per) > 1
                    else ""
                )
                lines.append(
                    f"| {wname} | eaas / single | {_f(r_es, '{:.2f}x')}{rounds} | | | | | | | | |"
                )
                if r_es is not None and r_es < TARGETS["eaas_vs_single"]:
                    misses.append(f"{dtype} {wname}: eaas/single {r_es:.2f} < 0.85")
        idle_cpu = [(k, r["cpu_while_others_s"]) for k, r in systems.items() if "pss_idle" in r]
        if idle_cpu:
            lines.append(
                "\nCPU used by each system while idle (another system under load): "
                + ", ".join(f"{k} {v:.2f} s" for k, v in idle_cpu)
                + "; waited for the idle systems to settle before the runs of: "
                + ", ".join(
                    f"{k} {r.get('settle_s', 0.0):.1f} s"
                    + (
                        f" ({r['unsettled_runs']} runs unsettled)"
                        if r.get("unsettled_runs")
                        else ""
                    )
                    for k, r in systems.items()
                    if "cpu_while_others_s" in r
                )
            )
        # memory
        mem = [(k, r) for k, r in systems.items() if "pss_idle" in r]
        if mem:
            lines.append(f"\nPSS ({dtype}; MiB; every process of the system)\n")
            lines.append("| system | process | idle | under load |")
            lines.append("|---|---|---|---|")
            for kind, r in mem:
                idle = r["pss_idle"]
                load = r.get("pss_load") or {}
                for pid in sorted(
                    set(idle) | set(load), key=lambda p: ((idle.get(p) or load.get(p))[0], p)
                ):
                    nm = (idle.get(pid) or load.get(pid))[0]
                    a = idle.get(pid, (nm, None))[1]
                    b = load.get(pid, (nm, None))[1]
                    lines.append(
                        f"| {kind} | {nm} | {_f(a and a / 1024, '{:.0f}')} | {_f(b and b / 1024, '{:.0f}')} |"
                    )
                ti = sum(v[1] for v in idle.values()) / 1024
                tl = sum(v[1] for v in load.values()) / 1024
                lines.append(f"| {kind} | **total** | **{ti:.0f}** | **{tl:.0f}** |")
    return "\n".join(lines), misses


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(res)
    kinds = sorted(
        {k for s in res.values() for k in s},
        key=["eaas", "single", "vllm", "vllm+eaas", "peer"].index,
    )
    colors = {
        "eaas": "tab:blue",
        "single": "tab:gray",
        "vllm": "tab:orange",
        "vllm+eaas": "tab:red",
        "peer": "tab:green",
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    groups = [(d, w) for d in dtypes for w in ("W1", "W2")]
    width = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        for ax, key, scale in (
            (axes[0], "output_tokens_per_s", 1.0),
            (axes[1], "tpot_p50_ms", 1.0),
        ):
            ys = [
                res[d].get(kind, {}).get("workloads", {}).get(w, {}).get(key, 0.0) * scale
                for d, w in groups
            ]
            ax.bar(
                [i + j * width for i in range(len(groups))],
                ys,
                width,
                label=kind,
                color=colors[kind],
            )
        mem = [
            (
                sum(v[1] for v in (res[d].get(kind, {}).get("pss_idle") or {}).values()) / 1024,
                sum(v[1] for v in (res[d].get(kind, {}).get("pss_load") or {}).values()) / 1024,
            )
            for d in dtypes
        ]
        axes[2].bar(
            [i + j * width for i in range(len(dtypes))],
            [m[1] for m in mem],
            width,
            label=f"{kind} (load)",
            color=colors[kind],
        )
        axes[2].bar(
            [i + j * width for i in range(len(dtypes))],
            [m[0] for m in mem],
            width,
            color="white",
            alpha=0.5,
            hatch="//",
        )
    for ax, title in (
        (axes[0], "output tokens/s (higher is better)"),
        (axes[1], "TPOT p50, ms per output token (lower is better)"),
    ):
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(groups))], [f"{d}\n{w}" for d, w in groups]
        )
        ax.set_title(title)
        ax.legend()
    axes[2].set_xticks([i + 0.4 - width / 2 for i in range(len(dtypes))], dtypes)
    axes[2].set_title("PSS of all processes, MiB (hatched: idle)")
    axes[2].legend()
    fig.suptitle("EaaS vs single-process vs vLLM CPU build (tiny DeepSeek-V3, 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
