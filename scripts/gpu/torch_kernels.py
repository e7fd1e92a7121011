#!/usr/bin/env python3
"""The engine's CUDA kernels against torch, on the GPU machine (the `torch` stage of
scripts/gpu-check).

Loads the PTX that `cuda_ptx_check sm_90a --write FILE` produced (every kernel of the engine,
compiled by NVRTC exactly as the backend compiles them), launches each kernel through the CUDA
driver API (ctypes) on torch tensors, and compares its output with the same operation written
in torch (float64 where it matters). Writes a JSON report (one row per kernel and case) and
exits non-zero when a case fails.

    python3 scripts/gpu/torch_kernels.py --ptx kernels.ptx --out kernels_torch.json
"""
import argparse
import ctypes
import json
import math
import sys

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Driver:
    """The few driver calls the harness needs, on torch's current context and stream."""

    def __init__(self, ptx: bytes):
        self.cu = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")  # makes torch's (primary) context current
        self.module = ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(ptx)), "cuModuleLoadData")
        self.funcs = {}

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def func(self, name, smem=0):
        if name not in self.funcs:
            f = ctypes.c_void_p()
            self.check(self.cu.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), f"loading {name}")
            if smem > 48 * 1024:
                self.check(
                    self.cu.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    f"shared memory of {name}",
                )
            self.funcs[name] = f
        return self.funcs[name]

    def launch(self, name, grid, block, args, smem=0):
        f = self.func(name, smem)
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                values.append(ctypes.c_void_p(0))
            else:
                values.append(a)  # already a ctypes scalar
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.check(
            self.cu.cuLaunchKernel(f, g[0], g[1], g[2], b[0], b[1], b[2], smem, stream, params, None),
            f"launching {name}",
        )
        torch.cuda.synchronize()


I = ctypes.c_int
F = ctypes.c_float
L = ctypes.c_longlong


class Report:
    def __init__(self):
        self.rows = []

    def add(self, kernel, case, got, want, tol):
        got = got.double()
        want = want.double()
        same_shape = tuple(got.shape) == tuple(want.shape)
        diff = (got - want).abs().max().item() if same_shape and got.numel() else float("inf")
        finite = bool(torch.isfinite(got).all().item())
        ok = same_shape and finite and diff <= tol
        self.rows.append({"kernel": kernel, "case": case, "elements": got.numel(), "max_abs_diff": diff,
                          "max_abs_ref": want.abs().max().item() if want.numel() else 0.0, "tol": tol, "pass": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {kernel:28s} {case:48s} max|d| {diff:.3e} (tol {tol:.1e})", file=sys.stderr)


def bf16_round(t):
    return t.to(torch.bfloat16).float()


def bf16_bits(t):
    """bf16 tensor as the int16 bit pattern the kernels read (bf16_t = unsigned short)."""
    return t.to(torch.bfloat16).contiguous()


def decode_rows(lengths, bs, dev):
    """Block tables for one decode row per sequence of `lengths` keys, over scattered blocks:
    (blocks in the pool, flat tables, each row's table start, and as device tensors the flat
    tables, table starts, positions and the token list)."""
    nblocks = sum((n + bs - 1) // bs for n in lengths) + 1
    perm = torch.randperm(nblocks, device=dev).tolist()
    tables_flat, starts, at = [], [], 0
    for n in lengths:
        starts.append(len(tables_flat))
        k = (n + bs - 1) // bs
        tables_flat += perm[at:at + k]
        at += k
    i32 = dict(dtype=torch.int32, device=dev)
    return (nblocks, tables_flat, starts, torch.tensor(tables_flat, **i32), torch.tensor(starts, **i32),
            torch.tensor([n - 1 for n in lengths], **i32), torch.arange(len(lengths), **i32))


def decode_attention_ref(q, pool, tables_flat, starts, lengths, lo, layer, bs, nkv, hd):
    """float64 attention of each row's q heads ([rows, nq * hd]) over keys lo[r] .. lengths[r]
    of its table in `pool` ([blocks, layers, 2, bs, nkv * hd])."""
    rows = len(lengths)
    grp = q.shape[1] // (nkv * hd)
    want = torch.zeros(rows, q.shape[1], dtype=torch.float64, device=q.device)
    for r, n in enumerate(lengths):
        tab = tables_flat[starts[r]:starts[r] + (n + bs - 1) // bs]
        keys = range(lo[r], n)
        ks = torch.stack([pool[tab[x // bs], layer, 0, x % bs] for x in keys]).double()
        vs = torch.stack([pool[tab[x // bs], layer, 1, x % bs] for x in keys]).double()
        qr = q[r].double().view(nkv, grp, hd)
        sc = torch.einsum("kgd,nkd->kgn", qr, ks.view(-1, nkv, hd)) / math.sqrt(hd)
        a = torch.softmax(sc, -1)
        want[r] = torch.einsum("kgn,nkd->kgd", a, vs.view(-1, nkv, hd)).reshape(-1)
    return want


def check_attention_decode(drv, rep, rand, dev):
    """The tensor-core decode kernel (one token per row, transposed products) at every group
    size it serves (1-16 q heads per KV head: one or two n8 tiles), both head sizes, 1 and 3
    splits, full and sliding-window rows, against float64 attention over the bf16 pool."""
    bs, layers, layer = 16, 2, 1
    lengths = [1, 17, 64, 65, 300, 1000]  # keys per row: one, partial and whole runs of 64
    for nq, nkv, hd in ((16, 8, 128), (8, 8, 64), (32, 8, 128), (64, 8, 128), (40, 4, 64), (16, 1, 128)):
        grp = nq // nkv
        kvd = nkv * hd
        row = (nq + 2 * nkv) * hd
        nblocks, tables_flat, starts, tables, table_start, positions, token_list = decode_rows(lengths, bs, dev)
        pool = rand(nblocks, layers, 2, bs, kvd).to(torch.bfloat16)
        rows = len(lengths)
        qkv = rand(rows, row, scale=2.0)
        scale = 1.0 / math.sqrt(hd)
        kern = f"attention_decode_f32_n{8 if grp <= 8 else 16}_hd{hd}"
        for window in (1 << 30, 40):
            lo = [max(0, n - window) for n in lengths]
            lo_pos = torch.tensor(lo, dtype=torch.int32, device=dev)
            want = decode_attention_ref(qkv[:, : nq * hd], pool, tables_flat, starts, lengths, lo, layer, bs, nkv, hd)
            vmax = pool.float().abs().max().item()
            for splits in (1, 3):
                part_acc = torch.zeros(rows * nkv * splits * grp * hd, device=dev)
                part_ml = torch.zeros(rows * nkv * splits * grp * 2, device=dev)
                counters = torch.zeros(rows * nkv, dtype=torch.int32, device=dev)
                out = torch.zeros(rows, nq * hd, device=dev)
                drv.launch(kern, (rows, nkv, splits), (128,),
                           [out, qkv, I(row), pool, tables, table_start, positions, lo_pos, token_list, I(nq),
                            I(nkv), I(grp), I(bs), I(layer), I(layers), F(scale), part_acc, part_ml, counters,
                            L(0)], smem=2 * 2 * 64 * (hd + 8) * 2)
                wname = "full" if window > 1 << 20 else f"window {window}"
                rep.add(kern, f"group {grp} ({nq}/{nkv}), {wname}, {splits} split(s)", out, want, vmax / 256)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptx", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.ptx, "rb") as f:
        ptx = f.read() + b"\0"
    drv = Driver(ptx)
    rep = Report()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.rand(*shape, generator=g, device=dev) * 2 - 1) * scale

    # --- embedding (bf16 table) ---
    V, H, T = 1000, 1024, 37
    table = rand(V, H)
    ids = torch.randint(0, V, (T,), generator=g, device=dev, dtype=torch.int32)
    out = torch.empty(T, H, device=dev)
    drv.launch("embedding_bf16", (T,), (256,), [out, bf16_bits(table), ids, I(H)])
    rep.add("embedding_bf16", f"{T} ids, hidden {H}", out, bf16_round(table)[ids.long()], 0.0)

    # --- rms_norm with the fused residual add ---
    eps = 1e-6
    x = rand(T, H, scale=3.0)
    res = rand(T, H)
    w = rand(H)
    xd = x.clone()
    out = torch.empty(T, H, device=dev)
    drv.launch("rms_norm_f32", (T,), (256,), [out, xd, res, w, I(H), F(eps), L(0), L(0)])
    v = (x + res).double()
    want = w.double() * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    rep.add("rms_norm_f32", "with residual: normed rows", out, want, 1e-5 * want.abs().max().item())
    rep.add("rms_norm_f32", "with residual: x += residual", xd, x + res, 0.0)

    # --- qk_norm_rope (Qwen3: per-head RMSNorm, then rotate_half RoPE) ---
    nq, nkv, hd = 16, 8, 128
    row = (nq + 2 * nkv) * hd
    qkv = rand(T, row, scale=2.0)
    pos = torch.randint(0, 6000, (T,), generator=g, device=dev, dtype=torch.int32)
    theta = 1_000_000.0
    inv = (1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=dev) / hd))).float()
    qn, kn = rand(hd), rand(hd)
    got = qkv.clone()
    drv.launch("qk_norm_rope_f32", (T, nq + nkv), (64,), [got, I(row), I(nq), I(hd), pos, inv, qn, kn, F(eps)])
    heads = qkv[:, : (nq + nkv) * hd].reshape(T, nq + nkv, hd)
    nw = torch.cat([qn.expand(nq, hd), kn.expand(nkv, hd)])
    normed = nw * (heads * torch.rsqrt((heads * heads).mean(-1, keepdim=True) + eps))
    ang = pos.float()[:, None] * inv[None, :]  # f32 angles, as transformers
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-normed[..., hd // 2:], normed[..., : hd // 2]], -1)
    want = qkv.clone()
    want[:, : (nq + nkv) * hd] = (normed * cos + rot * sin).reshape(T, -1)
    rep.add("qk_norm_rope_f32", "q/k norm + rope, positions < 6000", got, want, 2e-4)

    # --- silu_mul ---
    im = 3072
    gu = rand(T, 2 * im, scale=4.0)
    out = torch.empty(T, im, device=dev)
    # The backend's grid (ops.rs): x over column pairs, y over rows.
    drv.launch("silu_mul_f32", ((im // 2 + 255) // 256, min(T, 65535)), (256,), [out, gu, I(T), I(im), L(0), L(0)])
    # Gate and up interleaved (column 2c gate c, 2c + 1 up c), as the backend lays them out.
    want = torch.nn.functional.silu(gu[:, 0::2].double()) * gu[:, 1::2].double()
    rep.add("silu_mul_f32", f"{T} rows of {im}", out, want, 1e-5 * want.abs().max().item())

    # --- paged KV pool, kv_write, attention (decode rows, chunks over a cached prefix) ---
    bs, layers, layer, nblocks = 16, 2, 1, 32
    kvd = nkv * hd
    seqs = [(list(range(0, 7)), 100, 101), (list(range(7, 13)), 40, 90), (list(range(13, 16)), 0, 33)]
    toks = [(s, p) for s, (_, lo, hi) in enumerate(seqs) for p in range(lo, hi)]
    T2 = len(toks)
    tables_flat, starts = [], []
    for tab, _, _ in seqs:
        starts.append(len(tables_flat))
        tables_flat += tab
    tables = torch.tensor(tables_flat, dtype=torch.int32, device=dev)
    table_start = torch.tensor([starts[s] for s, _ in toks], dtype=torch.int32, device=dev)
    positions = torch.tensor([p for _, p in toks], dtype=torch.int32, device=dev)
    token_block = torch.tensor([seqs[s][0][p // bs] for s, p in toks], dtype=torch.int32, device=dev)
    qkv2 = rand(T2, row)
    for dtype, name in ((torch.float32, "kv_write_f32"), (torch.bfloat16, "kv_write_bf16")):
        pool = rand(nblocks, layers, 2, bs, kvd).to(dtype)
        want = pool.clone()
        for i, (s, p) in enumerate(toks):
            b = seqs[s][0][p // bs]
            want[b, layer, 0, p % bs] = qkv2[i, nq * hd: nq * hd + kvd].to(dtype)
            want[b, layer, 1, p % bs] = qkv2[i, nq * hd + kvd: nq * hd + 2 * kvd].to(dtype)
        drv.launch(name, (T2,), (256,), [pool, qkv2, I(row), I(nq * hd), I(kvd), token_block, positions,
                                         I(bs), I(layer), I(layers)])
        rep.add(name, f"{T2} tokens into a {dtype} pool", pool.float(), want.float(), 0.0)
        if dtype == torch.float32:
            pool32 = pool
        else:
            pool16 = pool

    def attention_ref(pool, window):
        outs = torch.zeros(T2, nq * hd, dtype=torch.float64, device=dev)
        grp = nq // nkv
        for i, (s, p) in enumerate(toks):
            tab = seqs[s][0]
            lo = max(0, p + 1 - window)
            ks = torch.stack([pool[tab[x // bs], layer, 0, x % bs] for x in range(lo, p + 1)]).double()
            vs = torch.stack([pool[tab[x // bs], layer, 1, x % bs] for x in range(lo, p + 1)]).double()
            for h in range(nq):
                kh = h // grp
                q = qkv2[i, h * hd:(h + 1) * hd].double()
                sc = ks[:, kh * hd:(kh + 1) * hd] @ q / math.sqrt(hd)
                a = torch.softmax(sc, 0)
                outs[i, h * hd:(h + 1) * hd] = a @ vs[:, kh * hd:(kh + 1) * hd]
        return outs

    scale = 1.0 / math.sqrt(hd)
    grp = nq // nkv
    for window in (1 << 30, 8):
        lo_pos = torch.tensor([max(0, p + 1 - window) for _, p in toks], dtype=torch.int32, device=dev)
        wname = "full causal" if window > 1 << 20 else f"sliding window {window}"
        want = attention_ref(pool32.float(), window)
        for splits in (1, 4):
            part_acc = torch.zeros(T2 * nkv * splits * grp * hd, device=dev)
            part_ml = torch.zeros(T2 * nkv * splits * grp * 2, device=dev)
            counters = torch.zeros(T2 * nkv, dtype=torch.int32, device=dev)
            out = torch.zeros(T2, nq * hd, device=dev)
            drv.launch("attention_fast_f32_f32_e4_g2", (T2, nkv, splits), (128,),
                       [out, qkv2, I(row), pool32, tables, table_start, positions, lo_pos, I(nq), I(nkv), I(hd),
                        I(bs), I(layer), I(layers), F(scale), part_acc, part_ml, counters, L(0), None],
                       smem=4 * grp * hd * 4)
            rep.add("attention_fast (f32 pool)", f"{wname}, {splits} split(s)", out, want, 1e-5)
        # Tensor-core prefill over the bf16 pool: tiles of 32 tokens of one sequence.
        want16 = attention_ref(pool16.float(), window)
        tiles = []
        first = 0
        for _, lo, hi in seqs:
            n = hi - lo
            for a in range(0, n, 64 // grp):
                tiles += [first + a, min(64 // grp, n - a)]
            first += n
        tiles_t = torch.tensor(tiles, dtype=torch.int32, device=dev)
        out = torch.zeros(T2, nq * hd, device=dev)
        smem = 2 * 2 * 64 * (hd + 8) * 2
        drv.launch("attention_prefill_f32_hd128", (len(tiles) // 2, nkv), (128,),
                   [out, qkv2, I(row), pool16, tables, table_start, positions, lo_pos, tiles_t, I(nq), I(nkv),
                    I(grp), I(bs), I(layer), I(layers), F(scale), L(0)], smem=smem)
        vmax = pool16.float().abs().max().item()
        rep.add("attention_prefill (bf16 pool)", f"{wname}, {len(tiles) // 2} tiles", out, want16, vmax / 256)

    check_attention_decode(drv, rep, rand, dev)

    # --- gemv (bf16 weights and rows, 1 or 2 rows; one row by _early_: first weights before the PDL wait) ---
    for m, k, n in ((1, 1024, 4096), (2, 3072, 1024), (1, 1000, 77)):
        xb = bf16_bits(rand(m, k))
        wb = bf16_bits(rand(n, k))
        want = xb.double() @ wb.double().T
        kern = "gemv_early_bf16_m1" if m == 1 else f"gemv_bf16_m{m}"
        out = torch.empty(m, n, device=dev)
        drv.launch(kern, ((n + 7) // 8,), (256,), [out, xb, wb, I(m), I(n), I(k)])
        rep.add(kern, f"{m}x{k}x{n}", out, want, 1e-3)

    # --- argmax (split over blocks, merged by the last) with planted ties ---
    R, V = 5, 151936
    logits = rand(R, V)
    logits[2, 70000] = 50.0
    logits[2, 90000] = 50.0
    logits[4, V - 1] = 60.0
    ids_out = torch.zeros(R, dtype=torch.int32, device=dev)
    part_v = torch.zeros(R * 32, device=dev)
    part_i = torch.zeros(R * 32, dtype=torch.int32, device=dev)
    counters = torch.zeros(R, dtype=torch.int32, device=dev)
    for rnd in ("", ", again"):
        drv.launch("argmax_f32", (R, 32), (256,), [ids_out, logits, I(V), part_v, part_i, counters])
        rep.add("argmax_f32", f"{R} rows of {V}, ties{rnd}", ids_out, torch.argmax(logits, -1), 0.0)

    # --- sampling: the CPU sampler's rules written in torch, the same uniforms ---
    def torch_sample(row, p):
        l = row.clone()
        if p["rep"] != 1.0:
            idx = torch.tensor(p["seen"], dtype=torch.long, device=dev)
            v = l[idx]
            l[idx] = torch.where(v > 0, v / p["rep"], v * p["rep"])
        for t, c in p["counts"]:
            l[t] -= p["freq"] * c + p["pres"]
        for t in p["masked"]:
            l[t] = float("-inf")
        if p["greedy"]:
            return int(torch.argmax(l).item())
        l = l * (1.0 / p["temp"])  # f32, as the sampler
        mx = l.max()
        prob = torch.exp((l - mx).double())
        if p["top_k"] == 0 and p["top_p"] >= 1.0 and p["min_p"] <= 0.0:
            cdf = torch.cumsum(prob, 0)
            return int(torch.searchsorted(cdf, p["u"] * cdf[-1], right=True).clamp(max=V - 1).item())
        ids = torch.arange(V, device=dev)
        keep = torch.isfinite(l)
        order = sorted(zip((-l[keep]).tolist(), ids[keep].tolist()))  # value desc, id asc
        cand = torch.tensor([i for _, i in order], device=dev)
        if 0 < p["top_k"] < len(cand):
            cand = cand[: p["top_k"]]
        pc = prob[cand]
        if p["top_p"] < 1.0:
            cum = torch.cumsum(pc, 0)
            n = int((cum < p["top_p"] * pc.sum()).sum().item()) + 1
            cand, pc = cand[:n], pc[:n]
        if p["min_p"] > 0.0:
            n = max(1, int((pc >= p["min_p"] * pc[0]).sum().item()))
            cand, pc = cand[:n], pc[:n]
        cum = torch.cumsum(pc, 0)
        k = int((cum <= p["u"] * cum[-1]).sum().item())
        return int(cand[min(k, len(cand) - 1)].item())

    base = dict(greedy=False, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, freq=0.0, pres=0.0, seen=[],
                counts=[], masked=[])
    kinds = [
        ("greedy + repetition + mask", dict(greedy=True, rep=1.3, seen=[i * 499 % V for i in range(300)], masked=[7])),
        ("temperature 0.7", dict(temp=0.7)),
        ("top_k 50", dict(top_k=50)),
        ("top_p 0.9", dict(top_p=0.9)),
        ("min_p 0.05", dict(min_p=0.05)),
        ("top_k 40 + top_p 0.8 + min_p 0.02 + penalties",
         dict(top_k=40, top_p=0.8, min_p=0.02, temp=0.9, freq=0.5, pres=0.3, counts=[(11, 3), (500, 1)])),
    ]
    per = 4
    plans, rows = [], []
    for _, kw in kinds:
        for _ in range(per):
            p = dict(base, **kw)
            p["u"] = float(torch.rand(1, generator=g, device=dev, dtype=torch.float64).item())
            plans.append(p)
            r = rand(V, scale=3.0)
            hot = torch.randint(0, V, (20,), generator=g, device=dev)
            r[hot] = 8.0 + torch.arange(20, device=dev, dtype=torch.float32) * 0.25
            rows.append(r)
    logits = torch.stack(rows)
    want = torch.tensor([torch_sample(r, p) for r, p in zip(logits, plans)], device=dev)
    fp = torch.tensor([[p["temp"], p["top_p"], p["min_p"], p["rep"], p["freq"], p["pres"]] for p in plans],
                      device=dev)
    ip = torch.tensor([[int(p["greedy"]), p["top_k"]] for p in plans], dtype=torch.int32, device=dev)
    us = torch.tensor([p["u"] for p in plans], dtype=torch.float64, device=dev)

    def lists(key, flat):
        off, vals = [0], []
        for p in plans:
            vals += flat(p[key])
            off.append(len(vals) // (2 if key == "counts" else 1))
        return (torch.tensor(off, dtype=torch.int32, device=dev),
                torch.tensor(vals or [0], dtype=torch.int32, device=dev))

    seen_off, seen = lists("seen", lambda v: list(v))
    count_off, counts = lists("counts", lambda v: [x for tc in v for x in tc])
    mask_off, masked = lists("masked", lambda v: list(v))
    got = torch.zeros(len(plans), dtype=torch.int32, device=dev)
    drv.launch("sample_rows_f32", (len(plans),), (1024,),
               [got, logits.clone(), I(V), fp, ip, us, seen_off, seen, count_off, counts, mask_off, masked])
    for k, (name, _) in enumerate(kinds):
        sl = slice(k * per, (k + 1) * per)
        rep.add("sample_rows_f32", name, got[sl], want[sl], 0.0)

    # --- gather_rows, fold_rows, bias_add ---
    src = rand(40, H)
    sel = torch.tensor([3, 39, 0, 3], dtype=torch.int32, device=dev)
    out = torch.empty(4, H, device=dev)
    drv.launch("gather_rows_f32", (4,), (256,), [out, src, sel, I(H), L(0)])
    rep.add("gather_rows_f32", "4 of 40 rows", out, src[sel.long()], 0.0)
    xf = rand(2 * T * H)
    got = xf.clone()
    drv.launch("fold_rows_f32", (64,), (256,), [got, L(T * H)])
    rep.add("fold_rows_f32", "hi + lo halves", got[: T * H], xf[: T * H] + xf[T * H:], 0.0)
    xb = rand(T, H)
    bias = rand(H)
    got = xb.clone()
    drv.launch("bias_add_f32", (64,), (256,), [got, bias, I(T), I(H)])
    rep.add("bias_add_f32", f"{T} rows", got, xb + bias, 0.0)

    ok = all(r["pass"] for r in rep.rows)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": rep.rows,
              "all_pass": ok}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{sum(r['pass'] for r in rep.rows)}/{len(rep.rows)} cases pass -> {'PASS' if ok else 'FAIL'}",
          file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
