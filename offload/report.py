"""The plan as text: a table of layer ranges (``llmsys plan``) and the why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmsys.kernels.common.units import format_bytes

if TYPE_CHECKING:
    from llmsys.offload.plan import ModelShape, Plan, Placement

_KIND_TEXT = {
    "gpu": "GPU (resident)",
    "cpu": "CPU RAM, computed on CPU",
    "cpu->gpu": "CPU RAM, streamed to GPU",
    "disk": "disk, streamed",
}


def layer_ranges(plan: "Plan") -> list[tuple[int, int, "Placement"]]:
    """Runs of consecutive layers with the same placement: (first, last, placement of first)."""
    out: list[tuple[int, int, Placement]] = []
    for i, p in enumerate(plan.layers):
        if out and out[-1][2].kind == p.kind and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i, out[-1][2])
        else:
            out.append((i, i, p))
    return out


def format_plan(plan: "Plan") -> str:
    """Fixed-width table: what lives where, bytes, predicted ms per decode step, the bound."""
    rows: list[tuple[str, str, str, str, str]] = []
    for a, b, p in layer_ranges(plan):
        n = b - a + 1
        name = f"layers {a}" if a == b else f"layers {a}-{b}"
        per = sum(x.nbytes for x in plan.layers[a : b + 1])
        ms = sum(x.ms for x in plan.layers[a : b + 1])
        where = _KIND_TEXT[p.kind] + ({"disk": "; experts on disk", "cpu": "; experts in CPU RAM"}.get(p.experts, ""))
        rows.append((name, where, format_bytes(per), f"{ms:.2f}", p.bound + (f" (x{n})" if n > 1 else "")))
    for p in ((plan.embed,) if plan.embed else ()) + (plan.head,):
        extra = f", {plan.head_chunk_rows}-row chunks" if p is plan.head and p.kind in ("disk", "cpu->gpu") else ""
        rows.append((p.name, _KIND_TEXT[p.kind] + extra, format_bytes(p.nbytes), f"{p.ms:.2f}", p.bound))
    rows.append(("KV pool", f"{plan.kv_tier.upper()} RAM" if plan.kv_tier == "cpu" else "GPU", format_bytes(plan.kv_bytes),
                 "", f"{plan.workload.kv_tokens} tokens reserved"))
    if plan.workload.kv_cold_tokens:
        where = "CPU RAM (pinned), read per layer" if plan.kv_cold_tier == "cpu" else "disk, read per layer"
        rows.append(("KV cold tier", where, format_bytes(plan.kv_cold_bytes), "", f"{plan.workload.kv_cold_tokens} tokens"))
    for tier, nb in plan.staging.items():
        rows.append((f"staging ({tier})", f"{2} ring buffers", format_bytes(nb), "", ""))
    ep = plan.experts
    if ep is not None and ep.tier == "disk":
        rows.append(("expert cache", f"CPU RAM, {ep.policy.upper()}", format_bytes(ep.cache_bytes), "",
                     f"~{ep.hit_rate:.0%} hits (uniform routing)"))
    head = ("unit", "placement", "bytes", "ms/step", "bound")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    w = plan.workload
    lines.append("")
    budgets = f"cpu {format_bytes(plan.used('cpu'))} of {format_bytes(plan.budgets.cpu)}"
    if plan.budgets.gpu is not None:
        budgets += f"; gpu {format_bytes(plan.used('gpu'))} of {format_bytes(plan.budgets.gpu)}"
    lines.append(f"memory: {budgets}; disk read per step {format_bytes(plan.disk_bytes_per_step)}")
    lines.append(kv_memory_line(plan))
    lines.append(
        f"predicted: {plan.decode_ms:.1f} ms per decode step at batch {w.batch} ({plan.tok_s:.1f} tok/s), "
        f"prefill {plan.prefill_ms:.0f} ms for {w.batch} x {w.prompt_len} tokens; bound by {plan.bound}"
    )
    return "\n".join(lines)


def kv_memory_line(plan: "Plan") -> str:
    """The KV pool as the engine will report it (``MemoryReport``): reserved whole, in use 0 at
    start. A CPU pool's pages are backed as blocks are first written, so what the process holds at
    start is the rest of the plan; a GPU pool is allocated whole."""
    t = plan.kv_tier
    per_tok = plan.kv_bytes / max(plan.workload.kv_tokens, 1)
    backed = "backed as tokens are written" if t == "cpu" else "allocated whole"
    # what the engine's memory report will call resident once loaded: weights and buffers, not the
    # plan's activation estimate (heap the runtime takes as it computes) nor the unwritten pool
    start = plan.used(t) - plan.activations.get(t, 0) - (plan.kv_bytes if t == "cpu" else 0)
    return (f"KV: {format_bytes(plan.kv_bytes)} reserved for {plan.workload.kv_tokens} tokens ({backed}, "
            f"{format_bytes(per_tok)} per token), 0 B in use at start; resident at start on {t}: "
            f"{format_bytes(start)}")


def _expert_lines(plan: "Plan", shape: "ModelShape") -> list[str]:
    """Where expert bytes live and what a token reads (sparse layers whose experts stay apart)."""
    ep = plan.experts
    n = len(ep.layers)
    total = format_bytes(ep.expert_bytes)
    active = format_bytes(ep.active_bytes_per_token)
    # read from disk as the file stores them (a GGUF's blocks), held in another form in RAM: say both
    stored = ep.tier == "disk" and ep.read_bytes_per_expert != ep.bytes_per_expert
    each = format_bytes(ep.bytes_per_expert) + (f" in RAM, {format_bytes(ep.read_bytes_per_expert)} as stored"
                                                 if stored else "")
    lines = [
        f"experts: {n} sparse layers x {ep.num_experts} experts of {each} = {total}; "
        f"a token uses {ep.top_k} of {ep.num_experts} per layer, {active} of expert weights "
        f"({ep.top_k / max(ep.num_experts, 1):.1%})"
    ]
    if ep.tier == "disk":
        on_disk = format_bytes(sum(p.bytes_by_tier().get("disk", 0) for p in plan.layers))  # as stored, per layer
        lines.append(
            f"experts stay on disk ({on_disk}); every other weight is resident, and a step reads only the experts its "
            f"tokens were routed to into a {format_bytes(ep.cache_bytes)} RAM cache ({ep.policy.upper()}, the budget "
            f"left): ~{ep.hit_rate:.0%} hits with uniform routing, so ~{format_bytes(ep.read_bytes_per_token)} "
            f"read per token from disk (streaming these layers whole would read {total} per step)")
    else:
        lines.append(f"--cpu-moe: the experts ({total}) stay in CPU RAM and are computed by the CPU; a token's "
                     f"hidden state goes there and back per sparse layer, the weights never cross")
    return lines


def explain_lines(plan: "Plan", shape: "ModelShape") -> list[str]:
    """Why this plan: budgets, measured speeds, resource times, runners-up."""
    bw = plan.bandwidths
    out = [
        f"model: {len(shape.layers)} layers of {format_bytes(max((u.nbytes for u in shape.layers), default=0))}, "
        f"{'tied embeddings/LM head' if shape.tied else 'embeddings + LM head'} {format_bytes(shape.head.nbytes + (shape.embed.nbytes if shape.embed else 0))}, "
        f"total {format_bytes(shape.weight_bytes)}",
        f"measured: RAM {bw.mem_gbps:.1f} GB/s, disk read {bw.disk_read_gbps:.2f} GB/s"
        + (f", host-to-device {bw.h2d_gbps:.1f} GB/s" if bw.h2d_gbps else "")
        + ", CPU " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in bw.cpu_gflops.items()),
    ]
    fits_cpu = shape.weight_bytes + plan.kv_bytes <= plan.budgets.cpu
    ep = plan.experts
    if ep is not None:
        out.extend(_expert_lines(plan, shape))
    if not plan.needs_streaming:
        out.append("everything fits its tier's budget, so nothing streams: weights are read from memory only")
    elif ep is not None and not any(p.kind in ("disk", "cpu->gpu") for p in plan.layers):
        pass  # only the experts stay apart (said above)
    else:
        out.append(
            f"the weights ({format_bytes(shape.weight_bytes)}) do not fit the budgets"
            + ("" if fits_cpu or plan.budgets.has_gpu else f" (cpu {format_bytes(plan.budgets.cpu)})")
            + f", so {format_bytes(plan.streamed_bytes_per_step)} stream each step; "
            "resident layers are spread between streamed ones so their compute overlaps the reads"
        )
    r = plan.resources_ms
    out.append(
        "per decode step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.items() if v)
        + f" -> max {plan.decode_ms:.1f} ms (prefetch overlaps them); bound: {plan.bound}"
    )
    if plan.head.kind == "disk":
        out.append(
            f"the LM head streams in {plan.head_chunk_rows}-row chunks (one ring buffer each) because it is larger than "
            "what is left of the budget"
        )
    if plan.embed is not None and plan.embed.kind == "disk":
        out.append(f"embeddings stay on disk ({plan.embed.ms:.2f} ms a step): a step reads only the rows of its "
                   "tokens, or the whole table where it is kept quantized (no rows to read alone)")
    w = plan.workload
    kv_home = "GPU memory" if plan.kv_tier == "gpu" else "CPU RAM"
    if w.kv_cold_tokens:
        cold = "pinned CPU RAM" if plan.kv_cold_tier == "cpu" else "a file in the offload folder"
        out.append(
            f"KV: {w.kv_tokens} tokens hot in {kv_home}, {w.kv_cold_tokens} more cold in {cold} "
            f"({format_bytes(plan.kv_cold_bytes)}); older full blocks move there when the hot pool is full and "
            "attention reads them back one layer ahead (those reads are not in the step times above)"
        )
    else:
        out.append(f"KV: {w.kv_tokens} tokens in {kv_home} (--kv-offload-tokens adds a cold tier beyond them)")
    alts = [a for a in plan.alternatives[1:4]]
    if alts:
        out.append("runners-up (decode ms/step): " + "; ".join(f"[{d}] {ms:.1f}" for d, ms in alts))
    return out
