//! Launch wrappers of the paged attention kernels: `attention_fast` (any row), the tensor-core
//! prefill tiles and the step dispatcher (the tensor-core decode rows: `attention_decode.rs`).

use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};

use super::attention_scratch::AttentionScratch;
use super::cluster_launch::RawParams;
use super::kernels::{AttentionInstance, KvProgram};
use super::{
    bad, check_len, cuda_err, to_i32, Balance, CudaDevice, DevAddr, DeviceElem, KvPool,
    PieceSchedule, PoolShape, TileSlots, TokenMaps,
};
use crate::error::EngineError;

/// What every paged attention launch reads: the step's `qkv` rows (`row_stride` apart, the q
/// heads first), `nq` q heads over the pool's KV heads, `layer` of `pool` (laid out as
/// `shape`; this step's K/V written already), the step's token maps and the softmax scale.
#[derive(Clone, Copy)]
pub struct AttentionInputs<'a> {
    pub qkv: &'a CudaSlice<f32>,
    /// The q heads in 16-bit rows of the same stride instead
    /// ([`CudaDevice::qk_norm_rope_kv_q16`]): read by the warpgroup prefill tiles, for steps
    /// of prefill tiles alone.
    pub q16: Option<&'a CudaSlice<u16>>,
    pub row_stride: usize,
    pub nq: usize,
    pub pool: &'a KvPool,
    pub shape: PoolShape,
    pub layer: usize,
    pub maps: &'a TokenMaps,
    pub scale: f32,
}

impl CudaDevice {
    /// Paged attention (`attention_fast.cu`) of every token of `a.maps` over positions
    /// `lo_pos ..= pos` of its sequence (`out` is `[tokens, nq * head_dim]`): one block per
    /// (token, KV head) serving the whole q-head group, warps over positions, and for few
    /// (token, head) pairs the positions split over several blocks merged in the same launch.
    /// `out` is f32 or bf16 (the o_proj GEMM's input).
    pub fn attention_fast<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        scratch: &mut AttentionScratch,
        split: bool,
    ) -> Result<(), EngineError> {
        self.attention_fast_rows(out, a, scratch, split, None)
    }

    /// The attention of a step: with tiles in `maps` (see [`TokenMaps::tile_tokens`]) the
    /// prefill chunks on tensor cores and the single-token rows by the tensor-core decode
    /// kernel or `attention_fast`, else every token by `attention_fast`.
    pub fn attention<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        scratch: &mut AttentionScratch,
        split: bool,
    ) -> Result<(), EngineError> {
        let maps = a.maps;
        if maps.tile_tokens == 0 {
            return self.attention_fast(out, a, scratch, split);
        }
        if a.q16.is_some() && (maps.n_singles > 0 || maps.pieces.is_none()) {
            return Err(bad(
                "attention: 16-bit q rows are read only by the warpgroup prefill tiles (a step \
                 without decode rows)"
                    .into(),
            ));
        }
        if maps.n_tiles > 0 {
            self.attention_prefill(out, a, scratch, split)?;
        }
        if maps.n_singles == 0 {
            return Ok(());
        }
        if maps.decode_tc {
            let nkv = a.shape.num_kv_heads;
            let (pairs, group) = (maps.n_singles * nkv, a.nq / nkv.max(1));
            // The half-KV program has cluster variants for both its outputs; the main
            // program's kernels stand for them in the choice (the same code).
            let chosen_as = if matches!(a.pool, KvPool::Half(_) | KvPool::Fp8(_)) {
                "bf16"
            } else {
                O::SUFFIX
            };
            let launch = scratch.decode_launch(self, pairs, chosen_as, group, a.shape.head_dim)?;
            self.attention_decode(out, a, scratch, split, launch)
        } else {
            let rows = Some((&maps.singles, maps.n_singles));
            self.attention_fast_rows(out, a, scratch, split, rows)
        }
    }

    /// Whether [`CudaDevice::attention_prefill`] serves this shape: a 16-bit pool (the
    /// program's bf16 or f16, or f16 beside bf16 weights), head_dim 64
    /// or 128; the tokens per tile then (128 rows of (token, q head) pairs).
    pub fn prefill_tile_tokens(pool16: bool, head_dim: usize, group: usize) -> Option<usize> {
        (pool16 && matches!(head_dim, 64 | 128) && (1..=FA_ROWS).contains(&group))
            .then_some(FA_ROWS / group)
    }

    /// Where the tiles of a prefill attention launch at `head_dim` over `nkv` KV heads go
    /// (see [`TileSlots`]): the blocks of the kernel that serves 16-bit pools resident per SM,
    /// and the SMs over the KV heads.
    pub fn prefill_tile_slots(
        &self,
        head_dim: usize,
        nkv: usize,
        fp8: bool,
    ) -> Result<TileSlots, EngineError> {
        // The FP8 program's kernels have the main program's shape and shared memory.
        let (kind, smem) = self.prefill_kernel(head_dim, fp8);
        let f = self.loaded(&format!("attention_prefill_{kind}bf16_hd{head_dim}"))?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(128, smem as usize, None)
            .map_err(cuda_err("attention_prefill occupancy"))?;
        Ok(TileSlots {
            per_sm: per_sm as usize,
            sms: self.sm_count() / nkv.max(1),
        })
    }

    /// The prefill tile kernel at `head_dim` (its name's kind part) and its dynamic shared
    /// memory: the warpgroup kernel where the device has it, except over FP8 pools (their runs
    /// are dequantised into the padded slot layout) and at head_dim 64, which keep mma.sync.
    fn prefill_kernel(&self, head_dim: usize, fp8: bool) -> (&'static str, u32) {
        if self.prefill_wgmma && !fp8 && head_dim == 128 {
            ("wg_", prefill_wg_smem_bytes(head_dim))
        } else {
            ("", prefill_smem_bytes(head_dim))
        }
    }

    /// Whether the prefill tiles at `head_dim` (over an FP8 pool or not) go to the warpgroup
    /// kernel, which takes them as a [`super::PieceSchedule`] (see [`TokenMaps::pieces`]).
    pub fn prefill_takes_pieces(&self, head_dim: usize, fp8: bool) -> bool {
        self.prefill_kernel(head_dim, fp8).0 == "wg_"
    }

    /// [`TokenMaps::pieces`] for prefill tiles at `head_dim` over `nkv` KV heads of a 16-bit
    /// pool where the warpgroup kernel takes them (else none): balanced over every block the
    /// GPU holds at once, unless [`super::switches::PREFILL_SCHEDULE_ENV`] asks otherwise.
    pub fn prefill_piece_schedule(
        &self,
        head_dim: usize,
        nkv: usize,
    ) -> Result<Option<PieceSchedule>, EngineError> {
        if !self.prefill_takes_pieces(head_dim, false) {
            return Ok(None);
        }
        let balance = match super::switches::prefill_piece_costs()? {
            Some((min_runs, piece_runs)) => {
                let slots = self.prefill_tile_slots(head_dim, nkv, false)?;
                Some(Balance {
                    blocks: slots.per_sm.max(1) * self.sm_count(),
                    min_runs,
                    piece_runs,
                })
            }
            None => None,
        };
        Ok(Some(PieceSchedule {
            heads: nkv,
            balance,
        }))
    }

    /// Causal attention of the tiles of `a.maps` (`attention_prefill.cu`: tensor cores, Q and
    /// P rounded to the program's 16-bit type, f32 accumulation), over a 16-bit pool; the
    /// warpgroup kernel's cut tiles keep their partial states in `scratch`.
    pub fn attention_prefill<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        scratch: &mut AttentionScratch,
        split: bool,
    ) -> Result<(), EngineError> {
        let (maps, nq) = (a.maps, a.nq);
        let tc = TcShape::check("attention_prefill", a)?;
        let (nkv, hd) = (tc.nkv, tc.hd);
        let Some(tile_tokens) = Self::prefill_tile_tokens(true, hd, tc.group) else {
            return Err(bad(format!(
                "attention_prefill: {nq} q heads over {nkv} KV heads (group ≤ {FA_ROWS})"
            )));
        };
        if maps.tile_tokens > tile_tokens {
            return Err(bad(format!(
                "attention_prefill: tiles of {} tokens (at most {tile_tokens})",
                maps.tile_tokens
            )));
        }
        check_len("attention qkv", a.qkv.len(), maps.tokens * a.row_stride)?;
        if let Some(q) = a.q16 {
            check_len("attention q16", q.len(), maps.tokens * a.row_stride)?;
        }
        let lo_off =
            super::ops::lo_offset::<O>("attention out", out.len(), maps.tokens * nq * hd, split)?;
        // The warpgroup kernel takes the same arguments, its schedule for the tiles and its
        // scratch.
        let (kind, smem) = self.prefill_kernel(hd, tc.fp8());
        let pieces = kind == "wg_";
        if pieces != maps.pieces.is_some_and(|p| p.heads == nkv) {
            return Err(bad(format!(
                "attention_prefill: the {} kernel over tiles laid out {} for {nkv} KV heads",
                if pieces { "warpgroup" } else { "mma.sync" },
                match maps.pieces {
                    Some(p) => format!("as a piece schedule of {} heads", p.heads),
                    None => "as pairs".to_string(),
                }
            )));
        }
        if a.q16.is_some() && !pieces {
            return Err(bad(
                "attention_prefill: 16-bit q rows are read only by the warpgroup kernel".into(),
            ));
        }
        let q = if a.q16.is_some() { "q16_" } else { "" };
        let name = tc.kernel(&format!("attention_prefill_{kind}{q}{}_hd{hd}", O::SUFFIX));
        let f = self.func(&name)?;
        let grid_dim = if pieces {
            scratch.ensure_prefill(self, maps.state_slots)?;
            (maps.piece_blocks as u32, 1, 1)
        } else {
            (maps.n_tiles as u32, nkv as u32, 1)
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(out);
        tc.push_args(&mut b, a, &maps.tiles);
        b.arg(&lo_off);
        if pieces {
            b.arg(&scratch.prefill_states).arg(&scratch.prefill_counts);
        }
        // SAFETY: signature matches; shapes checked above; the tiles were built with the
        // token maps (each within one sequence, tokens in range; the schedule's pieces cover
        // them, its state slots within the scratch ensured above); block ids were validated
        // by the caller.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching attention_prefill"))?;
        Ok(())
    }

    /// `attention_fast` over the listed rows (`rows`: the list and its length) or every token.
    fn attention_fast_rows<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        scratch: &mut AttentionScratch,
        split: bool,
        rows: Option<(&DevAddr, usize)>,
    ) -> Result<(), EngineError> {
        let t = a.maps.tokens;
        if t == 0 {
            return Ok(());
        }
        if matches!(a.pool, KvPool::Fp8(_)) {
            return Err(bad(
                "attention_fast: an fp8 pool is read only by the tensor-core kernels".into(),
            ));
        }
        if a.q16.is_some() {
            return Err(bad(
                "attention_fast: reads the f32 q rows (16-bit ones are the prefill tiles')".into(),
            ));
        }
        let group = fast_group(a)?;
        let (nkv, hd) = (a.shape.num_kv_heads, a.shape.head_dim);
        check_len("attention pool", a.pool.len(), a.shape.elems())?;
        check_len("attention qkv", a.qkv.len(), t * a.row_stride)?;
        let lo_off = super::ops::lo_offset::<O>("attention out", out.len(), t * a.nq * hd, split)?;
        // Blocks along x: the listed rows, or every token.
        let bx = rows.map_or(t, |(_, n)| n);
        let splits = scratch.splits_for(bx * nkv);
        if splits > 1 {
            scratch.ensure(self, bx * nkv * splits * group, hd, bx * nkv)?;
        }
        let ints = FastInts::of(a)?;
        let cfg = LaunchConfig {
            grid_dim: (bx as u32, nkv as u32, splits as u32),
            block_dim: (ATT_WARPS * 32, 1, 1),
            // The warps' states merge in [ATT_WARPS][group][head_dim] floats.
            shared_mem_bytes: (ATT_WARPS as usize * group * hd * 4) as u32,
        };
        let inst = attention_instance(a.pool.kernel_suffix(), O::SUFFIX, hd, group);
        let f = self.instance_func(inst)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out);
        ints.push_args(&mut b, a, scratch, &lo_off);
        // A null list: every token.
        let null: u64 = 0;
        match rows {
            Some((list, _)) => b.arg(list),
            None => b.arg(&null),
        };
        // SAFETY: signature matches; shapes checked above; with splits > 1 the scratch holds
        // every partial state and counter the launch touches (ensured above); block ids were
        // validated by the caller.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching attention_fast"))?;
        Ok(())
    }
}

/// The q heads per KV head of an `attention_fast.cu` launch, once the shape is one it serves
/// (whole groups of at most ATT_GMAX, head_dim at most ATT_HDMAX, the q heads within a row,
/// the layer in the pool).
fn fast_group(a: &AttentionInputs<'_>) -> Result<usize, EngineError> {
    let (nq, row_stride, layer) = (a.nq, a.row_stride, a.layer);
    let (nkv, hd) = (a.shape.num_kv_heads, a.shape.head_dim);
    if nkv == 0
        || !nq.is_multiple_of(nkv)
        || !(1..=ATT_GMAX).contains(&(nq / nkv))
        || hd > ATT_HDMAX
        || nq * hd > row_stride
        || layer >= a.shape.num_layers
    {
        return Err(bad(format!(
            "attention_fast: {nq} q heads over {nkv} KV heads (group ≤ {ATT_GMAX}), head_dim {hd} \
             (≤ {ATT_HDMAX}), row stride {row_stride}, layer {layer}"
        )));
    }
    Ok(nq / nkv)
}

/// The integer parameters of `attention_fast.cu`: row stride, nq, nkv, head_dim, block size,
/// layer, layers.
struct FastInts([i32; 7]);

impl FastInts {
    fn of(a: &AttentionInputs<'_>) -> Result<Self, EngineError> {
        let shape = a.shape;
        Ok(FastInts([
            to_i32("row stride", a.row_stride)?,
            to_i32("nq", a.nq)?,
            to_i32("nkv", shape.num_kv_heads)?,
            to_i32("head_dim", shape.head_dim)?,
            to_i32("block size", shape.block_size)?,
            to_i32("layer", a.layer)?,
            to_i32("layers", shape.num_layers)?,
        ]))
    }

    /// The kernel's parameters after `out` up to its row list, in their order.
    fn push_args<'b>(
        &'b self,
        b: &mut LaunchArgs<'b>,
        a: &'b AttentionInputs<'_>,
        scratch: &'b AttentionScratch,
        lo_off: &'b i64,
    ) {
        let (ints, maps) = (&self.0, a.maps);
        b.arg(a.qkv).arg(&ints[0]);
        match a.pool {
            KvPool::F32(p) => b.arg(p),
            KvPool::Bf16(p) | KvPool::Half(p) => b.arg(p),
            // Refused in `attention_fast_rows` before any argument is pushed.
            KvPool::Fp8(p) => b.arg(p),
        };
        b.arg(&maps.tables)
            .arg(&maps.table_start)
            .arg(&maps.positions)
            .arg(&maps.lo_pos);
        for v in &ints[1..] {
            b.arg(v);
        }
        b.arg(&a.scale)
            .arg(&scratch.part_acc)
            .arg(&scratch.part_ml)
            .arg(&scratch.counters)
            .arg(lo_off);
    }
}

/// What the two tensor-core kernels (`attention_prefill.cu`, `attention_decode.cu`) check and
/// take alike: a 16-bit pool, head_dim 64 or 128, whole q-head groups, and the arguments
/// between `out` and the kernel's own ones.
pub(super) struct TcShape<'a> {
    pool: PoolArg<'a>,
    /// An f16 pool beside bf16 weights, or an FP8 pool: the kernels come from that KV
    /// program.
    pub(super) program: Option<KvProgram>,
    pub(super) nkv: usize,
    pub(super) hd: usize,
    pub(super) group: usize,
    /// row stride, nq, nkv, group, block size, layer, layers.
    ints: [i32; 7],
}

impl<'a> TcShape<'a> {
    pub(super) fn check(kernel: &str, a: &AttentionInputs<'a>) -> Result<Self, EngineError> {
        let (nq, row_stride, layer, shape) = (a.nq, a.row_stride, a.layer, a.shape);
        let (nkv, hd) = (shape.num_kv_heads, shape.head_dim);
        let (p, program) = match a.pool {
            KvPool::Bf16(p) => (PoolArg::Wide(p), None),
            KvPool::Half(p) => (PoolArg::Wide(p), Some(KvProgram::HalfKv)),
            KvPool::Fp8(p) => (PoolArg::Fp8(p), Some(KvProgram::Fp8Kv)),
            KvPool::F32(_) => return Err(bad(format!("{kernel}: needs a 16-bit or fp8 pool"))),
        };
        let group = if nkv > 0 && nq.is_multiple_of(nkv) {
            nq / nkv
        } else {
            0
        };
        if !matches!(hd, 64 | 128)
            || group == 0
            || nq * hd > row_stride
            || layer >= shape.num_layers
        {
            return Err(bad(format!(
                "{kernel}: head_dim {hd} (64 or 128), {nq} q heads over {nkv} KV heads, row \
                 stride {row_stride}, layer {layer} of {}",
                shape.num_layers
            )));
        }
        check_len("attention pool", a.pool.len(), shape.elems())?;
        Ok(TcShape {
            pool: p,
            program,
            nkv,
            hd,
            group,
            ints: [
                to_i32("row stride", row_stride)?,
                to_i32("nq", nq)?,
                to_i32("nkv", nkv)?,
                to_i32("group", group)?,
                to_i32("block size", shape.block_size)?,
                to_i32("layer", layer)?,
                to_i32("layers", shape.num_layers)?,
            ],
        })
    }

    /// An FP8 pool (the FP8-KV program's kernels).
    pub(super) fn fp8(&self) -> bool {
        self.program == Some(KvProgram::Fp8Kv)
    }

    /// The entry point `name` (as the main program calls it) for this pool: with an f16 pool
    /// beside bf16 weights, or an FP8 pool, the KV program's, whose 16-bit output is split
    /// bf16 (`b16`; plain bf16 with no split offset).
    pub(super) fn kernel(&self, name: &str) -> String {
        match self.program {
            Some(p) => format!("{}{}", p.prefix(), name.replacen("_bf16_", "_b16_", 1)),
            None => name.to_string(),
        }
    }

    /// qkv, row stride, pool, the maps' tables / starts / positions / window starts, the
    /// kernel's token list (tiles or single rows), nq, nkv, group, block size, layer,
    /// layers, scale: the kernels' common parameters after `out`, in their order.
    pub(super) fn push_args<'b>(
        &'b self,
        b: &mut LaunchArgs<'b>,
        a: &'b AttentionInputs<'_>,
        list: &'b DevAddr,
    ) {
        let maps = a.maps;
        // 16-bit q rows only reach the warpgroup prefill tiles (`CudaDevice::attention`).
        match a.q16 {
            Some(q) => b.arg(q),
            None => b.arg(a.qkv),
        };
        b.arg(&self.ints[0]);
        match self.pool {
            PoolArg::Wide(p) => b.arg(p),
            PoolArg::Fp8(p) => b.arg(p),
        };
        b.arg(&maps.tables)
            .arg(&maps.table_start)
            .arg(&maps.positions)
            .arg(&maps.lo_pos)
            .arg(list);
        for v in &self.ints[1..] {
            b.arg(v);
        }
        b.arg(&a.scale);
    }

    /// [`Self::push_args`] for a launch whose parameters go in by hand
    /// (`cluster_launch.rs`): the same values in the same order.
    pub(super) fn push_raw(
        &self,
        dev: &CudaDevice,
        p: &mut RawParams,
        a: &AttentionInputs<'_>,
        list: DevAddr,
    ) {
        let maps = a.maps;
        p.slice(dev, a.qkv).int(self.ints[0]);
        match self.pool {
            PoolArg::Wide(s) => p.slice(dev, s),
            PoolArg::Fp8(s) => p.slice(dev, s),
        };
        p.addr(maps.tables)
            .addr(maps.table_start)
            .addr(maps.positions)
            .addr(maps.lo_pos)
            .addr(list);
        for &v in &self.ints[1..] {
            p.int(v);
        }
        p.float(a.scale);
    }
}

/// The pool a tensor-core kernel reads: 16-bit elements, or FP8 bytes with their scales.
#[derive(Clone, Copy)]
enum PoolArg<'a> {
    Wide(&'a CudaSlice<u16>),
    Fp8(&'a CudaSlice<u8>),
}

/// The `attention_fast.cu` instance for a pool (its [`KvPool::kernel_suffix`]), an output
/// type suffix, a head size and a group size.
pub(super) fn attention_instance(
    pool: &'static str,
    out: &'static str,
    head_dim: usize,
    group: usize,
) -> AttentionInstance {
    let e = match head_dim.div_ceil(32) {
        1 => 1,
        2..=4 => 4,
        _ => 8,
    };
    AttentionInstance {
        pool,
        out,
        e,
        g: group,
    }
}

impl CudaDevice {
    /// Compiles and loads the `attention_fast` instance a model will launch, so that the first
    /// decode step does not wait for NVRTC (a worker does this before it reports ready).
    pub fn preload_attention(
        &self,
        pool: &'static str,
        out: &'static str,
        head_dim: usize,
        group: usize,
    ) -> Result<(), EngineError> {
        self.load_instance(attention_instance(pool, out, head_dim, group))
            .map(|_| ())
    }
}

/// Warps per block and the group / head size limits of `attention_fast.cu` (its ATT_* macros).
const ATT_WARPS: u32 = 4;
const ATT_GMAX: usize = 8;
const ATT_HDMAX: usize = 256;
/// Rows ((token, q head) pairs) per tile of `attention_prefill.cu` (its FA_BQ: 32 per warp).
const FA_ROWS: usize = 128;
/// Keys per run and row padding of `attention_prefill.cu` (FA_BK, FA_PAD).
pub(super) const FA_KEYS: usize = 64;
pub(super) const FA_PAD: usize = 8;

/// Two stages of K and V runs of `FA_KEYS` keys at `head_dim` in 16 bits (padded rows): the
/// shared memory both tensor-core attention kernels stage keys in.
pub(super) fn kv_stages_smem_bytes(head_dim: usize) -> u32 {
    (2 * 2 * FA_KEYS * (head_dim + FA_PAD) * 2) as u32
}

/// Dynamic shared memory of `attention_prefill.cu` at `head_dim`: the tile's Q rows in 16
/// bits, then two stages of K and V runs.
pub(super) fn prefill_smem_bytes(head_dim: usize) -> u32 {
    (FA_ROWS * (head_dim + FA_PAD) * 2) as u32 + kv_stages_smem_bytes(head_dim)
}

/// Dynamic shared memory of `attention_prefill_wg.cu` at `head_dim`: the same Q tile and two
/// stages of K and V runs, unpadded (the swizzled layout has no bank conflicts), plus 1 KiB
/// for rounding the start to the swizzle's 1024-byte boundary.
pub(super) fn prefill_wg_smem_bytes(head_dim: usize) -> u32 {
    ((FA_ROWS + 2 * 2 * FA_KEYS) * head_dim * 2 + 1024) as u32
}
