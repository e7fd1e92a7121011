//! Launch wrappers of the tensor-core decode attention (`attention_decode.cu`): the plain
//! kernel and its cluster variant.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::attention::{AttentionInputs, TcShape, FA_KEYS, FA_PAD};
use super::attention_scratch::{AttentionScratch, DecodeLaunch, MAX_CLUSTER, MAX_SPLITS};
use super::cluster_launch::{ClusterConfig, RawParams};
use super::{bad, check_len, cuda_err, CudaDevice, DeviceElem};
use crate::error::EngineError;

impl CudaDevice {
    /// The single-token rows of `a.maps` (decode) on tensor cores (`attention_decode.cu`, bf16
    /// pool, head_dim 64 or 128, at most 16 q heads per KV head): transposed products with the
    /// group's q heads on the narrow n8 side, the keys split over the block's four warps and
    /// over `launch.splits` blocks per (row, KV head), merged in the same launch (through
    /// global memory, or within a thread-block cluster with `launch.cluster`). Q and P are
    /// rounded to bf16.
    pub fn attention_decode<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        scratch: &mut AttentionScratch,
        split: bool,
        launch: DecodeLaunch,
    ) -> Result<(), EngineError> {
        let tc = TcShape::check("attention_decode", a)?;
        check_decode_launch::<O>(&tc, a.nq, launch)?;
        if a.q16.is_some() {
            return Err(bad(
                "attention_decode: reads the f32 q rows (16-bit ones are the prefill tiles')"
                    .into(),
            ));
        }
        let maps = a.maps;
        if maps.n_singles == 0 {
            return Ok(());
        }
        check_len("attention qkv", a.qkv.len(), maps.tokens * a.row_stride)?;
        let elems = maps.tokens * a.nq * tc.hd;
        let lo_off = super::ops::lo_offset::<O>("attention out", out.len(), elems, split)?;
        if launch.cluster {
            self.decode_cluster_launch(out, a, &tc, scratch, launch, lo_off)
        } else {
            self.decode_plain_launch(out, a, &tc, scratch, launch, lo_off)
        }
    }

    /// The cluster variant: one cluster of `launch.splits` blocks per (row, KV head).
    fn decode_cluster_launch<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        tc: &TcShape<'_>,
        scratch: &AttentionScratch,
        launch: DecodeLaunch,
        lo_off: i64,
    ) -> Result<(), EngineError> {
        let (rows, splits) = (a.maps.n_singles, launch.splits);
        let f = self.func(&tc.kernel(&decode_cluster_kernel(O::SUFFIX, tc.group, tc.hd)))?;
        let cfg = ClusterConfig {
            grid: (rows as u32, tc.nkv as u32, splits as u32),
            block: 128,
            shared_mem_bytes: decode_smem_bytes(tc.hd, launch.stages, tc.fp8()),
            cluster: (1, 1, splits as u32),
        };
        let mut p = RawParams::new();
        p.slice(self, out);
        tc.push_raw(self, &mut p, a, a.maps.singles);
        p.slice(self, &scratch.part_acc)
            .slice(self, &scratch.part_ml)
            .slice(self, &scratch.counters)
            .long(lo_off);
        // SAFETY: the parameters follow ATTENTION_DECODE_CLUSTER's signature (the plain
        // kernel's: `out`, the shape arguments of push_raw in push_args' order, the unused
        // split scratch, lo_off); shapes checked by the caller; one cluster per (row, KV head),
        // the grid's z extent, as the kernel's merge assumes.
        unsafe { self.launch_clustered(f, &cfg, &mut p) }
    }

    /// The plain kernel: `launch.splits` blocks per (row, KV head) merging through the
    /// scratch.
    fn decode_plain_launch<O: DeviceElem>(
        &self,
        out: &mut CudaSlice<O>,
        a: &AttentionInputs<'_>,
        tc: &TcShape<'_>,
        scratch: &mut AttentionScratch,
        launch: DecodeLaunch,
        lo_off: i64,
    ) -> Result<(), EngineError> {
        let (rows, splits) = (a.maps.n_singles, launch.splits);
        let (nkv, hd, group) = (tc.nkv, tc.hd, tc.group);
        if splits > 1 {
            scratch.ensure(self, rows * nkv * splits * group, hd, rows * nkv)?;
        }
        let f = self.func(&tc.kernel(&decode_kernel(O::SUFFIX, group, hd)))?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, nkv as u32, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: decode_smem_bytes(hd, launch.stages, tc.fp8()),
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(out);
        tc.push_args(&mut b, a, &a.maps.singles);
        b.arg(&scratch.part_acc)
            .arg(&scratch.part_ml)
            .arg(&scratch.counters)
            .arg(&lo_off);
        // SAFETY: signature matches; shapes checked by the caller; `singles` holds `rows`
        // valid token indices (built with the maps); with splits > 1 the scratch holds every
        // partial state and counter the launch touches (ensured above); block ids were
        // validated by the caller.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching attention_decode"))?;
        Ok(())
    }

    /// Blocks of `attention_decode.cu` (bf16 output) one SM holds at once at `group` q heads
    /// per KV head, `head_dim` and `stages` shared-memory stages (benchmarks report it).
    pub fn decode_attention_blocks_per_sm(
        &self,
        group: usize,
        head_dim: usize,
        stages: usize,
    ) -> Result<u32, EngineError> {
        self.loaded(&decode_kernel("bf16", group, head_dim))?
            .occupancy_max_active_blocks_per_multiprocessor(
                128,
                decode_smem_bytes(head_dim, stages, false) as usize,
                None,
            )
            .map_err(cuda_err("attention_decode occupancy"))
    }
}

/// `launch` is one `attention_decode.cu` takes for `tc`: a group of at most 16 q heads, 1 to
/// MAX_SPLITS splits, one or two stages; a cluster only for an output its program has a
/// cluster variant of and at most MAX_CLUSTER splits.
fn check_decode_launch<O: DeviceElem>(
    tc: &TcShape<'_>,
    nq: usize,
    launch: DecodeLaunch,
) -> Result<(), EngineError> {
    let (nkv, group) = (tc.nkv, tc.group);
    let DecodeLaunch {
        splits,
        stages,
        cluster,
    } = launch;
    if group > 16 || !(1..=MAX_SPLITS).contains(&splits) || !(1..=2).contains(&stages) {
        return Err(bad(format!(
            "attention_decode: {nq} q heads over {nkv} KV heads (group ≤ 16), {splits} splits \
             (1-{MAX_SPLITS}), {stages} stages (1 or 2)"
        )));
    }
    // The main program's cluster variant writes 16-bit outputs, the KV programs' f32 too.
    let cluster_out = O::SUFFIX == "bf16" || tc.program.is_some();
    if cluster && (!cluster_out || splits > MAX_CLUSTER) {
        return Err(bad(format!(
            "attention_decode: the cluster variant takes a 16-bit output ({} given) and at \
             most {MAX_CLUSTER} splits ({splits} given)",
            O::SUFFIX
        )));
    }
    Ok(())
}

/// Dynamic shared memory of `attention_decode.cu` at `head_dim` with `stages` stages of K and
/// V runs (the prefill kernel's layout; the kernel double-buffers when given two; over an FP8
/// pool, `fp8`, one 16-bit slot and `stages` byte stages of codes and scales), and at least
/// its merge area: 4 warps × 16 heads × (head_dim + 4) f32 outputs and (max, sum) pairs.
pub(super) fn decode_smem_bytes(head_dim: usize, stages: usize, fp8: bool) -> u32 {
    let wide = 2 * FA_KEYS * (head_dim + FA_PAD) * 2;
    let runs = if fp8 {
        wide + stages * (2 * FA_KEYS * head_dim + 2 * FA_KEYS * 4)
    } else {
        stages * wide
    };
    let merge = 4 * 16 * (head_dim + 4 + 2) * 4;
    runs.max(merge) as u32
}

/// The `attention_decode.cu` kernel for an output type, a group size (q heads per KV head, at
/// most 16: one or two n8 tiles) and a head size.
pub(super) fn decode_kernel(out: &str, group: usize, head_dim: usize) -> String {
    let heads = if group <= 8 { 8 } else { 16 };
    format!("attention_decode_{out}_n{heads}_hd{head_dim}")
}

/// The cluster variant of [`decode_kernel`] (16-bit output only in the main program).
pub(super) fn decode_cluster_kernel(out: &str, group: usize, head_dim: usize) -> String {
    decode_kernel(out, group, head_dim).replace("attention_decode_", "attention_decode_cluster_")
}

#[cfg(test)]
mod tests {
    use super::super::attention::kv_stages_smem_bytes;
    use super::{decode_cluster_kernel, decode_kernel, decode_smem_bytes};

    #[test]
    fn decode_shared_memory_holds_its_stages_and_merge_area() {
        for hd in [64, 128] {
            // Two stages are the prefill kernel's K/V layout (the attribute set at load).
            assert_eq!(decode_smem_bytes(hd, 2, false), kv_stages_smem_bytes(hd));
            let one = decode_smem_bytes(hd, 1, false);
            assert_eq!(one * 2, kv_stages_smem_bytes(hd));
            // The merge area: 4 warps × 16 heads × (hd + 4) outputs, plus (max, sum) pairs.
            assert!(one as usize >= 4 * 16 * (hd + 4) * 4 + 4 * 16 * 2 * 4);
            // FP8: one 16-bit slot and the byte stages, both within the attribute set at load.
            let (f1, f2) = (
                decode_smem_bytes(hd, 1, true),
                decode_smem_bytes(hd, 2, true),
            );
            assert!(
                one < f1 && f1 < f2 && f2 <= kv_stages_smem_bytes(hd),
                "{f1} {f2}"
            );
            assert_eq!(f2 - f1, (2 * 64 * hd + 2 * 64 * 4) as u32);
        }
    }

    #[test]
    fn decode_kernel_takes_one_or_two_head_tiles() {
        assert_eq!(
            decode_kernel("bf16", 2, 128),
            "attention_decode_bf16_n8_hd128"
        );
        assert_eq!(decode_kernel("f32", 8, 64), "attention_decode_f32_n8_hd64");
        assert_eq!(
            decode_kernel("bf16", 9, 128),
            "attention_decode_bf16_n16_hd128"
        );
        assert_eq!(
            decode_kernel("bf16", 16, 64),
            "attention_decode_bf16_n16_hd64"
        );
        assert_eq!(
            decode_cluster_kernel("bf16", 2, 128),
            "attention_decode_cluster_bf16_n8_hd128"
        );
        assert_eq!(
            decode_cluster_kernel("f32", 16, 64),
            "attention_decode_cluster_f32_n16_hd64"
        );
    }
}
